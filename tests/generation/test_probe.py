"""The length probe: a seeded, stratified sample at a high cap, materialised alone, then read by the cap plan."""

from collections import Counter

import dagster as dg
import duckdb
import pytest

from dflash_assets.defs.completions.assets import completions
from dflash_assets.defs.probe.assets import length_probe
from dflash_assets.defs.quality.assets import length_quality_summary
from dflash_assets.generation.probe import probe_size, sample_prompts
from dflash_assets.quality import run_checks
from dflash_assets.settings import SAMPLING_PARAMS, GenerationSettings
from dflash_assets.store.schema import PromptRow
from tests.support.probe_project import probe_project, write_completions, write_probe
from tests.support.shards import longest_prompt

SHARDS, PER_SHARD = ["00000", "00001", "00002"], 120
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


def test_the_default_size_is_the_larger_of_500_and_1_percent():
    assert (probe_size(300), probe_size(20_000), probe_size(913_786)) == (300, 500, 9138)


def test_the_sample_is_seeded_and_stratified_by_shard_and_source():
    rows = [
        PromptRow(prompt_id=f"{s}-{i}", shard=s, line=i, source="math" if i % 4 == 0 else "chat")
        for s in ("a", "b")
        for i in range(400)
    ]
    sample = sample_prompts(rows, 80, seed=7)
    assert len(sample) == 80 and len({r.prompt_id for r in sample}) == 80
    assert Counter((r.shard, r.source) for r in sample) == {
        ("a", "chat"): 30,
        ("a", "math"): 10,
        ("b", "chat"): 30,
        ("b", "math"): 10,
    }
    assert sample == sample_prompts(list(reversed(rows)), 80, seed=7)  # the same rows and seed, the same sample
    assert sample != sample_prompts(rows, 80, seed=8)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    with probe_project(tmp, FLAGS, SHARDS, PER_SHARD) as (instance, res):
        yield tmp / "data", instance, res


def summary(project) -> dict:
    data, instance, res = project
    result = dg.materialize(
        [length_quality_summary], instance=instance, resources=res, selection=[length_quality_summary]
    )
    assert result.success
    return {k: v.value for k, v in result.asset_materializations_for_node("length_quality_summary")[0].metadata.items()}


def test_without_rows_the_summary_says_there_is_nothing_to_plan_from(project):
    assert summary(project)["cap_plan"].startswith("no cap plan: no completion rows under")


def test_the_run_at_1024_plans_with_a_model_and_says_how_to_probe_and_what_it_costs(project):
    data, instance, res = project
    for shard in SHARDS:
        assert dg.materialize(
            [completions],
            partition_key=shard,
            instance=instance,
            resources=res,
            run_config={"ops": {"completions": {"config": {"max_output_tokens": 1024, "cap_policy": "fixed"}}}},
        ).success
    meta = summary(project)
    md = meta["cap_plan"]
    assert meta["cap_plan_source"] == "model (censored lognormal tail) beyond the cap"
    assert "| 4,096 | " in md and "**model**; the rows support" in md
    assert "**No length probe yet**" in md and "Materialise `length_probe`" in md
    assert f"{probe_size(360)} of {len(SHARDS) * PER_SHARD} prompts" in md
    assert "Predicted output: about" in md and "GPU-hours on 1 servers" in md
    # how precise that probe will be, at worst, from the binomial of its rows above the cap, and the size for ±1 pp
    from dflash_assets.quality.planning.probe_estimates import ProbePrecision

    honest = (meta["truncated_rows"] - meta["runaway_rows"]) / meta["rows"]
    expected = ProbePrecision.expected(1024, honest, probe_size(360))
    assert f"It will measure the share cut at each larger cap to ±{expected.half_width * 100:.2f} pp at worst" in md
    assert (f"{expected.rows_for_target:,} prompts would give ±1 pp" in md) == (not expected.enough)
    # the continuation probe (mode cut_rows): every one of its rows is a cut row, so it is never wider (here, 360
    # prompts, it takes all 46 honest cut rows: as many as a random probe of all 360 prompts would have above the cap)
    cut_rows = meta["truncated_rows"] - meta["runaway_rows"]
    continued = ProbePrecision.expected(1024, honest, cut_rows, continued=True)
    assert (
        f"With `mode: cut_rows` it continues {cut_rows} of this run's honest cut rows to its cap instead (decode "
        f"only past the cap): every row measures the tail, ±{continued.half_width * 100:.2f} pp at worst."
    ) in md
    assert continued.rows == continued.rows_above == cut_rows and continued.half_width <= expected.half_width
    # the emulator's looping generations are told apart, in the report and in the plan
    assert 0 < meta["runaway_rows"] < meta["truncated_rows"]
    assert f"Of the cut rows {meta['runaway_rows']} are runaways (looping)" in md
    assert meta["cap_plan_picture"].startswith("![cap plan](data:image/png;base64,")


