"""The walking skeleton end to end: real emulator servers over HTTP, real Parquet, DuckDB, Dagster execution."""

import json

import dagster as dg
import duckdb
import pyarrow.parquet as pq
import pytest

from dflash_assets.defs.metadata import CheckKeys, PromptShardKeys, ReportKeys, ShardRunKeys, TrainingSetKeys, keys
from dflash_assets.defs.partitions import shard_partitions
from dflash_assets.defs.quality.assets import length_quality_summary
from dflash_assets.defs.resources import FleetResource, PromptSourceResource, QualityResource
from dflash_assets.defs.training.assets import drafter_training_set
from dflash_assets.quality import CHECKS
from tests.support import dagster_run
from tests.support.dagster_run import ASSETS, checks_of, run_shard
from tests.support.forks import start_emulator
from tests.support.shards import FAST, questions, write_prompts

pytestmark = pytest.mark.long


def resources(tmp_path, urls, shard_size: int, **fleet):
    # a trainer that reads 8192 tokens: the cuts at 4096 lie inside its window and block (at the
    # default 4096 window they are window-complete: tests/generation/test_window_policy.py)
    return {
        **dagster_run.resources(tmp_path, urls, shard_size, **fleet),
        "quality": QualityResource(trainer={"max_length": 8192}),
    }


def completion_rows(tmp_path, where: str = "true") -> list[tuple]:
    return duckdb.sql(
        f"select prompt_id, config_hash, finish_reason from read_parquet("
        f"'{tmp_path}/data/completions/**/*.parquet') where {where} order by all"
    ).fetchall()


def test_two_partitions_materialise_end_to_end(tmp_path, fleet_urls):
    write_prompts(tmp_path / "prompts.jsonl", questions(30))
    res = resources(tmp_path, fleet_urls, shard_size=15)
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000", "00001"])
        results = [run_shard(instance, res, s, cap=32000) for s in ("00000", "00001")]
    assert all(r.success for r in results)
    rows = completion_rows(tmp_path)
    assert len(rows) == 30 and len({r[0] for r in rows}) == 30
    meta = results[1].asset_materializations_for_node("completions")[0].metadata
    assert meta["prompts"].value == 15 and meta["completed"].value == 15
    assert meta["accounting"].value == "15 prompts = 15 completed + 0 rejected + 0 failed"
    servers = json.loads(json.dumps(meta["servers"].value))
    assert set(servers) == set(fleet_urls), "work was spread over both servers"
    # exactly the keys its readers (the demo, the cap plan) take from defs/metadata.py; by_turn is all_turns' only
    assert set(meta) == keys(ShardRunKeys) - {ShardRunKeys.BY_TURN}
    report = results[0].asset_materializations_for_node("length_quality_report")[0]
    assert report.partition == "00000"
    # and the keys the demo's table reads from the other assets
    assert keys(ReportKeys) <= set(report.metadata)
    assert keys(PromptShardKeys) <= set(results[0].asset_materializations_for_node("prompt_shards")[0].metadata)
    checks = results[0].get_asset_check_evaluations()
    assert len(checks) == len(CHECKS) and all(
        e.metadata[CheckKeys.FAILING_SHARDS].value == ([] if e.passed else ["00000"]) for e in checks
    )
    # every completion row records the config that made it
    cols = duckdb.sql(
        f"select distinct max_output_tokens, server_context_length, model, enable_thinking, "
        f"temperature, top_p, top_k from read_parquet('{tmp_path}/data/completions/**/*.parquet')"
    ).fetchall()
    assert cols == [(32000, 32768, cols[0][2], True, 0.6, 0.95, 20)]


