"""How well the cap planner predicts, and how long it takes.

1. On the emulator: for a few prompt sets (and length models), generate every prompt at cap 4096 through the
   project's own engine, plan, then generate the same prompts at 8192 and 16384 and compare.
2. Synthetic lognormal samples: how often the 95% interval at 8192 covers the true rate and tokens.
3. Off the lognormal (issue 12): bimodal, Weibull, gamma, lognormal and lognormal with 8% runaways, cut at 4096,
   planned for 8192 and 16384, without a probe (model) and with probes at cap 32,000, at two scales: 20,000
   prompts with probes of 500 (the default there: the larger of 500 and 1%) and 2,000 rows, and 1,000,000
   prompts (the pipeline's scale) with the default probe of 1% = 10,000 rows: error in percentage points
   against the true rate and how often the 95% interval covers it, over repeated draws.
4. Time of one plan (200 bootstrap resamples) over 1,000,000 rows.
5. Probe designs at the same cost (point estimates, 20,000 prompts, a 500-row random probe): P(L > c) read off
   the probe alone, the plan's ratio estimator (the run's share cut now times the probe's conditional tail), and
   the continuation probe (ProbeSettings.mode "cut_rows": a random sample of the run's cut rows continued from
   the cap), given the same decode tokens as the random probe. Section 3 plans with a 500-row one as well.

    uv run python benchmarks/bench_cap_planner.py [--prompts 1000] [--sets 3] [--trials 200] [--draws 40]
        [--draws-1m 100] [--only off-family|probe-design]
"""

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np

from dflash_assets.emulator.process import start_emulator
from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality.planning.estimate import Lengths, PlanOptions, plan_from_lengths
from dflash_assets.quality.planning.fit import lognormal_sf
from dflash_assets.quality.planning.planner import plan_caps
from dflash_assets.quality.planning.probe_estimates import ProbeSample
from dflash_assets.settings import GenerationSettings

sys.path.insert(0, str(Path(__file__).parents[1]))  # the repository, for tests.support
from tests.support.length_families import FAMILIES, censor, probe_rows  # noqa: E402  (shared with the tests)

LENGTH_MODELS = [("1640", "1.0"), ("1200", "1.2"), ("2500", "0.7")]  # (median, sigma) of the emulator's lengths


async def generate(url: str, src: Path, data: Path, n: int, cap: int, build: bool) -> str:
    async with connected([url]) as fleet:
        if build:
            await build_prompt_shard(src, 0, "00000", n, data, fleet, {"enable_thinking": True})
        run = await generate_shard(
            data, "00000", fleet, GenerationSettings(max_output_tokens=cap, cap_policy="fixed"), log=lambda m: None
        )
        return run.config_hash


def emulator_runs(n: int, sets: int) -> None:
    print(f"emulator: {n} prompts per set, plan at cap 4096, then observed at the larger caps")
    print(
        f"{'set':>3} {'median/sigma':>12} {'cap':>6} {'pred cut':>9} {'95% interval':>16} {'obs cut':>8} "
        f"{'pred tokens':>12} {'obs tokens':>11} {'err':>7}"
    )
    for k in range(sets):
        median, sigma = LENGTH_MODELS[k % len(LENGTH_MODELS)]
        with (
            tempfile.TemporaryDirectory() as tmp,
            start_emulator(["--reasoning-parser", "qwen3", "--length-median", median, "--length-sigma", sigma]) as emu,
        ):
            src, data = Path(tmp) / "prompts.jsonl", Path(tmp) / "data"
            src.write_text(
                "".join(
                    json.dumps({"id": f"s{k}-{i}", "prompt": f"Set {k}, question {i}: why?"}) + "\n" for i in range(n)
                )
            )
            plan = plan_caps(data, asyncio.run(generate(emu.url, src, data, n, 4096, True)))
            for cap in (8192, 16384):
                config = asyncio.run(generate(emu.url, src, data, n, cap, False))
                rate, tokens = duckdb.sql(
                    f"SELECT avg((finish_reason = 'length')::INT), sum(completion_tokens) FROM read_parquet("
                    f"'{data}/completions/**/*.parquet') WHERE config_hash = '{config}'"
                ).fetchall()[0]
                e = plan.at(cap)
                r = e.truncation_rate
                print(
                    f"{k:>3} {median + '/' + sigma:>12} {cap:>6} {r.value:>9.2%} {f'{r.low:.2%}–{r.high:.2%}':>16} "
                    f"{rate:>8.2%} {e.output_tokens.value:>12,.0f} {tokens:>11,} "
                    f"{e.output_tokens.value / tokens - 1:>+7.2%}"
                )


