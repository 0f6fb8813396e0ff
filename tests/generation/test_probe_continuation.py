"""The continuation probe (ProbeSettings.mode "cut_rows"): a random sample of the run's honest cut rows continued
to the probe's cap, through Dagster on the emulator; the plan measures with it and the truth, generated from
scratch at the larger cap, lies in its interval. (conftest sets the emulator's per-prompt sampling, so a
continued row is the row a fresh run at the larger cap makes.)"""

from datetime import UTC

import dagster as dg
import duckdb
import pytest

from dflash_assets.defs.completions.assets import completions
from dflash_assets.defs.probe.assets import length_probe
from dflash_assets.defs.quality.assets import length_quality_summary
from dflash_assets.quality import run_checks
from dflash_assets.quality.planning.planner import honest_cut_rows, plan_caps
from dflash_assets.quality.report.cap_plan import plan_markdown
from tests.support.probe_project import probe_project

SHARDS, PER_SHARD, RUN_CAP, PROBE_CAP, SAMPLE = ["00000", "00001"], 150, 512, 4096, 60
FLAGS = [
    "--decode-tokens-per-s",
    "0",
    "--reasoning-parser",
    "qwen3",
    "--length-median",
    "400",
    "--length-sigma",
    "0.9",
    "--loop-share",
    "0.05",
]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cprobe")
    with probe_project(tmp, FLAGS, SHARDS, PER_SHARD) as (instance, res):
        for shard in SHARDS:
            assert dg.materialize(
                [completions],
                partition_key=shard,
                instance=instance,
                resources=res,
                run_config={"ops": {"completions": {"config": {"max_output_tokens": RUN_CAP, "cap_policy": "fixed"}}}},
            ).success
        result = dg.materialize(
            [length_probe],
            instance=instance,
            resources=res,
            selection=[length_probe],
            run_config={
                "ops": {
                    "length_probe": {
                        "config": {"mode": "cut_rows", "min_prompts": SAMPLE, "max_output_tokens": PROBE_CAP}
                    }
                }
            },
        )
        assert result.success
        meta = {k: v.value for k, v in result.asset_materializations_for_node("length_probe")[0].metadata.items()}
        yield tmp / "data", instance, res, meta


def rows(where: str, path: str) -> list[tuple]:
    return duckdb.sql(
        f"SELECT prompt_id, config_hash, finish_reason, completion_tokens, max_output_tokens, "
        f"parent_config_hash, tokens_reused FROM read_parquet('{path}/**/*.parquet') WHERE {where}"
    ).fetchall()


def test_the_probe_continues_only_the_runs_honest_cut_rows_to_its_cap(project):
    data, _, _, meta = project
    run = rows("true", f"{data}/completions")
    (run_hash,) = {r[1] for r in run}
    parent, cap, honest = honest_cut_rows(data)
    cut = {r[0] for r in run if r[2] in ("length", "runaway")}  # a loop: cut at the cap or stopped while streaming
    assert parent == run_hash and cap == RUN_CAP and 0 < len(honest) < len(cut)  # the emulator's loops are left out
    assert meta["mode"] == "cut_rows" and meta["prompts_total"] == len(honest)
    assert meta["prompts_sampled"] == meta["completed"] == SAMPLE and meta["max_output_tokens"] == PROBE_CAP
    continued = rows(f"config_hash = '{meta['config_hash']}'", f"{data}/length_probe/completions")
    assert len(continued) == SAMPLE and {r[4] for r in continued} == {PROBE_CAP}
    assert {r[0] for r in continued} <= {pid for _, pid in honest} and {r[5] for r in continued} == {run_hash}
    # each continued from where the run cut it: 512 tokens reused, never a stopped row copied
    assert {r[6] for r in continued} == {RUN_CAP} and all(r[3] > RUN_CAP for r in continued)
    # its own directory and config: the run's (training) rows are untouched
    assert meta["config_hash"] != run_hash and len(run) == len(SHARDS) * PER_SHARD
    assert run_checks(data, names=["truncation_rate"])[0].metadata["rows"] == len(SHARDS) * PER_SHARD


def test_a_second_continuation_probe_with_the_same_sample_resumes_and_sends_nothing(project):
    data, instance, res, meta = project
    again = dg.materialize(
        [length_probe],
        instance=instance,
        resources=res,
        selection=[length_probe],
        run_config={
            "ops": {
                "length_probe": {"config": {"mode": "cut_rows", "min_prompts": SAMPLE, "max_output_tokens": PROBE_CAP}}
            }
        },
    )
    assert again.success
    second = {k: v.value for k, v in again.asset_materializations_for_node("length_probe")[0].metadata.items()}
    assert second["config_hash"] == meta["config_hash"] and second["completed"] == SAMPLE
    assert meta["output_tokens"] > 0 and second["output_tokens"] == 0
    probe_dir = f"{data}/length_probe/completions"
    assert len(rows(f"config_hash = '{meta['config_hash']}'", probe_dir)) == SAMPLE  # no duplicates
    assert len(rows(f"config_hash <> '{meta['config_hash']}'", probe_dir)) == SAMPLE  # the parents, copied once