def test_truncation_check_fails_at_a_low_cap_and_passes_at_a_high_one(tmp_path, fleet_urls):
    write_prompts(tmp_path / "prompts.jsonl", questions(200))
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        low = run_shard(
            instance,
            resources(tmp_path / "low", fleet_urls, 200)
            | {"prompt_source": PromptSourceResource(path=str(tmp_path / "prompts.jsonl"), shard_size=200)},
            "00000",
            cap=4096,
        )
        high = run_shard(
            instance,
            resources(tmp_path / "high", fleet_urls, 200)
            | {"prompt_source": PromptSourceResource(path=str(tmp_path / "prompts.jsonl"), shard_size=200)},
            "00000",
            cap=32000,
        )
    assert checks_of(low)["truncation_rate"] is False
    assert not low.success, "a failing blocking check stops the run"
    truncated = duckdb.sql(
        f"select avg((finish_reason = 'length')::int) from read_parquet('{tmp_path}/low/data/completions/**/*.parquet')"
    ).fetchall()[0][0]
    assert 0.12 <= truncated <= 0.25, truncated
    evaluation = [e for e in low.get_asset_check_evaluations() if e.check_name == "truncation_rate"][0]
    assert f"{truncated * 100:.2f}%" in evaluation.metadata["summary"].value
    assert checks_of(high)["truncation_rate"] is True and high.success


def test_a_shard_past_the_truncation_limit_gets_its_report_and_histogram_in_the_run_whose_gate_fails(
    tmp_path, fleet_urls
):
    write_prompts(tmp_path / "prompts.jsonl", questions(200))
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        run = dg.materialize(
            ASSETS + [length_quality_summary, drafter_training_set],
            instance=instance,
            partition_key="00000",
            resources=resources(tmp_path, fleet_urls, 200),
            raise_on_error=False,
            run_config={"ops": {"completions": {"config": {"max_output_tokens": 4096, "cap_policy": "fixed"}}}},
        )
    truncated = duckdb.sql(
        f"select avg((finish_reason = 'length')::int) from read_parquet('{tmp_path}/data/completions/**/*.parquet')"
    ).fetchall()[0][0]
    assert 0.12 <= truncated <= 0.25, truncated
    assert checks_of(run)["truncation_rate"] is False and not run.success
    report = run.asset_materializations_for_node("length_quality_report")
    assert [m.partition for m in report] == ["00000"], "the report materialises while its check fails"
    meta = report[0].metadata
    assert meta["truncation_rate"].value == f"{truncated * 100:.2f}%" and meta["p90"].value == 4096
    assert meta["completion_lengths"].value.startswith("![completion lengths](data:image/png;base64,")
    assert (tmp_path / "data" / "reports" / "shard=00000" / "completion_lengths.png").stat().st_size > 1000
    # the summary (a diagnostic too) materialises; the blocking check stops the training set, never started
    assert run.asset_materializations_for_node("length_quality_summary")
    assert not [e for e in run.all_events if e.step_key == "drafter_training_set"]


