"""Which cap to run with: truncation, output tokens, time and context length for candidate caps.

Where each figure comes from is part of it (`CapEstimate.basis`): at or below the current cap it is read from
the rows ("rows"); between the current cap and a length probe's cap it is measured by the probe ("probe",
probe_estimates.py); beyond both it comes from a model ("model"), described next, and says so, with the range
the rows alone support (`bounds`: no fewer than the runaways, no more than what the current cap cut).

Runaway rows (cut while looping, generation/runaway.py) are kept out of the tail: they would loop to any cap, so they are
counted as cut at every cap and cost the whole cap in tokens, apart from the honest tail below.

The rows of one config are lengths right-censored at its cap: a `finish_reason = 'length'` row says only
that the true length is above the cap. Below the cap the answer is the empirical distribution itself (no
model). Above it, the share of rows cut at the cap (empirical) is spread over larger caps by a lognormal
tail fitted by censored maximum likelihood: uncensored lengths contribute the log-density, cut ones the
log-survival at the cap (optionally only rows above a quantile `fit_from`, a left-truncated fit, for when
the body of the distribution is not lognormal). So for a cap c above the current cap c0:

    P(L > c)        = share cut at c0 * S(c) / S(c0)
    E[min(L, c)]    = uncut rows as they are, cut rows at E[min(L, c) | L > c0] under the fit

95% intervals come from a bootstrap over rows (a multinomial resample of the distinct lengths, so its cost
does not grow with the row count), refitting the tail each time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import duckdb
import numpy as np

from dflash_assets.quality.outcome import num, pct
from dflash_assets.quality.planning.probe_estimates import (
    ProbePrecision,
    ProbeSample,
    measure_with_probe,
    precision_text,
    probe_label,
    wilson,
)
from dflash_assets.quality.tables import one, parquet_source, register_runaway, runaway_sql
from dflash_assets.rules import CUT_SQL, LATEST_ORDER_SQL, context_needed, overflows, percentile
from dflash_assets.settings import SAMPLING_PARAMS, RunawaySettings
from dflash_assets.store.schema import COMPLETION_SCHEMA

DEFAULT_CANDIDATES = (4096, 5120, 6144, 8192, 12288, 16384)
GAP_WARN = 0.02  # below the cap, a fitted survival this far from the observed one makes the tail suspect


class PlanError(ValueError):
    """The rows cannot support a plan (none, or none below the cap); the message says what to do."""


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float  # 95% bootstrap interval
    high: float


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
        start = _sf(math.log(self.fit_from_tokens), self.mu, self.sigma) if self.fit_from_tokens else 1.0
        return self.anchor_share * _sf(np.log(x), self.mu, self.sigma) / start


@dataclass(frozen=True)
class CapEstimate:
    cap: int
    measured: bool  # read from the rows or measured by a probe: no model
    truncation_rate: Estimate  # every row still cut at this cap, runaways included
    output_tokens: Estimate  # total over `CapPlan.prompts` prompts
    hours: Estimate | None  # output_tokens / tokens_per_s, when a rate was given
    context_needed_max: int | None  # the context the largest prompt + cap needs (rules.context_needed)
    context_needed_p99: int | None  # the same for the P99 (nearest rank) prompt
    fits_context: bool | None  # every prompt + cap fits context_length - 2; None without a context length
    prompts_over_context: int | None  # rows whose prompt + cap would not fit
    basis: str = "rows"  # "rows" (at or below the current cap), "probe" (measured by it), "model" (the fit)
    runaway_rate: Estimate = Estimate(0.0, 0.0, 0.0)  # of truncation_rate, the rows that loop: no cap ends them
    bounds: Estimate | None = None  # for a model figure: the range the rows themselves support, whatever the shape


@dataclass(frozen=True)
class TurnView:
    """The rows of one turn index (all_turns): how many, the share the current cap cut, nearest-rank P50/P90/P99.
    Later turns carry longer histories and often longer answers: one cap for all turns is judged turn by turn."""

    turn: int
    rows: int
    truncated: int
    truncation_rate: float
    p50: int
    p90: int
    p99: int


def turn_views(turn, completion_tokens, truncated) -> list[TurnView]:
    """The by-turn view of a config's rows; empty when no row has a turn index (regenerate: last_turn)."""
    turn = np.ma.asarray(turn)
    known = ~np.ma.getmaskarray(turn)
    out = []
    for k in np.unique(turn.data[known]):
        at = known & (turn.data == k)
        values, cut = np.asarray(completion_tokens)[at], int(np.asarray(truncated)[at].sum())
        out.append(
            TurnView(
                int(k), int(at.sum()), cut, cut / int(at.sum()), *(percentile(values, q) for q in (0.5, 0.9, 0.99))
            )
        )
    return out


