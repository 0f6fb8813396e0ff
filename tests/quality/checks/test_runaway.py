"""Runaway generations: told from honest long answers by their text, counted apart, warned about per shard/config."""

import asyncio
import json

import duckdb
import pytest

from dflash_assets.emulator import model, tokenizer
from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.runaway import is_runaway
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality import length_quality, run_checks
from dflash_assets.settings import DispatchSettings, GenerationSettings, QualitySettings, RunawaySettings
from tests.support.forks import start_emulator

PROSE = model.completion_tokens(model.plan_completion(tokenizer.encode("q"), model.LengthModel()), 0, 3000)[1]


def test_a_line_repeated_to_the_cap_is_a_runaway_and_prose_is_not():
    assert is_runaway("Let me think again about the sum.\n" * 200)
    assert is_runaway("Wait, so the answer is 12 or maybe 13, let me check that again. " * 60)  # no newlines
    assert not is_runaway(PROSE)  # 3,000 tokens of the emulator's honest text
    assert not is_runaway("short\n" * 3) and not is_runaway(None) and not is_runaway("")


def test_the_thresholds_decide_what_counts_as_a_loop():
    half = PROSE[:2000] + "The same line again and again here.\n" * 20
    assert is_runaway(half[-4000:])
    strict = RunawaySettings(repeated_line_share=0.9, repeated_ngram_share=0.95)
    assert not is_runaway(PROSE[:3000] + "The same line again and again here.\n" * 20, strict)


def test_the_emulator_loops_a_fixed_share_of_prompts_the_same_way_every_time():
    lengths = model.LengthModel(loop_share=0.25)
    prompts = [tokenizer.encode(f"<|im_start|>user\nq{i}<|im_end|>\n<|im_start|>assistant\n") for i in range(800)]
    plans = [model.plan_completion(p, lengths) for p in prompts]
    looping = [p.looping for p in plans]
    assert 0.20 < sum(looping) / len(looping) < 0.30
    assert looping == [model.plan_completion(p, lengths).looping for p in prompts]  # deterministic per prompt
    assert all(p.total == lengths.maximum for p in plans if p.looping)
    # the other prompts keep the lengths they had without the knob
    assert [p.total for p, lp in zip(plans, looping) if not lp] == [
        model.plan_completion(p, model.LengthModel()).total for p, lp in zip(prompts, looping) if not lp
    ]
    loop = model.generate(next(p for p in plans if p.looping), 500)
    assert loop.finish == {"type": "length", "length": 500} and is_runaway(loop.text)
    assert tokenizer.encode(loop.text) == loop.output_ids  # the repeats re-tokenise to the same ids


N = 240


@pytest.fixture(scope="module")
def looping_run(tmp_path_factory):
    """240 prompts at cap 1024 on an emulator where 15% of generations loop and some honest ones run long."""
    tmp = tmp_path_factory.mktemp("runaway")
    src, data = tmp / "prompts.jsonl", tmp / "data"
    src.write_text(
        "".join(json.dumps({"id": f"r{i:03d}", "prompt": f"Question {i}: count to {i}."}) + "\n" for i in range(N))
    )
    flags = [
        "--reasoning-parser",
        "qwen3",
        "--length-median",
        "500",
        "--length-sigma",
        "0.6",
        "--length-max",
        "8192",
        "--loop-share",
        "0.15",
    ]

    async def run(url):
        async with connected([url]) as fleet:
            await build_prompt_shard(src, 0, "00000", N, data, fleet, {"enable_thinking": True})
            return await generate_shard(
                data,
                "00000",
                fleet,
                GenerationSettings(max_output_tokens=1024),
                # the runaways decode to the cap here (test_runaway_early_stop.py stops them)
                DispatchSettings(store_token_ids=True, runaway_check_tokens=0),
                log=lambda m: None,
            )

    with start_emulator(flags) as emu:
        run = asyncio.run(run(emu.url))
    rows = duckdb.sql(
        f"SELECT prompt_token_ids, finish_reason FROM read_parquet('{data}/completions/**/*.parquet')"
    ).fetchall()
    truth = model.LengthModel(median=500, sigma=0.6, maximum=8192, loop_share=0.15)
    loops = sum(model.plan_completion(list(ids), truth).looping for ids, _ in rows)
    return data, run, loops, sum(f == "length" for _, f in rows)