def test_partial_run_then_rerun_completes_without_duplicates(tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", questions(40))
    with start_emulator(FAST + ["--fault-crash-after", "12"]) as crashing:
        res = resources(tmp_path, crashing.url, shard_size=40, health_timeout_s=3)  # each retry finds it gone
        with dagster_run.instance() as instance:
            instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
            first = run_shard(
                instance,
                res,
                "00000",
                cap=32000,
                commit_rows=1,
                max_in_flight_per_server=2,
                no_server_timeout_s=3,
                max_attempts=2,
            )
            assert not first.success
            partial = completion_rows(tmp_path)
            assert 0 < len(partial) < 40
            with start_emulator(FAST) as healthy:
                second = run_shard(instance, resources(tmp_path, healthy.url, 40), "00000", cap=32000)
    assert second.success
    rows = completion_rows(tmp_path)
    assert len(rows) == 40 and len({r[0] for r in rows}) == 40
    meta = second.asset_materializations_for_node("completions")[0].metadata
    assert meta["already_done"].value == len(partial)
    assert set(partial) <= set(rows), "committed rows are kept, not regenerated"


def test_malformed_line_is_rejected_with_its_reason_while_the_rest_completes(tmp_path, fleet_urls):
    write_prompts(tmp_path / "prompts.jsonl", questions(10), {3: '{"messages": [{"role": "user", "content": "cut'})
    res = resources(tmp_path, fleet_urls, shard_size=11)
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        result = run_shard(instance, res, "00000", cap=32000)
    assert result.success
    assert len(completion_rows(tmp_path)) == 10
    rejects = duckdb.sql(
        f"select line, stage, reason from read_parquet('{tmp_path}/data/rejects/**/*.parquet')"
    ).fetchall()
    assert len(rejects) == 1 and rejects[0][:2] == (4, "source")
    assert rejects[0][2] == "line 4: invalid JSON: Unterminated string starting at (column 43)"
    meta = result.asset_materializations_for_node("prompt_shards")[0].metadata
    assert (meta["lines"].value, meta["prompts"].value, meta["rejected"].value) == (11, 10, 1)


def test_prompt_over_the_context_length_is_rejected_at_the_shard(tmp_path):
    long = json.dumps({"id": "long", "prompt": "word " * 600})
    write_prompts(tmp_path / "prompts.jsonl", questions(5), {2: long})
    short = ["--context-length", "512", "--length-median", "40", "--length-sigma", "0.2"]
    with start_emulator(FAST + short) as small:
        res = resources(tmp_path, small.url, shard_size=6)
        with dagster_run.instance() as instance:
            instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
            result = run_shard(instance, res, "00000", cap=400)
    assert result.success
    [(reason,)] = duckdb.sql(f"select reason from read_parquet('{tmp_path}/data/rejects/**/*.parquet')").fetchall()
    assert reason.startswith("line 3: prompt of ") and "longer than the model's context length (512 tokens)" in reason
    assert len(completion_rows(tmp_path)) == 5


@pytest.mark.parametrize(
    "fleet,message",
    [
        # the mode as the environment gives it (an EnvVar is resolved at run launch): checked when the fleet starts
        ({"mode": "kubernetes"}, "fleet mode must be one of emulated, attach, launch, got 'kubernetes'"),
        ({"mode": "attach", "urls": "10.0.0.5:30000"}, "server URL '10.0.0.5:30000' must look like http://host:port"),
    ],
)
def test_bad_fleet_settings_fail_before_any_work(tmp_path, fleet, message):
    write_prompts(tmp_path / "prompts.jsonl", questions(3))
    res = resources(tmp_path, "http://127.0.0.1:9", 3) | {"fleet": FleetResource(**fleet)}  # this fleet replaced
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        result = run_shard(instance, res, "00000", cap=100)
    assert not result.success
    errors = " ".join(str(e.event_specific_data.error) for e in result.all_events if e.is_failure)
    assert message in errors
    assert not (tmp_path / "data").exists()


def test_fleet_settings_are_checked_where_they_are_built():
    from dflash_assets.settings import FleetSettings, SettingsError

    with pytest.raises(SettingsError, match="fleet mode 'attach' needs at least one server URL"):
        FleetResource(mode="attach", urls="")
    with pytest.raises(SettingsError, match="^fleet mode must be one of emulated, attach, launch, got 'kubernetes'$"):
        FleetSettings(mode="kubernetes")
    with pytest.raises(SettingsError, match="^fleet num_servers must be >= 1, got 0$"):
        FleetSettings(num_servers=0)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"max_output_tokens": 0}, "max_output_tokens must be a positive integer, got 0"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ],
)
def test_bad_generation_settings_fail_before_any_request(tmp_path, fleet_urls, config, message):
    write_prompts(tmp_path / "prompts.jsonl", questions(3))
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        result = run_shard(instance, resources(tmp_path, fleet_urls, 3), "00000", cap=100, **config)
    assert not result.success
    errors = " ".join(str(e.event_specific_data.error) for e in result.all_events if e.is_failure)
    assert message in errors
    assert not (tmp_path / "data" / "completions").exists() or completion_rows(tmp_path) == []