@dataclass(frozen=True)
class CapPlan:
    config_hash: str | None
    shard: str | None
    cap: int  # the current cap (max_output_tokens of the rows)
    rows: int
    truncated: int
    prompts: int  # the prompt count totals are for (default: the rows)
    tokens_per_s: float | None
    context_length: int | None
    fit: TailFit | None  # None when no row was cut: nothing to extrapolate
    estimates: list[CapEstimate]
    empirical: list[tuple[int, float]]  # (x, observed P(L > x)) at the distinct uncut lengths
    tail: list[tuple[float, float, float, float]]  # (x, P(L > x), low, high) above the cap, for the picture
    bootstrap: int
    notes: list[str] = field(default_factory=list)
    runaways: int = 0  # rows cut while looping (in `truncated`), left out of the tail fit
    probe: ProbeSample | None = None  # the length probe the "probe" figures come from
    probe_survival: list[tuple[int, float]] = field(default_factory=list)  # (x, P(L > x)) the probe measured
    by_turn: list[TurnView] = field(default_factory=list)  # regenerate: all_turns: the rows of each turn index
    probe_precision: list[ProbePrecision] = field(default_factory=list)  # per probe cap: ±, size for ±1 pp

    def at(self, cap: int) -> CapEstimate:
        return next(e for e in self.estimates if e.cap == cap)


# ---- the lognormal tail -----------------------------------------------------------------------------------

_erfc = np.frompyfunc(math.erfc, 1, 1)


def _q(z) -> np.ndarray:
    """Standard normal survival."""
    return np.asarray(0.5 * _erfc(np.asarray(z, dtype=float) / math.sqrt(2)), dtype=float)


def _sf(logx, mu: float, sigma: float) -> np.ndarray:
    return _q((np.asarray(logx, dtype=float) - mu) / sigma)


def _loglik(mu: float, sigma: float, st: dict) -> tuple[float, np.ndarray, np.ndarray]:
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
        q = _q(w)
        lam = np.exp(-w * w / 2) / math.sqrt(2 * math.pi) / q  # inverse Mills ratio
        d = lam * (lam - w)
        ll += float(np.sum(m * np.log(q)))
        g += [np.sum(m * lam) / sigma, np.sum(m * lam * w) / sigma]
        h[0, 0] -= np.sum(m * d) / sigma**2
        h[0, 1] -= np.sum(m * (d * w + lam)) / sigma**2
        h[1, 1] -= np.sum(m * w * (d * w + 2 * lam)) / sigma**2
    h[1, 0] = h[0, 1]
    return ll, g, h


def _fit(st: dict, start: tuple[float, float]) -> tuple[float, float]:
    """Newton's method with step halving; a gradient step wherever the Hessian is not negative definite."""
    mu, sigma = start
    ll, g, h = _loglik(mu, sigma, st)
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
                new = _loglik(m2, s2, st)
                if np.isfinite(new[0]) and new[0] >= ll - 1e-12:
                    break
            t /= 2
        else:
            break
        mu, sigma, (ll, g, h) = m2, s2, new
        if abs(t * step).max() < 1e-9:
            break
    return mu, sigma


def _stats(values: np.ndarray, cut: np.ndarray, counts: np.ndarray, lo: int) -> dict:
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


# ---- predictions -----------------------------------------------------------------------------------------


