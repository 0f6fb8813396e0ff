"""The lognormal tail of a config's lengths beyond its cap (docs/cap-planning.md).

Lengths are right-censored at the cap (a 'length' row says only that the true length is above it). Below the cap
the answer is the empirical distribution; above it the share cut at the cap c0 is spread by a lognormal tail fitted
by censored maximum likelihood (optionally left-truncated at the quantile `fit_from`):

    P(L > c)        = share cut at c0 * S(c) / S(c0)
    E[min(L, c)]    = uncut rows as they are, cut rows at E[min(L, c) | L > c0] under the fit
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from dflash_assets.quality.outcome import num, pct
from dflash_assets.rules import percentile

GAP_WARN = 0.02  # below the cap, a fitted survival this far from the observed one makes the tail suspect


class PlanError(ValueError):
    """The rows cannot support a plan (none, or none below the cap); the message says what to do."""


@dataclass(frozen=True)
class Distinct:
    """A config's rows as distinct (length, cut, loop, held) quadruples and the rows each stands for: what the fit,
    the predictions and the bootstrap read, at a cost set by the distinct lengths, not the rows. `cap` is the config's
    cap; `held`: cut rows the window policy sized below it (rules.WINDOW_SIZED_SQL), cut at every cap at their length."""

    values: np.ndarray
    cut: np.ndarray
    loop: np.ndarray
    counts: np.ndarray
    cap: int
    held: np.ndarray

    @classmethod
    def of(cls, lengths: np.ndarray, cut: np.ndarray, loop: np.ndarray, cap: int, held: np.ndarray) -> Distinct:
        key, counts = np.unique(lengths * 8 + cut * 4 + loop * 2 + held, return_counts=True)
        bit = lambda b: (key // b % 2).astype(bool)  # noqa: E731
        return cls(key // 8, bit(4), bit(2), counts, cap, bit(1))

    def where(self, keep: np.ndarray, counts: np.ndarray | None = None) -> Distinct:
        """The quadruples in `keep`, with other counts (a resample's) when given."""
        counts = self.counts if counts is None else counts
        return Distinct(self.values[keep], self.cut[keep], self.loop[keep], counts[keep], self.cap, self.held[keep])

    @property
    def honest(self) -> np.ndarray:
        """Cut rows a larger cap would let go on: neither runaways nor held by the window."""
        return self.cut & ~self.loop & ~self.held

    @property
    def fixed(self) -> np.ndarray:
        """Cut rows cut at every cap: runaways and those the window held."""
        return self.loop | self.held

    @property
    def rows(self) -> int:
        return int(self.counts.sum())


@dataclass(frozen=True)
class TailFit:
    """Lognormal of log-mean `mu`, log-sd `sigma`, fitted to rows above `fit_from_tokens` (0: all rows)."""

    mu: float
    sigma: float
    fit_from_tokens: int
    rows: int  # rows in the fit window, cut ones included
    max_gap: float  # largest |fitted - observed| P(L > x) below the cap: the fit where it can be checked
    anchor_share: float  # observed P(L > fit_from_tokens)

    def survival(self, x: float | np.ndarray) -> np.ndarray:
        """The model's P(L > x), scaled to the observed share above the fit window's start."""
        start = lognormal_sf(math.log(self.fit_from_tokens), self.mu, self.sigma) if self.fit_from_tokens else 1.0
        return self.anchor_share * lognormal_sf(np.log(x), self.mu, self.sigma) / start


_erfc = np.frompyfunc(math.erfc, 1, 1)


def normal_sf(z) -> np.ndarray:
    """Standard normal survival."""
    return np.asarray(0.5 * _erfc(np.asarray(z, dtype=float) / math.sqrt(2)), dtype=float)


def lognormal_sf(logx, mu: float, sigma: float) -> np.ndarray:
    return normal_sf((np.asarray(logx, dtype=float) - mu) / sigma)


def loglik(mu: float, sigma: float, st: dict) -> tuple[float, np.ndarray, np.ndarray]:
    """Log-likelihood, gradient and Hessian in (mu, sigma) of the censored, optionally left-truncated lognormal.

    Sufficient statistics only: k uncut rows with sum s1 and s2 of log lengths, cut rows `ck` at log caps `cl`,
    and `n` rows conditioned on L > exp(`tl`) when the window is truncated.
    """
    k, s1, s2 = st["k"], st["s1"], st["s2"]
    a = s2 - 2 * mu * s1 + mu * mu * k
    ll = -k * math.log(sigma) - a / (2 * sigma**2)
    g = np.array([(s1 - mu * k) / sigma**2, -k / sigma + a / sigma**3])
    h = np.array([[-k / sigma**2, -2 * (s1 - mu * k) / sigma**3], [0.0, k / sigma**2 - 3 * a / sigma**4]])
    terms = [(st["cl"], st["ck"])]
    if st["tl"] is not None:
        terms.append((np.array([st["tl"]]), np.array([-st["n"]])))  # minus log P(L > window start)
    for logc, m in terms:
        w = (logc - mu) / sigma
        q = normal_sf(w)
        lam = np.exp(-w * w / 2) / math.sqrt(2 * math.pi) / q  # inverse Mills ratio
        d = lam * (lam - w)
        ll += float(np.sum(m * np.log(q)))
        g += [np.sum(m * lam) / sigma, np.sum(m * lam * w) / sigma]
        h[0, 0] -= np.sum(m * d) / sigma**2
        h[0, 1] -= np.sum(m * (d * w + lam)) / sigma**2
        h[1, 1] -= np.sum(m * w * (d * w + 2 * lam)) / sigma**2
    h[1, 0] = h[0, 1]
    return ll, g, h


def fit_lognormal(st: dict, start: tuple[float, float]) -> tuple[float, float]:
    """Newton's method with step halving; a gradient step wherever the Hessian is not negative definite."""
    mu, sigma = start
    ll, g, h = loglik(mu, sigma, st)
    for _ in range(100):
        try:
            step = -np.linalg.solve(h, g)
        except np.linalg.LinAlgError:
            step = g
        if g @ step <= 0:
            step = g / max(1.0, float(np.abs(g).max()))
        step *= min(1.0, 0.5 / float(np.abs(step).max() or 1.0))  # never jump more than 0.5 in log space
        t = 1.0
        while t > 1e-8:
            m2, s2 = mu + t * step[0], sigma + t * step[1]
            if s2 > 1e-3:
                new = loglik(m2, s2, st)
                if np.isfinite(new[0]) and new[0] >= ll - 1e-12:
                    break
            t /= 2
        else:
            break
        mu, sigma, (ll, g, h) = m2, s2, new
        if abs(t * step).max() < 1e-9:
            break
    return mu, sigma


def sufficient_stats(values: np.ndarray, cut: np.ndarray, counts: np.ndarray, lo: int) -> dict:
    """Sufficient statistics of the rows above `lo` tokens (all rows when lo = 0)."""
    inside = values > lo
    unc, cen = inside & ~cut, inside & cut
    y = np.log(np.maximum(values[unc], 1))  # a 0-token row (rare, aborted) counts as 1 on the log scale
    k = counts[unc]
    return {
        "k": float(k.sum()),
        "s1": float(k @ y),
        "s2": float(k @ (y * y)),
        "cl": np.log(values[cen]),
        "ck": counts[cen].astype(float),
        "tl": math.log(lo) if lo > 0 else None,
        "n": float(counts[inside].sum()),
    }


def fit_tail(values, cut, counts, fit_from: float, notes: list[str]) -> TailFit:
    n = int(counts.sum())
    lengths = np.repeat(values, counts)
    lo = percentile(lengths, fit_from) if fit_from > 0 else 0
    st = sufficient_stats(values, cut, counts, lo)
    if st["k"] < 10:
        raise PlanError(
            f"only {num(int(st['k']))} uncut rows above {num(lo)} tokens to fit the tail to: "
            f"lower fit_from or plan from more rows"
        )
    y = np.log(np.maximum(lengths[lengths > lo], 1))
    mu, sigma = fit_lognormal(st, (float(y.mean()), float(max(y.std(), 0.1))))
    rows = int(counts[values > lo].sum())
    fit = TailFit(float(mu), float(sigma), lo, rows, max_gap=0.0, anchor_share=rows / n)
    # How far the model is from what was seen, over the uncut lengths it was fitted to
    seen = ~cut & (values > lo) & (values < values[cut].min())
    above = (n - np.cumsum(counts)) / n
    gap = float(np.abs(above[seen] - fit.survival(values[seen].astype(float))).max()) if seen.any() else 0.0
    if gap > max(GAP_WARN, 1.36 / math.sqrt(rows)):  # beyond a Kolmogorov-Smirnov 95% band, or 2 points
        notes.append(
            f"the lognormal misses the observed P(length > x) below the cap by up to {pct(gap)}: the "
            f"predictions above the cap are less sure than their intervals say; try fit_from=0.5 (the "
            f"upper half only) or a sample at a larger cap"
        )
    return replace(fit, max_gap=gap)