def test_a_shard_size_of_zero_is_refused(tmp_path, fleet_urls):
    write_prompts(tmp_path / "prompts.jsonl", questions(3))
    res = resources(tmp_path, fleet_urls, 0)
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        result = run_shard(instance, res, "00000", cap=100)
    assert not result.success
    errors = " ".join(str(e.event_specific_data.error) for e in result.all_events if e.is_failure)
    assert "shard_size must be a positive integer, got 0" in errors


def test_training_set_is_refused_while_a_blocking_check_fails_and_written_once_clean(tmp_path, fleet_urls):
    from dflash_assets.defs.training.assets import drafter_training_set

    write_prompts(tmp_path / "prompts.jsonl", questions(80))
    res = resources(tmp_path, fleet_urls, shard_size=80)
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        low = run_shard(instance, res, "00000", cap=4096)
        low_hash = low.asset_materializations_for_node("completions")[0].metadata["config_hash"].value
        export = lambda h: dg.materialize(  # noqa: E731
            [drafter_training_set],
            instance=instance,
            resources=res,
            raise_on_error=False,
            run_config={"ops": {"drafter_training_set": {"config": {"config_hash": h}}}},
        )
        refused = export(low_hash)
        assert not refused.success
        failure = [e for e in refused.all_events if e.is_step_failure][0].event_specific_data.error.message
        assert f"not exporting config {low_hash}: 1 blocking check(s) fail over all shards: truncation_rate" in failure
        high = run_shard(instance, res, "00000", cap=32000)
        high_hash = high.asset_materializations_for_node("completions")[0].metadata["config_hash"].value
        written = export(high_hash)
    assert written.success
    meta = written.asset_materializations_for_node("drafter_training_set")[0].metadata
    lines = [json.loads(line) for line in open(meta["jsonl"].value)]
    split = meta["manifest"].value["split"]  # the held-out file holds the rest (quality/training/split.py)
    assert len(lines) == split["train"]["rows"] > 0
    assert split["train"]["rows"] + split["held_out"]["rows"] == meta["dagster/row_count"].value
    first = lines[0]
    assert first["id"].endswith(f"@{high_hash}")
    assert [m["role"] for m in first["conversations"]] == ["user", "assistant"]
    assert first["conversations"][-1]["reasoning_content"] and "</think>" not in first["conversations"][-1]["content"]
    assert keys(TrainingSetKeys) <= set(meta), "every key the demo reads back (defs/metadata.py) is written"
    manifest = meta["manifest"].value
    assert manifest["rows"] + sum(manifest["excluded"].values()) == 80, manifest


def test_the_check_job_runs_over_every_shard_without_materialising(tmp_path, fleet_urls):
    from dflash_assets.definitions import defs

    write_prompts(tmp_path / "prompts.jsonl", questions(20))
    res = resources(tmp_path, fleet_urls, shard_size=10)
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000", "00001"])
        for shard in ("00000", "00001"):
            assert run_shard(instance, res, shard, cap=32000).success
        job = defs.get_repository_def().get_job("quality_checks")
        result = job.execute_in_process(instance=instance, resources=res)
    evaluations = result.get_asset_check_evaluations()
    assert {e.metadata["scope"].text for e in evaluations} == {"all shards"}
    accounting = [e for e in evaluations if e.check_name == "accounting"][0]
    assert accounting.passed
    assert result.asset_materializations_for_node("length_quality_summary")
    assert not result.asset_materializations_for_node("completions")