def _predict(
    values, cut, counts, caps: np.ndarray, fit: tuple[float, float] | None, loop: np.ndarray, cap: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows above each cap (expected) and output tokens at each cap: exact for uncut rows and for cut rows
    below their cut point, the fitted conditional tail for cut rows above it; runaway (`loop`) rows run past
    every cap and cost all of it, but those stopped while streaming (below the rows' own `cap`) cost what they
    decoded: a stop comes at the same point under any cap above it."""
    unc = ~cut
    over = (counts[unc][None, :] * (values[unc][None, :] > caps[:, None])).sum(1).astype(float)
    tokens = (counts[unc][None, :] * np.minimum(values[unc][None, :], caps[:, None])).sum(1).astype(float)
    looping = int(counts[loop].sum())
    over += looping
    stopped = loop & (values < cap) if cap is not None else np.zeros(len(values), bool)
    tokens += int(counts[loop & ~stopped].sum()) * caps.astype(float)
    tokens += (counts[stopped][None, :] * np.minimum(values[stopped][None, :], caps[:, None])).sum(1)
    honest = cut & ~loop
    for v, k in zip(values[honest], counts[honest]):
        beyond = caps > v
        over += k * ~beyond
        tokens += k * np.where(beyond, 0.0, caps)
        if beyond.any():
            if fit is None:
                raise ValueError("rows cut below a cap need a tail fit to predict it")  # the callers fit one
            mu, sigma = fit
            lc, lv = np.log(caps[beyond]), math.log(v)
            qv, qc = _sf(lv, mu, sigma), _sf(lc, mu, sigma)
            # E[min(L, c) | L > v] = (E[L; v < L <= c] + c P(L > c)) / P(L > v), lognormal partial expectation
            partial = math.exp(mu + sigma**2 / 2) * (_sf(lv, mu + sigma**2, sigma) - _sf(lc, mu + sigma**2, sigma))
            over[beyond] += k * qc / qv
            tokens[beyond] += k * (partial + caps[beyond] * qc) / qv
    return over, tokens


def _fit_tail(values, cut, counts, fit_from: float, notes: list[str]) -> TailFit:
    n = int(counts.sum())
    lengths = np.repeat(values, counts)
    lo = percentile(lengths, fit_from) if fit_from > 0 else 0
    st = _stats(values, cut, counts, lo)
    if st["k"] < 10:
        raise PlanError(
            f"only {num(int(st['k']))} uncut rows above {num(lo)} tokens to fit the tail to: "
            f"lower fit_from or plan from more rows"
        )
    y = np.log(np.maximum(lengths[lengths > lo], 1))
    mu, sigma = _fit(st, (float(y.mean()), float(max(y.std(), 0.1))))
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


def _bootstrap(
    values, cut, counts, loop, caps, fit: TailFit | None, grid, replicates: int, seed: int, cap: int | None = None
):
    """Per replicate: rows over each cap (share), output tokens at each cap, and the tail's P(L > x) on `grid`.

    Resampling rows is a multinomial draw over the distinct (length, cut) pairs: the same as drawing n rows
    with replacement, at a cost set by the number of distinct lengths, not of rows.
    """
    rng = np.random.default_rng(seed)
    n = int(counts.sum())
    honest_cut = cut & ~loop  # at the rows' cap (a runaway stopped early is below it)
    tail_from = int(values[honest_cut].min()) if honest_cut.any() else 0
    shares, tokens, tails, loops = [], [], [], []
    for _ in range(replicates):
        c = rng.multinomial(n, counts / n)
        keep = c > 0
        bv, bc, bk, bl = values[keep], cut[keep], c[keep], loop[keep]
        bfit = None
        if fit and (bc & ~bl).any():  # (a resample without honest cut rows has no tail: no fit needed)
            bst = _stats(bv[~bl], bc[~bl], bk[~bl], fit.fit_from_tokens)
            if bst["k"] < 2:
                continue  # too few uncut rows in the window for this replicate to mean anything
            bfit = _fit(bst, (fit.mu, fit.sigma))
        if fit:
            tail = _sf(np.log(grid), *bfit) / _sf(math.log(tail_from), *bfit) if bfit else np.zeros(len(grid))
            tails.append((bk[bc & ~bl].sum() * tail + bk[bl].sum()) / n)
        o, t = _predict(bv, bc, bk, caps, bfit, bl, cap)
        shares.append(o / n)
        tokens.append(t)
        loops.append(bk[bl].sum() / n)
    shape = (-1, len(caps))
    tail_grid = np.array(tails).reshape(len(tails), len(grid))
    return np.array(shares).reshape(shape), np.array(tokens).reshape(shape), tail_grid, np.array(loops)


def _interval(point: float, samples: np.ndarray, scale: float = 1.0) -> Estimate:
    if len(samples) < 2:
        return Estimate(point * scale, point * scale, point * scale)
    low, high = np.quantile(samples, [0.025, 0.975])
    return Estimate(point * scale, float(low) * scale, float(high) * scale)


def plan_from_lengths(
    completion_tokens,
    truncated,
    cap: int,
    prompt_tokens=None,
    *,
    runaway=None,
    probe: ProbeSample | None = None,
    candidates=DEFAULT_CANDIDATES,
    tokens_per_s: float | None = None,
    context_length: int | None = None,
    prompts: int | None = None,
    fit_from: float = 0.0,
    bootstrap: int = 200,
    seed: int = 0,
    config_hash: str | None = None,
    shard: str | None = None,
    notes: list[str] | None = None,
) -> CapPlan:
    """The plan from one config's rows: completion_tokens, whether each was cut (finish_reason 'length'),
    the cap they were made with and (for the context columns) their prompt_tokens.

    `runaway` flags the cut rows that loop (generation/runaway.py): they are kept out of the tail. `probe` (rows at a
    larger cap) measures the caps up to its own. `fit_from` is a quantile of the observed lengths: the tail is
    fitted to the rows above it only. `prompts` scales the totals from these rows to a whole run. `bootstrap`
    replicates give the intervals.
    """
    lengths = np.asarray(completion_tokens, dtype=np.int64)
    cut = np.asarray(truncated, dtype=bool)
    loop = cut & (np.zeros(len(lengths), bool) if runaway is None else np.asarray(runaway, dtype=bool))
    notes = list(notes or [])
    n, n_cut, n_loop = len(lengths), int(cut.sum()), int(loop.sum())
    if n == 0:
        raise PlanError("no completion rows to plan from: generate a sample at the current cap first")
    if n_cut == n and n_loop < n:
        raise PlanError(
            f"all {num(n)} rows were cut at the cap of {num(cap)} tokens: nothing is known about the "
            f"lengths below it, so no tail can be fitted. Run a sample at a larger cap first "
            f"(e.g. {num(4 * cap)}) and plan from that"
        )
    key, counts = np.unique(lengths * 4 + cut * 2 + loop, return_counts=True)  # distinct (length, cut, loop)
    values, vcut, vloop = key // 4, (key // 2 % 2).astype(bool), (key % 2).astype(bool)
    caps = np.array(sorted({int(c) for c in candidates} | {int(cap)}), dtype=np.int64)
    honest_cut = n_cut - n_loop
    fit, grid = None, np.array([])
    if honest_cut:
        h = ~vloop
        fit = _fit_tail(values[h], vcut[h], counts[h], fit_from, notes)
        grid = np.geomspace(cap, caps.max() * 1.25, 48)
    elif n_loop:
        notes.append(
            f"no row was cut at the cap of {num(cap)} tokens but runaways: every other length is observed, "
            f"no tail model is needed (larger caps change nothing but what the runaways cost)"
        )
    else:
        notes.append(
            f"no row was cut at the cap of {num(cap)} tokens: every length is observed, no tail model "
            f"is needed (larger caps change nothing)"
        )
    if n_loop:
        notes.append(
            f"{num(n_loop)} of the {num(n_cut)} cut rows ({pct(n_loop / n)} of all rows) are runaways "
            f"(cut while repeating themselves): they are counted as cut at every cap and cost all of it, "
            f"and are left out of the tail"
        )
    over, tokens = _predict(values, vcut, counts, caps, (fit.mu, fit.sigma) if fit else None, vloop, cap)
    boot_shares, boot_tokens, boot_tails, boot_loops = _bootstrap(
        values, vcut, counts, vloop, caps, fit, grid, bootstrap, seed, cap
    )
    loop_share = _interval(n_loop / n, boot_loops)
    beyond = caps > cap
    model_rows = beyond & bool(honest_cut)
    measured = None
    if probe is not None and honest_cut:
        in_probe = beyond & (caps <= probe.cap)
        if probe.cap <= cap:
            notes.append(
                f"the length probe's cap {num(probe.cap)} is not above the current cap {num(cap)}: it "
                f"measures nothing the rows do not"
            )
        elif in_probe.any():
            measured = measure_with_probe(values, vcut, vloop, counts, cap, probe, caps[in_probe], bootstrap, seed)
            if measured is None:
                notes.append(
                    f"the length probe has fewer than 10 rows above the current cap {num(cap)}: too few "
                    f"to measure the tail; the figures beyond the cap stay model-based"
                )
            else:
                model_rows &= ~in_probe
                seen, run_high = wilson(measured.probe_runaways, probe.rows), wilson(n_loop, n)[1]
                if seen[0] > run_high:
                    notes.append(
                        f"the probe has {pct(measured.probe_runaways / probe.rows)} runaways, the rows at "
                        f"the cap {pct(n_loop / n)}: loops that start after the cap; the probe's figures "
                        f"count them with the honest tail"
                    )
    # what the rows support beyond what is measured: no fewer than the runaways, no more than cut now
    bounds = Estimate(n_cut / n, wilson(n_loop, n)[0], wilson(n_cut, n)[1])

    prompts = prompts or n
    pt = None if prompt_tokens is None else np.ma.asarray(prompt_tokens).compressed().astype(np.int64)
    if pt is not None and not len(pt):
        pt = None
    estimates, k, precision = [], 0, []
    for i, c in enumerate(caps.tolist()):
        rate, tok = _interval(float(over[i] / n), boot_shares[:, i]), _interval(float(tokens[i]), boot_tokens[:, i])
        loops, basis = loop_share, "rows" if c <= cap or not honest_cut else "model"
        if measured is not None and probe is not None and c > cap and not model_rows[i] and c <= probe.cap:
            rate = _interval(float(measured.rate[k]), measured.boot_rate[:, k])
            rate = replace(
                rate,
                low=min(rate.low, float(measured.score_low[k])),
                high=max(rate.high, float(measured.score_high[k])),
            )
            loops = _interval(float(measured.runaway[k]), measured.boot_runaway[:, k])
            tok = _interval(float(measured.tokens_per_prompt[k] * n), measured.boot_tokens[:, k] * n)
            precision.append(
                ProbePrecision.of(
                    c,
                    honest_cut / n,
                    int(measured.hits[k]),
                    measured.honest_above,
                    probe.rows,
                    continued=probe.continued_from is not None,
                )
            )
            basis, k = "probe", k + 1
            # a larger cap cuts no more than this one: beyond the probe, the rows and probe support at most this
            bounds = replace(bounds, value=rate.value, high=rate.high)
        tok = Estimate(*(v * prompts / n for v in (tok.value, tok.low, tok.high)))
        hours = Estimate(*(v / tokens_per_s / 3600 for v in (tok.value, tok.low, tok.high))) if tokens_per_s else None
        over_ctx = None
        if context_length is not None and pt is not None:
            over_ctx = int(np.count_nonzero(overflows(pt, c, context_length)))  # pt is an array: one per prompt
        estimates.append(
            CapEstimate(
                cap=c,
                measured=basis != "model",
                truncation_rate=rate,
                output_tokens=tok,
                hours=hours,
                context_needed_max=None if pt is None else context_needed(int(pt.max()), c),
                context_needed_p99=None if pt is None else context_needed(percentile(pt, 0.99), c),
                fits_context=None if over_ctx is None else over_ctx == 0,
                prompts_over_context=over_ctx,
                basis=basis,
                runaway_rate=loops,
                bounds=bounds if basis == "model" else None,
            )
        )
    if any(e.basis == "model" for e in estimates):
        first = next(e.cap for e in estimates if e.basis == "model")
        notes.append(
            f"from {num(first)} tokens on the figures come from a model (a lognormal tail), not a "
            f"measurement: its 95% band holds only if the lengths are lognormal. The rows alone say only "
            f"that between {pct(bounds.low)} and {pct(bounds.high)} would still be cut at any larger cap. "
            f"A length probe measures it instead"
        )
    tail = []
    if fit:
        point = (honest_cut * _sf(np.log(grid), fit.mu, fit.sigma) / _sf(math.log(cap), fit.mu, fit.sigma) + n_loop) / n
        band = boot_tails if len(boot_tails) >= 2 else point[None, :]
        lows, highs = np.quantile(band, 0.025, axis=0), np.quantile(band, 0.975, axis=0)
        tail = [(float(x), float(s), float(a), float(b)) for x, s, a, b in zip(grid, point, lows, highs)]
    above = n - np.cumsum(counts)  # rows above each distinct (length, cut) pair, in sorted order
    empirical = [(int(v), float(a / n)) for v, a, c in zip(values, above, vcut) if not c]
    probe_survival = []
    if probe is not None and probe.rows:
        pv, pc = np.unique(probe.completion_tokens, return_counts=True)
        probe_survival = [(int(v), float(a / probe.rows)) for v, a in zip(pv, probe.rows - np.cumsum(pc))]
        if probe.continued_from:  # its shares are of the honest cut rows: P(L > x) = R + p0 * share, beyond the cap
            probe_survival = [(v, (n_loop + honest_cut * a) / n) for v, a in probe_survival]
    return CapPlan(
        config_hash=config_hash,
        shard=shard,
        cap=int(cap),
        rows=n,
        truncated=n_cut,
        prompts=prompts,
        tokens_per_s=tokens_per_s,
        context_length=context_length,
        fit=fit,
        estimates=estimates,
        empirical=empirical,
        tail=tail,
        bootstrap=len(boot_tokens),
        notes=notes,
        runaways=n_loop,
        probe=probe if measured is not None else None,
        probe_survival=probe_survival,
        probe_precision=precision,
    )


# ---- from the data dir -----------------------------------------------------------------------------------


SAMPLING = ("model", *SAMPLING_PARAMS, "enable_thinking")  # what must match for a probe to apply
# a runaway stopped while streaming is a cut row that loops, at the length it really cost (rules.RUNAWAY_FINISH)
ROW_QUERY = (
    f"SELECT completion_tokens, {CUT_SQL} AS truncated, {{runaway}} AS runaway, prompt_tokens, "
    f"max_output_tokens, server_context_length, {', '.join(SAMPLING)}, turn "
    f"FROM {{src}} WHERE {{where}} AND (finish_reason = 'stop' OR {CUT_SQL}) "
    "AND completion_tokens IS NOT NULL"
)


def read_probe(
    data_dir: str | Path,
    like: dict | None = None,
    runaway: RunawaySettings = RunawaySettings(),
    notes: list[str] | None = None,
    parent: str | None = None,
) -> ProbeSample | None:
    """The length probe's rows (generation/probe.py) of the config with the largest cap whose sampling matches
    `like` (SAMPLING: the model, every sampling parameter, thinking), only for prompts in the probe's current sample.
    A continuation probe of `parent`'s cut rows (the planned config's) comes first: it measures the tail of
    that run only, and more precisely. None when there is no probe (or none that matches)."""
    from dflash_assets.generation.probe import CUT_ROWS_SHARD, PROBE_SHARD, probe_root
    from dflash_assets.store.schema import PROMPT_SCHEMA

    root = probe_root(data_dir)
    with duckdb.connect(":memory:") as con:
        register_runaway(con, runaway)
        if parent is not None:
            src = parquet_source(con, root, "completions", COMPLETION_SCHEMA, CUT_ROWS_SHARD)
            sample = parquet_source(con, root, "prompt_shards", PROMPT_SCHEMA, CUT_ROWS_SHARD)
            found = con.execute(
                f"SELECT config_hash, max(max_output_tokens) FROM {src} WHERE parent_config_hash = "
                f"$parent GROUP BY 1 ORDER BY 2 DESC, 1",
                {"parent": parent},
            ).fetchall()
            if found:
                config_hash, cap = found[0]
                rows = con.execute(
                    ROW_QUERY.format(
                        runaway=runaway_sql(runaway),
                        src=src,
                        where=f"config_hash = $config AND parent_config_hash = $parent AND prompt_id IN (SELECT prompt_id "
                        f"FROM {sample})",
                    ),
                    {"config": config_hash, "parent": parent},
                ).fetchnumpy()
                if len(rows["completion_tokens"]):
                    return ProbeSample.of(
                        rows["completion_tokens"],
                        rows["truncated"],
                        int(cap),
                        rows["runaway"],
                        config_hash,
                        continued_from=parent,
                    )
        src = parquet_source(con, root, "completions", COMPLETION_SCHEMA, PROBE_SHARD)
        sample = parquet_source(con, root, "prompt_shards", PROMPT_SCHEMA, PROBE_SHARD)
        sampling = ", ".join(f"any_value({k})" for k in SAMPLING)
        configs = con.execute(
            f"SELECT config_hash, max(max_output_tokens), {sampling} FROM {src} GROUP BY 1 ORDER BY 2 DESC, 1"
        ).fetchall()
        matching = [c for c in configs if like is None or tuple(c[2:]) == tuple(like[k] for k in SAMPLING)]
        if not matching:
            if configs and notes is not None:
                notes.append(
                    f"a length probe exists (configs {', '.join(f'`{c[0]}`' for c in configs)}) but none was "
                    f"made with the planned rows' model and sampling: it is not used"
                )
            return None
        config_hash, cap = matching[0][:2]
        rows = con.execute(
            ROW_QUERY.format(
                runaway=runaway_sql(runaway),
                src=src,
                where=f"config_hash = $config AND prompt_id IN (SELECT prompt_id FROM {sample})",
            ),
            {"config": config_hash},
        ).fetchnumpy()
    if not len(rows["completion_tokens"]):
        return None
    return ProbeSample.of(rows["completion_tokens"], rows["truncated"], int(cap), rows["runaway"], config_hash)


def honest_cut_rows(
    data_dir: str | Path, config_hash: str | None = None, runaway: RunawaySettings = RunawaySettings()
) -> tuple[str, int, list[dict]]:
    """What a continuation probe samples: the config (by default the latest, the most recently written, as
    plan_caps chooses), its cap and its honest cut rows ({shard, prompt_id}: finish_reason 'length', runaways left out,
    as the plan leaves them out of the tail)."""
    with duckdb.connect(":memory:") as con:
        register_runaway(con, runaway)
        src = parquet_source(con, data_dir, "completions", COMPLETION_SCHEMA)
        configs = con.execute(
            f"SELECT config_hash, count(*) FROM {src} GROUP BY 1 ORDER BY {LATEST_ORDER_SQL}"
        ).fetchall()
        if not configs:
            raise PlanError(
                f"no completion rows under {data_dir}: a continuation probe continues a run's cut rows; "
                f"generate the run first, or probe random prompts (mode prompts)"
            )
        config_hash = config_hash or configs[0][0]
        if config_hash not in {h for h, _ in configs}:
            raise PlanError(
                f"no rows of config `{config_hash}`; configs present: {', '.join(f'`{h}`' for h, _ in configs)}"
            )
        cap = one(
            con, f"SELECT max(max_output_tokens) FROM {src} WHERE config_hash = $config", {"config": config_hash}
        )[0]
        rows = con.execute(
            f"SELECT shard, prompt_id FROM {src} WHERE config_hash = $config AND finish_reason = "
            f"'length' AND NOT ({runaway_sql(runaway)})",
            {"config": config_hash},
        ).fetchall()
    return config_hash, int(cap), [{"shard": a, "prompt_id": b} for a, b in rows]


def cut_rows_for_probe(
    data_dir: str | Path, runaway: RunawaySettings = RunawaySettings()
) -> tuple[str, int, list[dict]]:
    """The run's honest cut rows (the config the plan is for: the latest, the most recently written), runaways left
    out: which rows the continuation probe measures is the quality layer's call (generation/probe.py
    run_length_probe continues them)."""
    try:
        return honest_cut_rows(data_dir, runaway=runaway)
    except PlanError as e:
        raise FileNotFoundError(str(e)) from None


def plan_caps(
    data_dir: str | Path,
    config_hash: str | None = None,
    shard: str | None = None,
    candidates=DEFAULT_CANDIDATES,
    tokens_per_s: float | None = None,
    context_length: int | None = None,
    use_probe: bool = True,
    runaway: RunawaySettings = RunawaySettings(),
    **kwargs,
) -> CapPlan:
    """The cap plan of one config's committed completion rows (all shards, or one), with the length probe's
    rows when there is a probe of the same model and sampling (`use_probe=False` plans without it).

    `config_hash=None` plans the latest config (the most recently written) and says so in the notes. Without any completion
    rows the probe's own rows are planned. `context_length=None` uses the smallest server context length the
    rows were made on. Other keyword arguments go to `plan_from_lengths` (prompts, fit_from, bootstrap, seed).
    """
    notes: list[str] = []
    with duckdb.connect(":memory:") as con:
        register_runaway(con, runaway)
        src = parquet_source(con, data_dir, "completions", COMPLETION_SCHEMA, shard)
        scope = "($shard IS NULL OR shard = $shard)"
        configs = con.execute(
            f"SELECT config_hash, count(*) FROM {src} WHERE {scope} GROUP BY 1 ORDER BY {LATEST_ORDER_SQL}",
            {"shard": shard},
        ).fetchall()
        if not configs:
            probe = read_probe(data_dir, None, runaway) if use_probe and config_hash is None else None
            if probe is None:
                where = f"shard {shard}" if shard else "any shard"
                raise PlanError(f"no completion rows under {data_dir} for {where}: generate a sample first")
            notes.append(
                f"no completion rows yet: planned from the length probe alone ({num(probe.rows)} rows at "
                f"cap {num(probe.cap)}, config `{probe.config_hash}`)"
            )
            return plan_from_lengths(
                probe.completion_tokens,
                probe.truncated,
                probe.cap,
                runaway=probe.runaway,
                candidates=candidates,
                tokens_per_s=tokens_per_s,
                context_length=context_length,
                config_hash=probe.config_hash,
                notes=notes,
                **kwargs,
            )
        if config_hash is None:
            config_hash = configs[0][0]
            others = f"; the others: {', '.join(f'`{h}` ({num(c)})' for h, c in configs[1:])}" if configs[1:] else ""
            notes.append(
                f"config `{config_hash}` chosen by default: the latest, the most recently written "
                f"({num(configs[0][1])} rows){others}"
            )
        elif config_hash not in {h for h, _ in configs}:
            raise PlanError(
                f"no rows of config `{config_hash}`; configs present: {', '.join(f'`{h}`' for h, _ in configs)}"
            )
        rows = con.execute(
            ROW_QUERY.format(runaway=runaway_sql(runaway), src=src, where=f"{scope} AND config_hash = $config"),
            {"shard": shard, "config": config_hash},
        ).fetchnumpy()
        skipped = dict(configs)[config_hash] - len(rows["completion_tokens"])
    if skipped:
        notes.append(f"{num(skipped)} rows without a 'stop' or 'length' finish left out")
    caps = np.unique(rows["max_output_tokens"])
    if len(caps) > 1:
        notes.append(f"the rows carry several caps ({', '.join(map(num, caps))}); planning at the largest")
    if context_length is None and len(rows["server_context_length"]):
        context_length = int(np.min(rows["server_context_length"]))
        notes.append(f"context length {num(context_length)}: the smallest the rows' servers had")
    probe = None
    if use_probe and len(rows["completion_tokens"]):
        like = {k: rows[k][:1].tolist()[0] for k in SAMPLING}  # None where unrecorded, as any_value gives it
        probe = read_probe(data_dir, like, runaway, notes, parent=config_hash)
    plan = plan_from_lengths(
        rows["completion_tokens"],
        rows["truncated"],
        int(caps.max()),
        rows["prompt_tokens"],
        runaway=rows["runaway"],
        probe=probe,
        candidates=candidates,
        tokens_per_s=tokens_per_s,
        context_length=context_length,
        config_hash=config_hash,
        shard=shard,
        notes=notes,
        **kwargs,
    )
    return replace(plan, by_turn=turn_views(rows["turn"], rows["completion_tokens"], rows["truncated"]))


# ---- for people ------------------------------------------------------------------------------------------


def _tokens(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def _hours(h: float) -> str:
    """A time in the unit that shows it: hours, minutes, seconds (an emulated demo's plan lasts seconds)."""
    if h >= 1:
        return f"{h:.1f} h"
    if h * 60 >= 1:
        return f"{h * 60:.0f} min"
    return f"{h * 3600:.0f} s" if h * 3600 >= 1 else "under 1 s"


def _span(e: Estimate, fmt) -> str:
    if e.low == e.high:
        return fmt(e.value)
    return f"{fmt(e.value)} ({fmt(e.low)}–{fmt(e.high)})"


def _needed(e: CapEstimate) -> str:
    if e.context_needed_max is None or e.context_needed_p99 is None:  # both or neither
        return "-"
    return f"{num(e.context_needed_max)} / {num(e.context_needed_p99)}"


def turn_markdown(plan: CapPlan) -> list[str]:
    """The by-turn view as Markdown lines (none for last_turn rows)."""
    if not plan.by_turn:
        return []
    return [
        "",
        f"By turn (all_turns), at cap {num(plan.cap)}:",
        "",
        "| turn | rows | cut now | P50 | P90 | P99 |",
        "|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {t.turn} | {num(t.rows)} | {pct(t.truncation_rate)} | {num(t.p50)} | {num(t.p90)} | {num(t.p99)} |"
            for t in plan.by_turn
        ),
    ]


