"""The cap plan from a length probe: measured, not modelled.

A probe is a random sample of the prompts generated at a high cap P. For a cap c between the current cap c0 and P,
of the rows the run cut at c0 (a share p0, known from all its rows) the probe says which share q(c) still runs past c:

    P(L > c)         = p0 * q(c)                          q(c) = share of the probe's rows above c0 that pass c
    E[min(L, c)]     = E[min(L, c0)] + p0 * E[min(L, c) - c0 | L > c0]

The run's many rows give what they know and the probe only the conditionals; the 95% intervals come from a bootstrap
of both samples. A continuation probe (mode "cut_rows") has every row above c0, so q(c) rests on all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dflash_assets.quality.planning.fit import Distinct

MIN_PROBE_ROWS_ABOVE = 10  # fewer probe rows above the current cap than this: too few to measure the tail
TARGET_HALF_WIDTH = 0.01  # the precision a probe is sized for: ±1 pp of the share still cut
Z95 = 1.96


@dataclass(frozen=True)
class ProbeSample:
    """The rows of a length probe: completion tokens at the probe's cap, cut or not, runaway or not."""

    completion_tokens: np.ndarray
    truncated: np.ndarray
    runaway: np.ndarray
    cap: int
    config_hash: str | None = None
    continued_from: str | None = None  # a continuation probe: the config whose cut rows it continued; None: random

    @classmethod
    def of(
        cls,
        completion_tokens,
        truncated,
        cap: int,
        runaway=None,
        config_hash: str | None = None,
        continued_from: str | None = None,
    ) -> ProbeSample:
        lengths = np.asarray(completion_tokens, dtype=np.int64)
        cut = np.asarray(truncated, dtype=bool)
        loop = cut & (np.zeros(len(lengths), bool) if runaway is None else np.asarray(runaway, dtype=bool))
        return cls(lengths, cut, loop, int(cap), config_hash, continued_from)

    @property
    def rows(self) -> int:
        return len(self.completion_tokens)


def probe_label(probe: ProbeSample | None) -> str:
    """'probe of 500' or 'continuation probe of 500 cut rows': the plan's `from` column."""
    if probe is None:
        return "probe"
    return f"continuation probe of {probe.rows:,} cut rows" if probe.continued_from else f"probe of {probe.rows:,}"


@dataclass(frozen=True)
class Measured:
    """Per candidate cap: bootstrap replicates of the cut share, the runaway share and output tokens per prompt."""

    rate: np.ndarray  # point estimate per cap
    runaway: np.ndarray
    tokens_per_prompt: np.ndarray
    boot_rate: np.ndarray  # (replicates, caps)
    boot_runaway: np.ndarray
    boot_tokens: np.ndarray
    rows_above: int  # probe rows above the current cap: what the conditionals rest on
    probe_runaways: int  # runaway rows in the probe
    score_low: np.ndarray  # the rate with every share at its Wilson bounds (the run's and the probe's): where
    score_high: np.ndarray  # q(c) has few or no hits the bootstrap collapses to a point, the score interval does not
    hits: np.ndarray  # per cap: honest probe rows above the current cap that pass it (q's numerator)
    honest_above: int  # honest probe rows above the current cap (q's denominator)


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial share: sound at 0 or 1 hits, where the normal one collapses."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (mid - half) / (1 + z * z / n)), min(1.0, (mid + half) / (1 + z * z / n))


@dataclass(frozen=True)
class ProbePrecision:
    """How precisely a probe measures the share cut at one cap, and the probe size that would give ±`target`.

    The run's share cut now (p, honest: runaways apart) is known from all its rows; the probe measures only the
    share q of its own honest rows above the current cap that pass c, a binomial share of m rows. So the share
    still cut at c, p * q, is known to ±z * p * sqrt(q~ (1 - q~) / (m + z²)) (Agresti–Coull: q~ = (hits + z²/2)
    / (m + z²), sound at 0 hits). A random probe of N prompts has about N * p rows above the cap, so ±target
    needs m + z² = (z * p / target)² q~ (1 - q~), i.e. N = that / p prompts; a continuation probe (`continued`)
    has all its N rows above the cap, so N = m.
    """

    cap: int
    rows: int  # probe rows (prompts sampled)
    rows_above: int  # of them, honest rows above the current cap: what the measurement rests on
    half_width: float  # ± of the share still cut, from the binomial
    rows_for_target: int  # probe rows for ±target at this cap
    target: float = TARGET_HALF_WIDTH
    continued: bool = False  # a continuation probe of the run's cut rows: every row is above the cap

    @classmethod
    def of(
        cls, cap: int, honest_share: float, hits: int, rows_above: int, rows: int, continued: bool = False
    ) -> ProbePrecision:
        z = Z95
        q = (hits + z * z / 2) / (rows_above + z * z)
        half = z * honest_share * math.sqrt(q * (1 - q) / (rows_above + z * z))
        above_needed = max(0.0, (z * honest_share / TARGET_HALF_WIDTH) ** 2 * q * (1 - q) - z * z)
        needed = math.ceil(above_needed if continued else above_needed / honest_share) if honest_share else 0
        return cls(int(cap), int(rows), int(rows_above), half, needed, continued=continued)

    @classmethod
    def expected(cls, cap: int, honest_share: float, rows: int, continued: bool = False) -> ProbePrecision:
        """Before any probe: the precision a random probe of `rows` prompts (or a continuation probe of `rows` cut
        rows) will have at worst (q = 1/2, the widest a binomial gets), whatever the shape of the lengths."""
        above = rows if continued and honest_share else rows * honest_share
        if not above:
            return cls(int(cap), int(rows), 0, 0.0, 0, continued=continued)
        return cls.of(cap, honest_share, round(above / 2), round(above), rows, continued)

    @property
    def enough(self) -> bool:
        return self.half_width <= self.target