def test_completions_carry_fleet_tuning_advice_from_the_servers_load(tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", questions(40))
    pinned = [
        "--reasoning-parser",
        "qwen3",
        "--decode-tokens-per-s",
        "3000",
        "--max-running-requests",
        "4",
        "--length-median",
        "300",
        "--length-sigma",
        "0.2",
    ]
    with start_emulator(pinned) as server:
        res = resources(tmp_path, server.url, shard_size=40)
        with dagster_run.instance() as instance:
            instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
            result = run_shard(instance, res, "00000", cap=2048, max_in_flight_per_server=16, load_sample_s=0.2)
    assert result.success
    tuning = result.asset_materializations_for_node("completions")[0].metadata["fleet_tuning"].value
    assert "slots_pinned" in tuning and "--max-running-requests" in tuning, tuning


def test_a_backfill_range_runs_several_shards_in_one_run_with_metadata_per_shard(tmp_path, fleet_urls):
    from dflash_assets.definitions import defs

    write_prompts(tmp_path / "prompts.jsonl", questions(30))
    res = resources(tmp_path, fleet_urls, shard_size=10)
    job = defs.get_repository_def().get_job("shard_pipeline")
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000", "00001", "00002"])
        result = job.execute_in_process(
            instance=instance,
            resources=res,
            run_config={"ops": {"completions": {"config": {"max_output_tokens": 32000, "cap_policy": "fixed"}}}},
            tags={"dagster/asset_partition_range_start": "00000", "dagster/asset_partition_range_end": "00002"},
        )
    assert result.success
    mats = result.asset_materializations_for_node("completions")
    assert sorted(m.partition for m in mats) == ["00000", "00001", "00002"]
    assert {m.partition: m.metadata["prompts"].value for m in mats} == {"00000": 10, "00001": 10, "00002": 10}
    assert len({m.metadata["output_tokens"].value for m in mats}) == 3, "each shard carries its own figures"
    reports = result.asset_materializations_for_node("length_quality_report")
    assert sorted(m.partition for m in reports) == ["00000", "00001", "00002"]
    evaluation = [e for e in result.get_asset_check_evaluations() if e.check_name == "accounting"][0]
    assert evaluation.passed and evaluation.metadata["scope"].text == "shard 00000, shard 00001, shard 00002"
    assert len(completion_rows(tmp_path)) == 30


def test_raising_the_cap_keeps_the_old_rows_tagged_and_adds_the_new_configs_beside_them(tmp_path, fleet_urls):
    write_prompts(tmp_path / "prompts.jsonl", questions(30))
    res = resources(tmp_path, fleet_urls, shard_size=30)
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        run_shard(instance, res, "00000", cap=4096)
        before = completion_rows(tmp_path)
        second = run_shard(instance, res, "00000", cap=8192)
    after = completion_rows(tmp_path)
    by_config = duckdb.sql(
        f"select max_output_tokens, count(*), count(distinct prompt_id) from read_parquet("
        f"'{tmp_path}/data/completions/**/*.parquet') group by all order by 1"
    ).fetchall()
    assert by_config == [(4096, 30, 30), (8192, 30, 30)]
    assert set(before) <= set(after), "the 4096 rows are kept as they were"
    meta = second.asset_materializations_for_node("completions")[0].metadata
    assert meta["already_done"].value == 0 and meta["completed"].value == 30
    # the run judges the config it wrote, alone: the 4096 rows beside it are never pooled into its figures
    mix = [e for e in second.get_asset_check_evaluations() if e.check_name == "config_consistency"][0]
    assert mix.passed and mix.metadata["judged"].text == meta["config_hash"].text, mix.metadata
    assert mix.metadata["verdicts"].value == [
        {"shard": "00000", "config_hash": meta["config_hash"].text, "passed": True, "superseded": False}
    ]


def test_the_api_key_never_reaches_the_event_log_metadata_or_run_config(tmp_path, monkeypatch):
    secret = "sk-dflash-test-3c1f9a"
    monkeypatch.setenv("DFLASH_API_KEY", secret)
    write_prompts(tmp_path / "prompts.jsonl", questions(6))
    with start_emulator(FAST + ["--api-key", secret]) as server:
        res = resources(tmp_path, server.url, shard_size=6, api_key=dg.EnvVar("DFLASH_API_KEY"))
        with dagster_run.instance() as instance:
            instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
            result = run_shard(instance, res, "00000", cap=32000)
            records = instance.get_records_for_run(result.run_id).records
            run = instance.get_run_by_id(result.run_id)
    assert result.success, "the key reached the servers (they answer 401 without it)"
    logged = "\n".join(str(r.event_log_entry) for r in records)
    assert secret not in logged and secret not in json.dumps(run.run_config, default=str)
    tables = list((tmp_path / "data").rglob("*.parquet"))
    assert tables, "the run wrote its tables"
    for table in tables:  # every value of every column, and the file's own metadata, as text
        parquet = pq.read_table(table)
        assert secret not in json.dumps(parquet.to_pylist(), default=str), table
        assert secret not in str(parquet.schema.metadata), table


def test_new_completions_trigger_the_check_job_once_each(tmp_path, fleet_urls):
    from dflash_assets.definitions import defs
    from dflash_assets.defs.quality.sensors import completions_landed_sensor

    write_prompts(tmp_path / "prompts.jsonl", questions(5))
    res = resources(tmp_path, fleet_urls, shard_size=5)
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        assert run_shard(instance, res, "00000", cap=32000).success
        data = {k: res[k] for k in ("prompt_source", "data_dir")}  # what the sensor checks the source with
        context = dg.build_sensor_context(instance=instance, definitions=defs, resources=data)
        first = completions_landed_sensor.evaluate_tick(context)
        again = completions_landed_sensor.evaluate_tick(
            dg.build_sensor_context(instance=instance, definitions=defs, resources=data, cursor=first.cursor)
        )
    # an asset sensor's run requests name no job of their own: they run the sensor's job, the check suite
    assert completions_landed_sensor.job_name == "quality_checks"
    assert [r.job_name for r in first.run_requests] == [None]
    assert first.run_requests[0].tags["dflash/trigger"] == "completions 00000"
    assert again.run_requests == [], "the same materialisation does not trigger twice"


def test_a_checks_only_run_judges_every_config_apart_and_a_superseded_one_fails_no_result(tmp_path):
    from dflash_assets.defs.quality.assets import length_quality_report
    from dflash_assets.defs.quality.checks import completions_quality_checks
    from dflash_assets.defs.resources import DataDirResource
    from tests.support.quality_data import superseded_configs

    superseded_configs(tmp_path / "data")  # a4096 and c8192 left incomplete in s1, then b8192 run to the end
    checks = dg.Definitions(
        assets=[length_quality_report],
        asset_checks=[completions_quality_checks],
        jobs=[dg.define_asset_job("checks", selection=dg.AssetSelection.checks_for_assets(length_quality_report))],
        resources={"data_dir": DataDirResource(path=str(tmp_path / "data")), "quality": QualityResource()},
    )
    with dagster_run.instance() as instance:
        result = checks.resolve_job_def("checks").execute_in_process(instance=instance)
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    accounting = evaluations["accounting"]
    assert accounting.passed, accounting.description
    assert accounting.metadata[CheckKeys.JUDGED].text == "a4096, c8192, b8192"  # in the order written
    assert accounting.metadata[CheckKeys.VERDICTS].value == [
        {"shard": None, "config_hash": "a4096", "passed": False, "superseded": True},
        {"shard": None, "config_hash": "c8192", "passed": False, "superseded": True},
        {"shard": None, "config_hash": "b8192", "passed": True, "superseded": False},
    ]
    summary = accounting.metadata[CheckKeys.SUMMARY].value
    assert "**all shards, config a4096** (superseded: reported apart, blocks nothing)" in summary, summary
    assert "config `a4096`, superseded (followed by config `c8192`)" in summary
    # every config judged apart: none of them pooled, so none mixes configs
    assert evaluations["config_consistency"].passed
    assert all(e.passed for e in evaluations.values() if e.check_name in {c.name for c in CHECKS if c.blocking})
