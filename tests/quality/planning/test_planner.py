"""The cap planner: from rows cut at one cap, what a larger cap would cut, cost and need, with honest intervals."""

import asyncio
import json
import math
from datetime import UTC, datetime

import duckdb
import numpy as np
import pytest

from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality.planning.estimate import Lengths, PlanOptions, plan_from_lengths
from dflash_assets.quality.planning.fit import PlanError, lognormal_sf
from dflash_assets.quality.planning.planner import plan_caps
from dflash_assets.quality.report.cap_plan import plan_markdown
from dflash_assets.quality.report.planner_plot import cap_plan_png
from dflash_assets.settings import GenerationSettings
from dflash_assets.store.stores import completion_store
from tests.support.forks import start_emulator

MEDIAN, SIGMA = 1640.0, 1.0  # the emulator's default output lengths


def true_rate(cap: float, median: float = MEDIAN, sigma: float = SIGMA) -> float:
    return float(lognormal_sf(math.log(cap), math.log(median), sigma))


def true_mean_tokens(cap: float, median: float = MEDIAN, sigma: float = SIGMA) -> float:
    """E[min(L, cap)] of a lognormal: its partial expectation below the cap plus the cap times P(L > cap)."""
    mu = math.log(median)
    below = math.exp(mu + sigma**2 / 2) * (1 - float(lognormal_sf(math.log(cap), mu + sigma**2, sigma)))
    return below + cap * true_rate(cap, median, sigma)


def lognormal_sample(n: int, seed: int, median: float = MEDIAN, sigma: float = SIGMA) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, np.round(median * np.exp(sigma * rng.standard_normal(n)))).astype(np.int64)