def coverage(trials: int, n: int = 1000) -> None:
    mu, sigma = math.log(1640), 1.0
    rate = float(lognormal_sf(math.log(8192), mu, sigma))
    mean = math.exp(mu + sigma**2 / 2) * (1 - float(lognormal_sf(math.log(8192), mu + sigma**2, sigma))) + 8192 * rate
    hits_rate = hits_tokens = 0
    errors = []
    for seed in range(trials):
        rng = np.random.default_rng(10_000 + seed)
        lengths = np.maximum(1, np.round(np.exp(mu + sigma * rng.standard_normal(n)))).astype(np.int64)
        e = plan_from_lengths(Lengths(np.minimum(lengths, 4096), lengths > 4096, 4096), PlanOptions(seed=seed)).at(8192)
        hits_rate += e.truncation_rate.low <= rate <= e.truncation_rate.high
        hits_tokens += e.output_tokens.low <= n * mean <= e.output_tokens.high
        errors.append(e.truncation_rate.value - (lengths > 8192).mean())
    errors = np.abs(errors)
    print(
        f"synthetic: {trials} samples of {n}: 95% interval covers the true rate at 8192 in "
        f"{hits_rate / trials:.0%}, the true tokens in {hits_tokens / trials:.0%}; |predicted - observed in "
        f"the same sample| median {np.median(errors):.2%}, P95 {np.quantile(errors, 0.95):.2%}, "
        f"max {errors.max():.2%}"
    )


def off_family(
    draws: int, n: int, probes: tuple[int, ...], cap: int = 4096, probe_cap: int = 32_000, continued: int = 0
) -> None:
    """`continued`: also a continuation probe (mode cut_rows) of that many of the run's honest cut rows."""
    caps = (8192, 16384)
    designs = [(0, ""), *((p, "probe") for p in probes), *([(continued, "continued")] if continued else [])]
    print(
        f"off-family: {draws} draws of {n:,} lengths cut at {cap:,}; probes of "
        f"{' and '.join(f'{p:,}' for p in probes)} rows"
        + (f" and a continuation probe of {continued} cut rows" if continued else "")
        + f" at cap {probe_cap:,}; |err| = |predicted - true| in pp "
        f"(mean / max over draws), '≤1pp' = share of draws within 1 pp, 'cover' = share of 95% intervals "
        f"holding the truth"
    )
    head = f"{'family':<22} {'cap':>6} {'true':>7} | {'model':>7} {'|err|':>11} {'cover':>5} {'rows say':>8} "
    head += "".join(
        f"| {('continued ' if kind == 'continued' else 'probe ') + format(p, ','):>12} {'|err|':>11} "
        f"{'≤1pp':>5} {'cover':>5} "
        for p, kind in designs[1:]
    )
    print(head)
    started, plans = time.perf_counter(), 0
    for family in FAMILIES:
        truth = family.truth(caps)
        out: dict = {}
        for d in range(draws):
            rng = np.random.default_rng(d)
            lengths, loop = family.draw(rng, n)
            tokens, cut, flagged = censor(lengths, loop, cap)
            probe_draw = family.draw(rng, max(probes))
            for size, kind in designs:
                probe = None
                if kind == "probe":
                    p_tokens, p_cut, p_flagged = censor(probe_draw[0][:size], probe_draw[1][:size], probe_cap)
                    probe = ProbeSample.of(p_tokens, p_cut, probe_cap, p_flagged)
                elif kind == "continued":  # a random sample of this run's honest cut rows, continued to probe_cap
                    chosen = rng.permutation(np.flatnonzero(cut & ~flagged))[:size]
                    p_tokens, p_cut, p_flagged = censor(lengths[chosen], loop[chosen], probe_cap)
                    probe = ProbeSample.of(p_tokens, p_cut, probe_cap, p_flagged, continued_from="run")
                plan = plan_from_lengths(Lengths(tokens, cut, cap, runaway=flagged), PlanOptions(caps, seed=d), probe)
                plans += 1
                for c in caps:
                    e = plan.at(c)
                    r = e.truncation_rate
                    bounds = e.bounds is not None and e.bounds.low <= truth[c] <= e.bounds.high
                    out.setdefault((size, kind, c), []).append(
                        (r.value - truth[c], r.low <= truth[c] <= r.high, bounds)
                    )
        for c in caps:
            row = f"{family.name:<22} {c:>6,} {truth[c]:>7.2%} "
            for size, kind in designs:
                err = np.abs([x[0] for x in out[size, kind, c]]) * 100
                mean = np.mean([x[0] for x in out[size, kind, c]]) + truth[c]
                cover = np.mean([x[1] for x in out[size, kind, c]])
                span = f"{err.mean():.2f}/{err.max():.2f}"
                if kind:
                    row += f"| {mean:>12.2%} {span:>11} {np.mean(err <= 1):>5.0%} {cover:>5.0%} "
                else:
                    row += f"| {mean:>7.2%} {span:>11} {cover:>5.0%} {np.mean([x[2] for x in out[0, '', c]]):>8.0%} "
            print(row)
    print(
        "'model' is the censored lognormal fit (runaways flagged and kept out of the tail); 'rows say' is how "
        "often the model-free range the rows support (runaway share to the share cut now) holds the truth; "
        f"{plans} plans (200 bootstrap resamples each) in {time.perf_counter() - started:.0f} s"
    )