def test_runaways_on_the_emulator_are_counted_apart_from_honest_truncation(looping_run):
    data, run, loops, truncated = looping_run
    assert run.completed == N and 20 <= loops <= 55 and truncated > loops  # some honest rows were cut too
    report = length_quality(data)
    assert (report["runaway_rows"], report["truncated_rows"]) == (loops, truncated)
    assert report["runaway_rate"] == loops / N
    (outcome,) = run_checks(data, names=["runaway_rate"])
    assert not outcome.passed and outcome.severity == "WARN" and not outcome.blocking
    m = outcome.metadata
    assert (m["runaway_rows"], m["honest_truncated_rows"], m["worst_shard"]) == (loops, truncated - loops, "00000")
    assert outcome.summary_md.startswith(
        f"**{loops / N * 100:.2f}%** of {N} rows ({loops}) were cut at the cap "
        f"while repeating themselves (runaways), over the 0.00% threshold; "
        f"{truncated - loops} other rows were cut honestly."
    )
    assert "shard `00000`" in outcome.summary_md
    assert "raising max_output_tokens only makes it longer" in outcome.summary_md


def test_the_runaway_threshold_and_rules_come_from_the_thresholds(looping_run):
    data, _, loops, _ = looping_run
    (lenient,) = run_checks(data, names=["runaway_rate"], quality=QualitySettings(runaway_rate_max=0.5))
    assert lenient.passed and "within the 50.00% threshold" in lenient.summary_md
    never = QualitySettings(runaway=RunawaySettings(min_line_repeats=10_000, repeated_ngram_share=1.1))
    (blind,) = run_checks(data, names=["runaway_rate"], quality=never)
    assert blind.passed and blind.metadata["runaway_rows"] == 0


def test_the_runaway_rules_and_threshold_are_quality_resource_config_in_a_dagster_run(looping_run):
    import dagster as dg

    from dflash_assets.defs.partitions import shard_partitions
    from dflash_assets.defs.quality.assets import length_quality_report
    from dflash_assets.defs.quality.checks import completions_quality_checks
    from dflash_assets.defs.resources import DataDirResource, QualityResource
    from tests.support import dagster_run

    data, _, loops, _ = looping_run

    def runaway_check(quality_config: dict):
        with dagster_run.instance() as instance:  # a checks-only run, as the schedule's: every shard
            result = dg.materialize(
                [length_quality_report, completions_quality_checks],
                instance=instance,
                resources={"data_dir": DataDirResource(path=str(data)), "quality": QualityResource()},
                selection=dg.AssetSelection.checks(dg.AssetCheckKey(length_quality_report.key, "runaway_rate")),
                run_config={"resources": {"quality": {"config": quality_config}}} if quality_config else None,
            )
        assert result.success  # (a WARN check: its failure does not fail the run)
        [evaluation] = result.get_asset_check_evaluations()
        assert evaluation.check_name == "runaway_rate"
        return evaluation

    default = runaway_check({})
    assert not default.passed and default.metadata["runaway_rows"].value == loops
    # rules changed in the run config: a loop must now repeat one line in 99% of the tail's lines or 99% of its
    # 8-grams, which fewer of the emulator's loops do: fewer rows count
    strict = runaway_check({"runaway": {"repeated_line_share": 0.99, "repeated_ngram_share": 0.99}})
    assert strict.metadata["runaway_rows"].value < loops
    never = runaway_check({"runaway": {"min_line_repeats": 10_000, "repeated_ngram_share": 1.1}})
    assert never.passed and never.metadata["runaway_rows"].value == 0
    # the report counts by the same rules
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        reports = {}
        for name, rules in (("default", {}), ("never", {"min_line_repeats": 10_000, "repeated_ngram_share": 1.1})):
            result = dg.materialize(
                [length_quality_report],
                partition_key="00000",
                instance=instance,
                resources={"data_dir": DataDirResource(path=str(data)), "quality": QualityResource()},
                run_config={"resources": {"quality": {"config": {"runaway": rules}}}},
            )
            reports[name] = result.asset_materializations_for_node("length_quality_report")[0].metadata
    assert (reports["default"]["runaway_rows"].value, reports["never"]["runaway_rows"].value) == (loops, 0)
    # the threshold itself: the same loops, judged against 50%
    lenient = runaway_check({"runaway_rate_max": 0.5})
    assert lenient.passed and lenient.metadata["runaway_rows"].value == loops
    assert lenient.metadata["threshold"].value == "50.00%"  # a share, as the UI shows it


def test_the_quality_resource_defaults_are_the_thresholds_own():
    from dflash_assets.defs.resources import QualityResource

    assert QualitySettings.taken_from(QualityResource()) == QualitySettings()
    schema = QualityResource.to_config_schema().as_field().config_type.fields
    assert schema["runaway_rate_max"].default_value == QualitySettings().runaway_rate_max
    assert (
        schema["runaway"].config_type.fields["repeated_line_share"].default_value
        == RunawaySettings().repeated_line_share
    )