def test_the_probe_materialises_alone_and_the_plan_then_measures_with_it(project):
    data, instance, res = project
    result = dg.materialize(
        [length_probe],
        instance=instance,
        resources=res,
        selection=[length_probe],
        run_config={"ops": {"length_probe": {"config": {"min_prompts": 90}}}},
    )
    assert result.success
    meta = {k: v.value for k, v in result.asset_materializations_for_node("length_probe")[0].metadata.items()}
    longest = longest_prompt(data / "prompt_shards")
    assert meta["prompts_sampled"] == meta["completed"] == 90 and meta["prompts_total"] == 360
    assert meta["max_output_tokens"] <= 32768 - 2 - 1 and meta["max_output_tokens"] >= 32768 - 2 - longest
    probe_rows = duckdb.sql(
        f"SELECT prompt_id, config_hash, max_output_tokens FROM read_parquet("
        f"'{data}/length_probe/completions/**/*.parquet')"
    ).fetchall()
    assert len(probe_rows) == 90 and {r[1] for r in probe_rows} == {meta["config_hash"]}
    run_hashes = {
        r[0]
        for r in duckdb.sql(
            f"SELECT DISTINCT config_hash FROM read_parquet('{data}/completions/**/*.parquet')"
        ).fetchall()
    }
    assert meta["config_hash"] not in run_hashes  # its own config, and not in the run's (training) rows
    assert run_checks(data, names=["truncation_rate"])[0].metadata["rows"] == 360
    # stratified: every shard and source of the prompts is in the sample, in proportion
    by_shard = Counter(
        r[0]
        for r in duckdb.sql(
            f"SELECT p.shard FROM read_parquet('{data}/prompt_shards/**/*.parquet') p WHERE prompt_id IN "
            f"(SELECT prompt_id FROM read_parquet('{data}/length_probe/completions/**/*.parquet'))"
        ).fetchall()
    )
    assert by_shard == {s: 30 for s in SHARDS}

    meta = summary(project)
    md = meta["cap_plan"]
    assert meta["cap_plan_source"] == "measured by the length probe"
    assert "measured (probe of 90)" in md and "**measured** by a length probe (90 random prompts" in md
    assert "No length probe yet" not in md
    assert "| 4,096 | " in md and "**model**" not in md.split("| 4,096 | ")[1].split("\n")[0]


def test_a_probe_is_used_only_for_its_current_sample_and_the_same_model_and_sampling(tmp_path):
    import numpy as np

    from dflash_assets.quality.planning.planner import plan_caps

    lengths = np.round(1640 * np.exp(np.random.default_rng(0).standard_normal(3000))).astype(int)
    for name, temperature in (("same", 0.6), ("hot", 1.0)):
        write_completions(tmp_path / name, "00000", "run", lengths, 4096)
        write_probe(tmp_path / name, f"probe-{name}", lengths[:600], sample=500, temperature=temperature)
    plan = plan_caps(tmp_path / "same", bootstrap=10)
    assert plan.probe.rows == 500 and plan.probe.config_hash == "probe-same"  # rows of earlier samples left out
    assert plan.at(8192).basis == "probe"
    assert plan_caps(tmp_path / "same", bootstrap=10, use_probe=False).at(8192).basis == "model"
    plan = plan_caps(tmp_path / "hot", bootstrap=10)
    assert plan.probe is None and plan.at(8192).basis == "model"
    assert (
        "a length probe exists (configs `probe-hot`) but none was made with the planned rows' model and "
        "sampling: it is not used" in plan.notes
    )


@pytest.mark.parametrize("name", SAMPLING_PARAMS)
def test_a_probe_made_with_another_value_of_any_sampling_parameter_is_not_used(tmp_path, name):
    import numpy as np

    from dflash_assets.quality.planning.planner import plan_caps

    run = GenerationSettings().sampling()
    other = {**run, name: type(run[name])(run[name] / 2 if run[name] else 0.5)}
    lengths = np.round(1640 * np.exp(np.random.default_rng(0).standard_normal(3000))).astype(int)
    for sampled, probe in (("same", run), ("other", other)):
        write_completions(tmp_path / sampled, "00000", "run", lengths, 4096, **run)
        write_probe(tmp_path / sampled, f"probe-{sampled}", lengths[:600], sample=500, **probe)
    assert plan_caps(tmp_path / "same", bootstrap=10).at(8192).basis == "probe"
    plan = plan_caps(tmp_path / "other", bootstrap=10)
    assert plan.probe is None and plan.at(8192).basis == "model", f"a probe with {name}={other[name]} was used"