def probe_design(draws: int = 400, n: int = 20_000, size: int = 500, cap: int = 4096, probe_cap: int = 32_000):
    caps = (8192, 16384)
    print(
        f"probe designs: {draws} draws of {n:,} prompts cut at {cap:,}, a random probe of {size} at cap "
        f"{probe_cap:,}; sd = standard deviation of predicted - true (pp), ≤1pp = share of draws within 1 pp"
    )
    print(
        f"{'family':<22} {'cap':>6} {'true':>7} | {'probe alone':>16} | {'ratio (the plan)':>16} | "
        f"{'continue cut rows':>17} {'rows':>5}"
    )
    for family in FAMILIES:
        truth = family.truth(caps)
        err: dict = {}
        continued = []
        for d in range(draws):
            rng = np.random.default_rng(d)
            lengths, loop = family.draw(rng, n)
            cut = lengths > cap
            loops, honest = loop.mean(), (cut & ~loop).mean()
            p_lengths, p_loop = family.draw(rng, size)
            p_above = (p_lengths > cap) & ~p_loop
            # continuing a cut row reveals its own length: a random sample of the honest cut rows, as many as the
            # random probe's decode tokens pay for (the tokens past the cap, up to the probe's cap)
            order = rng.permutation(np.flatnonzero(cut & ~loop))
            m = int(
                np.searchsorted(
                    np.cumsum(np.minimum(lengths[order], probe_cap) - cap), np.minimum(p_lengths, probe_cap).sum()
                )
            )
            continued.append(m)
            for c in caps:
                err.setdefault(("alone", c), []).append((p_lengths > c).mean() - truth[c])
                err.setdefault(("ratio", c), []).append(
                    loops + honest * (p_above & (p_lengths > c)).sum() / p_above.sum() - truth[c]
                )
                err.setdefault(("continue", c), []).append(loops + honest * (lengths[order[:m]] > c).mean() - truth[c])
        for c in caps:
            cells = [
                f"{np.std(err[k, c]) * 100:5.2f} sd {np.mean(np.abs(err[k, c]) <= 0.01):4.0%}"
                for k in ("alone", "ratio", "continue")
            ]
            print(
                f"{family.name:<22} {c:>6,} {truth[c]:>7.2%} | {cells[0]:>16} | {cells[1]:>16} | {cells[2]:>17} "
                f"{np.mean(continued):>5.0f}"
            )
    print("'rows': continued rows the random probe's decode tokens pay for (their prefill not counted)")


def timing(rows: int = 1_000_000) -> None:
    rng = np.random.default_rng(0)
    lengths = np.round(1640 * np.exp(rng.standard_normal(rows))).astype(np.int64)
    started = time.perf_counter()
    plan_from_lengths(np.minimum(lengths, 4096), lengths > 4096, 4096, rng.integers(50, 4000, rows))
    print(f"timing: one plan over {rows:,} rows with 200 bootstrap resamples: {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--sets", type=int, default=3)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--draws", type=int, default=40, help="Draws per off-family case of 20,000 prompts.")
    parser.add_argument(
        "--draws-1m",
        type=int,
        default=100,
        help="Draws per off-family case of 1,000,000 prompts (100: a coverage share to about ±3 pp).",
    )
    parser.add_argument("--only", choices=["emulator", "coverage", "off-family", "probe-design", "timing"])
    args = parser.parse_args()
    if args.only in (None, "emulator"):
        emulator_runs(args.prompts, args.sets)
    if args.only in (None, "coverage"):
        coverage(args.trials)
    if args.only in (None, "off-family"):
        off_family(args.draws, 20_000, (probe_rows(20_000), 2000), continued=500)  # the 500-row floor, and 2,000
        print()
        off_family(args.draws_1m, 1_000_000, (probe_rows(1_000_000),))  # the pipeline's scale: 1% = 10,000
    if args.only in (None, "probe-design"):
        probe_design()
    if args.only in (None, "timing"):
        timing()