def plan_glance(plan: CapPlan) -> str:
    """The plan in one line, for the UI's metadata list (the table is a click away): each candidate cap's share
    cut, measured or modelled."""
    scope = f"config {plan.config_hash}: " if plan.config_hash else ""
    caps = "; ".join(
        f"{num(e.cap)}{' (now)' if e.cap == plan.cap else ''} cuts {pct(e.truncation_rate.value)}"
        f"{'' if e.measured else ' (model)'}"
        for e in plan.estimates
    )
    return f"{scope}{caps}. The whole table: cap_plan ([Show Markdown])."


def plan_markdown(plan: CapPlan) -> str:
    """The plan as a Markdown paragraph, a table with one row per candidate cap, and its notes."""
    scope = f" for config `{plan.config_hash}`" if plan.config_hash else ""
    scope += f" (shard {plan.shard})" if plan.shard else ""
    head = (
        f"**Cap plan**{scope}: {num(plan.rows)} rows at cap {num(plan.cap)}, {num(plan.truncated)} cut "
        f"({pct(plan.truncated / plan.rows)}). Totals are for {num(plan.prompts)} prompts."
    )
    if plan.runaways:
        head += (
            f" Of the cut rows {num(plan.runaways)} are runaways (looping): no cap ends them, so they count as "
            f"cut at every cap and stay out of the tail."
        )
    if plan.probe and plan.probe.continued_from:
        head += (
            f" Between the cap and {num(plan.probe.cap)} the figures are **measured** by a continuation probe "
            f"({num(plan.probe.rows)} of the run's honest cut rows continued to cap {num(plan.probe.cap)}, "
            f"config `{plan.probe.config_hash}`): the share cut now, from every row, times the share of "
            f"them still cut, no model."
        )
    elif plan.probe:
        head += (
            f" Between the cap and {num(plan.probe.cap)} the figures are **measured** by a length probe "
            f"({num(plan.probe.rows)} random prompts at cap {num(plan.probe.cap)}, config "
            f"`{plan.probe.config_hash}`), no model."
        )
    if plan.fit and any(e.basis == "model" for e in plan.estimates):
        window = f"rows above {num(plan.fit.fit_from_tokens)} tokens" if plan.fit.fit_from_tokens else "all rows"
        head += (
            f" Where a figure says **model**, it comes from a lognormal tail (median "
            f"{num(round(math.exp(plan.fit.mu)))}, sigma {plan.fit.sigma:.2f}) fitted by censored maximum "
            f"likelihood to {window}: its interval holds only if the lengths are lognormal; the range the "
            f"rows themselves support is given beside it."
        )
    if plan.bootstrap:
        head += f" Intervals are 95%, from {plan.bootstrap} bootstrap resamples of the rows."
    ctx = f"fits {num(plan.context_length)}" if plan.context_length else "fits context"
    timed = f"time at {num(round(plan.tokens_per_s))} tok/s | " if plan.tokens_per_s else ""
    lines = [
        head,
        "",
        f"| cap | cut at the cap | of which runaways | from | output tokens | {timed}vs now "
        f"| context needed (max / P99) | {ctx} |",
        f"|---:|---|---|---|---|{'---|' if timed else ''}---:|---|---|",
    ]
    now = plan.at(plan.cap).output_tokens.value
    for e in plan.estimates:
        label = f"{num(e.cap)}{' (now)' if e.cap == plan.cap else ''}"
        basis = {
            "rows": "measured (the rows)",
            "probe": f"measured ({probe_label(plan.probe)})",
            "model": f"**model**; the rows support {pct(e.bounds.low)}–{pct(e.bounds.high)}"
            if e.bounds
            else "**model**",
        }[e.basis]
        time_ = f"{_span(e.hours, _hours)} | " if e.hours else ""
        fits = (
            "-"
            if e.prompts_over_context is None  # None with fits_context
            else "yes"
            if e.fits_context
            else f"no: {num(e.prompts_over_context)} rows over"
        )
        lines.append(
            f"| {label} | {_span(e.truncation_rate, pct)} | {_span(e.runaway_rate, pct)} | {basis} | "
            f"{_span(e.output_tokens, _tokens)} | {time_}{e.output_tokens.value / now:.2f}× | {_needed(e)} "
            f"| {fits} |"
        )
    if plan.probe_precision:
        lines += ["", f"**Probe precision**: {precision_text(plan.probe_precision, plan.cap)}."]
    lines += turn_markdown(plan)
    notes = list(plan.notes)
    if plan.tokens_per_s:
        notes.append(
            "times assume the fleet keeps its token rate; longer outputs hold KV longer, so check "
            "capacity (fleet tuning report) before trusting them at a larger cap"
        )
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)
