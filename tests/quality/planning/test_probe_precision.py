"""The plan says how precisely its probe measures, and the probe size that would give ±1 pp (issue 12).

Real samples: 20,000 run lengths cut at 4096 and probes drawn from the same family at cap 32,000; the figures
are checked against the binomial formula recomputed here from the probe's own rows.
"""

import math

import numpy as np
import pytest

from dflash_assets.quality.planning.estimate import Lengths, PlanOptions, plan_from_lengths
from dflash_assets.quality.planning.probe_estimates import ProbePrecision, ProbeSample
from dflash_assets.quality.report.cap_plan import plan_markdown
from tests.support.length_families import FAMILIES, censor

N, CAP, PROBE_CAP, CAPS, Z = 20_000, 4096, 32_000, (8192, 16384), 1.96
RUNAWAYS = next(f for f in FAMILIES if f.name == "lognormal+8% runaways")


def run_rows(seed: int = 0):
    lengths, loop = RUNAWAYS.draw(np.random.default_rng(seed), N)
    return censor(lengths, loop, CAP)


def probe_of(size: int, seed: int = 100) -> ProbeSample:
    lengths, loop = RUNAWAYS.draw(np.random.default_rng(seed), size)
    tokens, cut, flagged = censor(lengths, loop, PROBE_CAP)
    return ProbeSample.of(tokens, cut, PROBE_CAP, flagged, "probe")


def plan_with(probe: ProbeSample):
    tokens, cut, flagged = run_rows()
    return plan_from_lengths(Lengths(tokens, cut, CAP, runaway=flagged), PlanOptions(CAPS, bootstrap=0), probe)


def test_the_half_width_and_the_size_for_1pp_follow_from_the_binomial_of_the_probe_rows():
    probe = probe_of(500)
    plan = plan_with(probe)
    honest_share = (plan.truncated - plan.runaways) / plan.rows
    above = (probe.completion_tokens > CAP) & ~probe.runaway
    m = int(above.sum())
    for p in plan.probe_precision:
        hits = int((above & (probe.completion_tokens > p.cap)).sum())
        q = (hits + Z * Z / 2) / (m + Z * Z)  # Agresti–Coull centre
        assert p.rows == 500 and p.rows_above == m
        assert p.half_width == pytest.approx(Z * honest_share * math.sqrt(q * (1 - q) / (m + Z * Z)))
        assert p.rows_for_target == math.ceil(((Z * honest_share / 0.01) ** 2 * q * (1 - q) - Z * Z) / honest_share)
    at_8192 = plan.probe_precision[0]
    assert at_8192.half_width > 0.01 and not at_8192.enough  # ~80 rows above 4096: wider than ±1 pp
    need = max(p.rows_for_target for p in plan.probe_precision)
    assert need == at_8192.rows_for_target > 500
    md = plan_markdown(plan)
    assert (
        f"**Probe precision**: probe of 500 rows ({m} honest rows above the cap 4,096): "
        f"±{at_8192.half_width * 100:.2f} pp at 8,192, ±{plan.probe_precision[1].half_width * 100:.2f} pp at "
        f"16,384 (95%, binomial); {need:,} rows would give ±1 pp at every cap."
    ) in md


def test_a_probe_of_the_advised_size_measures_to_about_1pp_and_a_larger_one_says_it_is_enough():
    small = plan_with(probe_of(500)).probe_precision[0]
    advised = plan_with(probe_of(small.rows_for_target, seed=101)).probe_precision[0]
    large = plan_with(probe_of(4 * small.rows_for_target, seed=102))
    # the width shrinks as 1/sqrt(rows); the advised size lands near ±1 pp (its own q differs a little)
    assert small.half_width > advised.half_width > large.probe_precision[0].half_width
    assert advised.half_width == pytest.approx(0.01, abs=0.002)
    assert all(p.enough for p in large.probe_precision)
    assert "(95%, binomial): within ±1 pp at every cap." in plan_markdown(large)
    assert "rows would give" not in plan_markdown(large)