def cut_at(lengths: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    return np.minimum(lengths, cap), lengths > cap


# ---- accuracy against the emulator: plan at 4096, then really run at 8192 ---------------------------------

N_PROMPTS = 1000


def test_plan_at_4096_predicts_a_real_rerun_at_8192_on_the_emulator(tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text(
        "".join(
            json.dumps({"id": f"c{i:04d}", "prompt": f"Question {i}: how long is the answer to {i * 7919 % 1000}?"})
            + "\n"
            for i in range(N_PROMPTS)
        )
    )
    data = tmp_path / "data"

    async def run(url: str, cap: int, build: bool):
        async with connected([url]) as fleet:
            if build:
                await build_prompt_shard(src, 0, "00000", N_PROMPTS, data, fleet, {"enable_thinking": True})
            return await generate_shard(
                data, "00000", fleet, GenerationSettings(max_output_tokens=cap, cap_policy="fixed"), log=lambda m: None
            )

    with start_emulator(["--reasoning-parser", "qwen3"]) as emu:  # instant decode, default lengths
        at_4096 = asyncio.run(run(emu.url, 4096, build=True))
        plan = plan_caps(data, at_4096.config_hash)
        at_8192 = asyncio.run(run(emu.url, 8192, build=False))
    observed_rate, observed_tokens = duckdb.sql(
        f"SELECT avg((finish_reason = 'length')::INT), sum(completion_tokens) FROM "
        f"read_parquet('{data}/completions/**/*.parquet') WHERE config_hash = '{at_8192.config_hash}'"
    ).fetchall()[0]
    predicted = plan.at(8192)
    assert plan.rows == at_8192.completed == N_PROMPTS
    assert 0.15 < plan.truncated / plan.rows < 0.21, "about 18% cut at 4096"
    assert abs(predicted.truncation_rate.value - observed_rate) < 0.02, (predicted, observed_rate)
    assert abs(predicted.output_tokens.value / observed_tokens - 1) < 0.10, (predicted, observed_tokens)
    assert predicted.truncation_rate.low <= observed_rate <= predicted.truncation_rate.high


# ---- synthetic samples with known answers ------------------------------------------------------------------


def test_a_censored_lognormal_sample_gives_back_its_parameters_and_tail():
    lengths = lognormal_sample(20_000, seed=1)
    plan = plan_from_lengths(Lengths(*cut_at(lengths, 4096), 4096), PlanOptions(bootstrap=50))
    assert math.exp(plan.fit.mu) == pytest.approx(MEDIAN, rel=0.03)
    assert plan.fit.sigma == pytest.approx(SIGMA, abs=0.03)
    for cap in (6144, 8192, 16384):
        assert plan.at(cap).truncation_rate.value == pytest.approx(true_rate(cap), abs=0.005)
        assert plan.at(cap).output_tokens.value == pytest.approx(20_000 * true_mean_tokens(cap), rel=0.02)


def test_the_95_percent_band_covers_the_true_rate_and_tokens_in_most_samples():
    covered_rate = covered_tokens = 0
    trials = 20
    for seed in range(trials):
        plan = plan_from_lengths(
            Lengths(*cut_at(lognormal_sample(1000, seed=100 + seed), 4096), 4096), PlanOptions(seed=seed)
        )
        e = plan.at(8192)
        covered_rate += e.truncation_rate.low <= true_rate(8192) <= e.truncation_rate.high
        covered_tokens += e.output_tokens.low <= 1000 * true_mean_tokens(8192) <= e.output_tokens.high
    assert covered_rate >= 0.8 * trials and covered_tokens >= 0.8 * trials, (covered_rate, covered_tokens)


def test_caps_at_or_below_the_current_one_are_read_from_the_rows_exactly():
    lengths = lognormal_sample(3000, seed=2)
    plan = plan_from_lengths(Lengths(*cut_at(lengths, 4096), 4096), PlanOptions((1024, 2048, 4096, 8192), bootstrap=20))
    for cap in (1024, 2048, 4096):
        e = plan.at(cap)
        assert e.measured
        assert e.truncation_rate.value == pytest.approx((lengths > cap).mean())
        assert e.output_tokens.value == np.minimum(lengths, cap).sum()
    assert not plan.at(8192).measured


def test_no_row_cut_at_the_cap_needs_no_tail_and_larger_caps_change_nothing():
    lengths = lognormal_sample(500, seed=3, median=300, sigma=0.5)
    assert lengths.max() < 4096
    plan = plan_from_lengths(Lengths(lengths, np.zeros(len(lengths), bool), 4096), PlanOptions(bootstrap=20))
    assert plan.fit is None and plan.tail == []
    assert "no tail model is needed" in plan.notes[0]
    for cap in (8192, 16384):
        assert plan.at(cap).truncation_rate.value == 0
        assert plan.at(cap).output_tokens.value == lengths.sum()


def test_all_rows_cut_at_the_cap_is_a_clear_error():
    with pytest.raises(PlanError, match=r"all 200 rows were cut at the cap of 4,096 tokens.*larger cap"):
        plan_from_lengths(Lengths(np.full(200, 4096), np.ones(200, bool), 4096))


def test_a_body_that_is_not_lognormal_is_flagged_and_a_tail_only_fit_still_predicts():
    # 40% of the answers are one-liners of ~40 tokens; the rest are the lognormal whose tail matters
    rng = np.random.default_rng(4)
    n = 5000
    lengths = np.where(rng.random(n) < 0.4, rng.integers(20, 60, n), lognormal_sample(n, seed=5))
    whole = plan_from_lengths(Lengths(*cut_at(lengths, 4096), 4096), PlanOptions(bootstrap=0))
    assert any("misses the observed" in note for note in whole.notes)
    tail_only = plan_from_lengths(Lengths(*cut_at(lengths, 4096), 4096), PlanOptions(fit_from=0.5, bootstrap=50))
    assert not any("misses the observed" in note for note in tail_only.notes)
    assert tail_only.at(8192).truncation_rate.value == pytest.approx(0.6 * true_rate(8192), abs=0.008)


def test_context_columns_say_which_caps_fit_the_server_context():
    lengths = lognormal_sample(1000, seed=6)
    prompt_tokens = np.r_[np.full(989, 100), np.full(10, 1000), [3000]]
    plan = plan_from_lengths(
        Lengths(*cut_at(lengths, 4096), 4096, prompt_tokens), PlanOptions(context_length=8192, bootstrap=0)
    )
    e4, e8 = plan.at(4096), plan.at(8192)
    # prompt + cap + SGLang's clamp margin of 2: the --context-length preflight would accept
    assert (e4.context_needed_max, e4.context_needed_p99) == (7098, 5098)
    assert e4.fits_context and e4.prompts_over_context == 0
    assert (e8.context_needed_max, e8.fits_context, e8.prompts_over_context) == (11194, False, 1000)


def test_time_follows_the_given_token_rate_and_scales_to_the_whole_run():
    lengths = lognormal_sample(1000, seed=7)
    plan = plan_from_lengths(
        Lengths(*cut_at(lengths, 4096), 4096), PlanOptions(tokens_per_s=25_000, prompts=913_786, bootstrap=0)
    )
    e = plan.at(4096)
    assert e.output_tokens.value == pytest.approx(np.minimum(lengths, 4096).sum() * 913.786)
    assert e.hours.value == pytest.approx(e.output_tokens.value / 25_000 / 3600)
    assert plan_from_lengths(Lengths(*cut_at(lengths, 4096), 4096), PlanOptions(bootstrap=0)).at(4096).hours is None


def test_the_plan_renders_as_markdown_and_a_png():
    lengths = lognormal_sample(1000, seed=8)
    plan = plan_from_lengths(
        Lengths(*cut_at(lengths, 4096), 4096, config_hash="abc"), PlanOptions(tokens_per_s=25_000, bootstrap=20)
    )
    md = plan_markdown(plan)
    assert "config `abc`" in md and "time at 25,000 tok/s" in md
    assert md.count("\n| ") == 1 + 6  # the header and one row per candidate cap
    assert "| 4,096 (now) |" in md and " measured" in md
    png = cap_plan_png(plan)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


# ---- reading the data dir ------------------------------------------------------------------------------------


def write_rows(data_dir, config_hash: str, lengths: np.ndarray, cap: int, shard: str = "00000") -> None:
    now = datetime.now(UTC)
    rows = [
        {
            "prompt_id": f"{config_hash}-{i}",
            "shard": shard,
            "source": "t",
            "config_hash": config_hash,
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
        }
        for i, n in enumerate(lengths.tolist())
    ]
    completion_store(data_dir, shard).commit(rows)


def test_without_a_config_the_latest_is_planned_and_named_not_the_one_with_the_most_rows(tmp_path):
    write_rows(tmp_path, "big", lognormal_sample(400, seed=10), 4096)
    write_rows(tmp_path, "small", lognormal_sample(50, seed=9), 8192)  # written after: the latest
    plan = plan_caps(tmp_path, bootstrap=10)
    assert (plan.config_hash, plan.rows, plan.cap, plan.context_length) == ("small", 50, 8192, 32768)
    assert (
        "config `small` chosen by default: the latest, the most recently written (50 rows); the others: `big` (400)"
        in plan.notes[0]
    )
    assert plan_caps(tmp_path, "big", bootstrap=10).rows == 400
    with pytest.raises(PlanError, match="no rows of config `nope`"):
        plan_caps(tmp_path, "nope")
    with pytest.raises(PlanError, match="no completion rows"):
        plan_caps(tmp_path, shard="00009")