def test_the_summary_plans_with_the_continuation_probe_and_says_so(project):
    data, instance, res, meta = project
    result = dg.materialize(
        [length_quality_summary], instance=instance, resources=res, selection=[length_quality_summary]
    )
    assert result.success
    summary = {
        k: v.value for k, v in result.asset_materializations_for_node("length_quality_summary")[0].metadata.items()
    }
    md = summary["cap_plan"]
    assert summary["cap_plan_source"] == "measured by the length probe" and "No length probe yet" not in md
    assert f"measured (continuation probe of {SAMPLE} cut rows)" in md.split("| 4,096 | ")[1].split("\n")[0]
    assert (
        f"**measured** by a continuation probe ({SAMPLE} of the run's honest cut rows continued to cap "
        f"{PROBE_CAP:,}, config `{meta['config_hash']}`)"
    ) in md


def test_the_plan_from_the_cut_rows_probe_holds_the_truth_generated_at_the_larger_caps(project):
    data, instance, res, meta = project
    plan = plan_caps(data, candidates=(RUN_CAP, 1024, PROBE_CAP), bootstrap=200)
    assert plan.probe is not None and plan.probe.continued_from == plan.config_hash and plan.probe.rows == SAMPLE
    md = plan_markdown(plan)
    assert f"| measured (continuation probe of {SAMPLE} cut rows) |" in md
    assert f"**Probe precision**: continuation probe of {SAMPLE} cut rows ({SAMPLE} honest rows cut at 512" in md
    # the truth: every prompt generated from scratch at each larger cap (a config of its own in the run's dir)
    for cap in (1024, PROBE_CAP):
        for shard in SHARDS:
            assert dg.materialize(
                [completions],
                partition_key=shard,
                instance=instance,
                resources=res,
                run_config={"ops": {"completions": {"config": {"max_output_tokens": cap, "cap_policy": "fixed"}}}},
            ).success
        at = rows(f"max_output_tokens = {cap}", f"{data}/completions")
        truth = sum(r[2] in ("length", "runaway") for r in at) / len(at)  # cut: at the cap, or a loop stopped
        e = plan.at(cap)
        assert e.basis == "probe" and len(at) == len(SHARDS) * PER_SHARD
        assert e.truncation_rate.low <= truth <= e.truncation_rate.high, (cap, truth, e.truncation_rate)
        # and it says something: the share cut at the larger cap is clearly below the share cut now
        assert e.truncation_rate.high < plan.at(RUN_CAP).truncation_rate.low


def write_continued(data_dir, parent: str, lengths, cap: int = 32000):
    """A continuation probe's rows as run_length_probe leaves them in mode cut_rows: shard cut_rows, `parent_config_hash` set."""
    from datetime import datetime

    from dflash_assets.generation.probe import CUT_ROWS_SHARD, probe_root
    from dflash_assets.store.stores import completion_store, prompt_store

    root, now = probe_root(data_dir), datetime.now(UTC)
    completion_store(root, CUT_ROWS_SHARD).commit(
        [
            {
                "prompt_id": f"c{i}",
                "shard": CUT_ROWS_SHARD,
                "source": "t",
                "config_hash": "continued",
                "finish_reason": "length" if n > cap else "stop",
                "prompt_tokens": 50,
                "completion_tokens": min(n, cap),
                "reasoning_tokens": 0,
                "max_output_tokens": cap,
                "server_context_length": 32768,
                "server_url": "u",
                "model": "m",
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
                "enable_thinking": True,
                "content": "x",
                "reasoning_content": None,
                "latency_s": 1.0,
                "attempt": 1,
                "created_at": now,
                "parent_config_hash": parent,
                "tokens_reused": 4096,
            }
            for i, n in enumerate(lengths)
        ]
    )
    prompt_store(root, CUT_ROWS_SHARD).replace(
        [
            {
                "prompt_id": f"c{i}",
                "shard": CUT_ROWS_SHARD,
                "line": i + 1,
                "source": "t",
                "messages_json": "[]",
                "prompt_tokens": 50,
                "template_kwargs_json": "{}",
            }
            for i in range(len(lengths))
        ],
        "prompts.parquet",
    )


def test_the_plan_reads_a_continuation_probe_only_for_the_config_it_continued(tmp_path):
    import numpy as np

    from tests.support.probe_project import write_completions, write_probe

    lengths = np.round(1640 * np.exp(np.random.default_rng(0).standard_normal(3000))).astype(int)
    write_completions(tmp_path, "00000", "run", lengths, 4096)
    write_completions(tmp_path, "00001", "other", lengths[:100], 4096)
    write_probe(tmp_path, "random", lengths[:600], sample=600)
    write_continued(tmp_path, "run", lengths[lengths > 4096][:200])
    plan = plan_caps(tmp_path, config_hash="run", bootstrap=10)
    assert plan.probe.continued_from == "run" and plan.probe.config_hash == "continued" and plan.probe.rows == 200
    assert plan.probe_precision[0].continued and plan.probe_precision[0].rows_above == 200
    # the random probe serves any config of the same sampling; the continuation probe only its parent's
    other = plan_caps(tmp_path, config_hash="other", bootstrap=10)
    assert other.probe.continued_from is None and other.probe.config_hash == "random" and other.probe.rows == 600
    assert "measured (probe of 600)" in plan_markdown(other)