def precision_text(precisions: list[ProbePrecision], cap: int) -> str:
    """'probe of 500 rows (83 above the cap 4,096): ±1.23 pp at 8,192, ±0.52 pp at 16,384; 760 rows would give
    ±1 pp at every cap' (or 'within ±1 pp at every cap')."""
    if not precisions:
        return ""
    first = precisions[0]
    kind = (
        f"continuation probe of {first.rows:,} cut rows ({first.rows_above:,} honest rows cut at {cap:,}, continued)"
        if first.continued
        else f"probe of {first.rows:,} rows ({first.rows_above:,} honest rows above the cap {cap:,})"
    )
    text = kind + ": " + ", ".join(f"±{p.half_width * 100:.2f} pp at {p.cap:,}" for p in precisions)
    need = max(precisions, key=lambda p: p.rows_for_target)
    if all(p.enough for p in precisions):
        return text + f" (95%, binomial): within ±{first.target * 100:g} pp at every cap"
    what = "cut rows" if first.continued else "rows"
    return text + (
        f" (95%, binomial); {need.rows_for_target:,} {what} would give ±{need.target * 100:g} pp at every cap"
    )


def measure_with_probe(
    rows: Distinct, probe: ProbeSample, caps: np.ndarray, replicates: int, seed: int
) -> Measured | None:
    """Estimates at `caps` (all in (rows.cap, probe.cap]) from the run's rows (distinct, cut at rows.cap) and the
    probe. None when the probe has too few rows above `cap` to say anything.

    The run's runaways run past every cap; the probe's own are taken out of its conditionals, so that only the
    honest tail rests on the probe (assuming a loop has begun by the current cap, where the run's check sees it).
    """
    values, counts, cap = rows.values, rows.counts, rows.cap
    lengths, pcut, ploop = probe.completion_tokens, probe.truncated, probe.runaway
    # a continuation probe's rows were all cut at `cap` (some stopped right there when continued)
    above = np.ones(probe.rows, bool) if probe.continued_from else (lengths > cap) | (pcut & (lengths >= cap))
    if above.sum() < MIN_PROBE_ROWS_ABOVE:
        return None
    n = int(counts.sum())
    # a probe row passes cap c when it is longer than c, or was cut at the probe's cap (and c is that cap)
    passes = ((lengths[None, :] > caps[:, None]) | (pcut[None, :] & (lengths[None, :] >= caps[:, None]))) & above
    extra = np.where(above, np.minimum(lengths[None, :], caps[:, None]) - cap, 0)  # tokens past the cap, up to c
    runaway_above = above & ploop

    def estimate(honest_p0, loop_share, mean0, w):
        """Run-side shares and mean (R,), probe resample weights (R, probe rows): rate, runaway, tokens (R, caps)."""
        drop = (w * runaway_above).sum(1)
        base = (w * above).sum(1) - drop
        q = (w @ passes.T - drop[:, None]) / base[:, None]
        e = (w @ extra.T - drop[:, None] * (caps - cap)) / base[:, None]
        beyond = caps[None, :] - cap
        return (
            loop_share[:, None] + honest_p0[:, None] * q,
            loop_share[:, None] * np.ones(len(caps)),
            mean0[:, None] + loop_share[:, None] * beyond + honest_p0[:, None] * e,
        )

    def run_side(c):
        return c[..., rows.honest].sum(-1) / n, c[..., rows.fixed].sum(-1) / n, c @ values / n

    honest_p0, loop_share, mean0 = (np.atleast_1d(x) for x in run_side(counts))
    rate, runaway, tokens = (a[0] for a in estimate(honest_p0, loop_share, mean0, np.ones((1, probe.rows))))
    drop = int(runaway_above.sum())
    base = int(above.sum()) - drop
    score = np.array([wilson(int(h) - drop, base) for h in passes.sum(1)])
    cut_n, loop_n = int(counts[rows.honest].sum()), int(counts[rows.fixed].sum())
    (p0_low, p0_high), (r_low, r_high) = wilson(cut_n, n), wilson(loop_n, n)
    score_low, score_high = r_low + p0_low * score[:, 0], r_high + p0_high * score[:, 1]
    rng = np.random.default_rng(seed)
    if replicates:
        draws = rng.multinomial(n, counts / n, size=replicates)  # the run's rows, resampled
        w = np.stack(
            [np.bincount(rng.integers(0, probe.rows, probe.rows), minlength=probe.rows) for _ in range(replicates)]
        )  # the probe's rows, resampled
        p0, r, mean0 = run_side(draws)
        ok = (w * (above & ~ploop)).sum(1) > 0
        boot_rate, boot_runaway, boot_tokens = estimate(p0[ok], r[ok], mean0[ok], w[ok])
    else:
        boot_rate, boot_runaway, boot_tokens = (np.empty((0, len(caps))) for _ in range(3))
    return Measured(
        rate,
        runaway,
        tokens,
        boot_rate,
        boot_runaway,
        boot_tokens,
        rows_above=int(above.sum()),
        probe_runaways=int(runaway_above.sum()),
        score_low=score_low,
        score_high=score_high,
        hits=passes.sum(1) - drop,
        honest_above=base,
    )