def test_before_a_probe_the_worst_case_width_of_a_random_probe_is_what_its_rows_give():
    tokens, cut, flagged = run_rows()
    honest_share = float((cut & ~flagged).mean())
    expected = ProbePrecision.expected(CAP, honest_share, 500)
    m = round(500 * honest_share)
    # q = 1/2: the widest a binomial share gets, whatever the lengths
    assert expected.half_width == pytest.approx(Z * honest_share * math.sqrt(0.25 / (m + Z * Z)), rel=0.01)
    # a real probe of that size is measured no less precisely than the worst case said
    for seed in range(3):
        measured = plan_with(probe_of(500, seed=200 + seed)).probe_precision
        assert all(p.half_width <= expected.half_width * 1.1 for p in measured)
    assert ProbePrecision.expected(CAP, honest_share, expected.rows_for_target).half_width == pytest.approx(
        0.01, abs=0.0005
    )


def continuation_probe_of(size: int, seed: int = 300) -> ProbeSample:
    """`size` of the run's honest cut rows continued to PROBE_CAP: prompts of the same family drawn until that many
    were cut at CAP without looping (a random sample of the honest cut rows), their lengths then cut at PROBE_CAP."""
    rng, lengths = np.random.default_rng(seed), []
    while len(lengths) < size:
        drawn, loop = RUNAWAYS.draw(rng, 20_000)
        lengths += drawn[(drawn > CAP) & ~loop].tolist()
    tokens, cut, flagged = censor(np.array(lengths[:size]), np.zeros(size, bool), PROBE_CAP)
    return ProbeSample.of(tokens, cut, PROBE_CAP, flagged, "continued", continued_from="run")


def test_a_continuation_probe_rests_on_all_its_rows_and_says_so_in_the_precision_line():
    probe = continuation_probe_of(500)
    plan = plan_with(probe)
    honest_share = (plan.truncated - plan.runaways) / plan.rows
    for p in plan.probe_precision:
        hits = int((probe.completion_tokens > p.cap).sum())
        q = (hits + Z * Z / 2) / (500 + Z * Z)
        assert p.rows == p.rows_above == 500 and p.continued
        assert p.half_width == pytest.approx(Z * honest_share * math.sqrt(q * (1 - q) / (500 + Z * Z)))
        # every row of this probe is above the cap: the rows for ±1 pp are the rows above it, not / the share cut
        assert p.rows_for_target == math.ceil(max(0.0, (Z * honest_share / 0.01) ** 2 * q * (1 - q) - Z * Z))
    # the same 500 rows of a random probe would rest on ~80: this one is far tighter
    assert plan.probe_precision[0].half_width < plan_with(probe_of(500)).probe_precision[0].half_width / 2
    md = plan_markdown(plan)
    widths = ", ".join(f"±{p.half_width * 100:.2f} pp at {p.cap:,}" for p in plan.probe_precision)
    assert (
        f"**Probe precision**: continuation probe of 500 cut rows (500 honest rows cut at 4,096, continued): "
        f"{widths} (95%, binomial): within ±1 pp at every cap."
    ) in md
    assert "| measured (continuation probe of 500 cut rows) |" in md
    assert "**measured** by a continuation probe (500 of the run's honest cut rows continued to cap 32,000" in md
    # and it measures: the truth of the family (a large draw) is within 1 pp and inside the interval at both caps
    truth_lengths, _ = RUNAWAYS.draw(np.random.default_rng(9), 400_000)
    for c in CAPS:
        truth, e = float((truth_lengths > c).mean()), plan.at(c).truncation_rate
        assert plan.at(c).basis == "probe" and abs(e.value - truth) < 0.01 and e.low <= truth <= e.high


def test_before_a_probe_the_worst_case_width_of_a_continuation_probe_rests_on_all_its_rows():
    tokens, cut, flagged = run_rows()
    honest_share = float((cut & ~flagged).mean())
    continued = ProbePrecision.expected(CAP, honest_share, 500, continued=True)
    assert continued.rows == continued.rows_above == 500
    assert continued.half_width == pytest.approx(Z * honest_share * math.sqrt(0.25 / (500 + Z * Z)), rel=0.01)
    # a random probe of 500 prompts has ~80 rows above the cap: its worst case is about sqrt(500 / 80) wider
    assert ProbePrecision.expected(CAP, honest_share, 500).half_width > 2 * continued.half_width
