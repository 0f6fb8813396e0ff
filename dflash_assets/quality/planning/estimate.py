"""The cap plan from one config's lengths: truncation, output tokens, time and context length for candidate caps.

Each figure says where it comes from (`CapEstimate.basis`): the rows at or below the current cap, a length probe up
to its cap (probe_estimates.py), else the tail model, with the range the rows alone support (`bounds`). Runaway rows
are kept out of the tail: they count as cut at every cap and cost the whole cap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dflash_assets.quality.outcome import num, pct
from dflash_assets.quality.planning.fit import (
    Distinct,
    PlanError,
    TailFit,
    fit_lognormal,
    fit_tail,
    lognormal_sf,
    sufficient_stats,
)
from dflash_assets.quality.planning.probe_estimates import (
    Measured,
    ProbePrecision,
    ProbeSample,
    measure_with_probe,
    wilson,
)
from dflash_assets.rules import context_needed, overflows, percentile

DEFAULT_CANDIDATES = (4096, 5120, 6144, 8192, 12288, 16384)


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float  # 95% bootstrap interval
    high: float


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
    held: int = 0  # cut rows the window policy sized below the cap (in `truncated`): cut at every cap

    @property
    def honest(self) -> int:
        """The cut rows a larger cap would let go on: neither runaways nor held by the window."""
        return self.truncated - self.runaways - self.held

    def at(self, cap: int) -> CapEstimate:
        return next(e for e in self.estimates if e.cap == cap)


def predict(rows: Distinct, caps: np.ndarray, fit: tuple[float, float] | None) -> tuple[np.ndarray, np.ndarray]:
    """Rows above each cap (expected) and output tokens at each cap: exact for uncut rows and for cut rows
    below their cut point, the fitted conditional tail for cut rows above it; runaway (`loop`) rows run past
    every cap and cost all of it, but those stopped while streaming (below the rows' own cap) cost what they
    decoded: a stop comes at the same point under any cap above it. So do the cuts the window policy sized
    (`held`): cut at every cap, at the length they have."""
    values, cut, counts, loop = rows.values, rows.cut, rows.counts, rows.loop
    unc = ~cut
    over = (counts[unc][None, :] * (values[unc][None, :] > caps[:, None])).sum(1).astype(float)
    tokens = (counts[unc][None, :] * np.minimum(values[unc][None, :], caps[:, None])).sum(1).astype(float)
    over += int(counts[rows.fixed].sum())
    stopped = (loop & (values < rows.cap)) | rows.held
    tokens += int(counts[loop & ~stopped].sum()) * caps.astype(float)
    tokens += (counts[stopped][None, :] * np.minimum(values[stopped][None, :], caps[:, None])).sum(1)
    honest = rows.honest
    for v, k in zip(values[honest], counts[honest]):
        beyond = caps > v
        over += k * ~beyond
        tokens += k * np.where(beyond, 0.0, caps)
        if beyond.any():
            if fit is None:
                raise ValueError("rows cut below a cap need a tail fit to predict it")  # the callers fit one
            mu, sigma = fit
            lc, lv = np.log(caps[beyond]), math.log(v)
            qv, qc = lognormal_sf(lv, mu, sigma), lognormal_sf(lc, mu, sigma)
            # E[min(L, c) | L > v] = (E[L; v < L <= c] + c P(L > c)) / P(L > v), lognormal partial expectation
            partial = math.exp(mu + sigma**2 / 2) * (
                lognormal_sf(lv, mu + sigma**2, sigma) - lognormal_sf(lc, mu + sigma**2, sigma)
            )
            over[beyond] += k * qc / qv
            tokens[beyond] += k * (partial + caps[beyond] * qc) / qv
    return over, tokens


@dataclass(frozen=True)
class Replicates:
    """The bootstrap: per replicate, the share over each cap, output tokens at each cap, the tail's P(L > x) on the
    plan's grid and the runaways' share."""

    shares: np.ndarray
    tokens: np.ndarray
    tails: np.ndarray
    loops: np.ndarray


def bootstrap_replicates(
    rows: Distinct, caps: np.ndarray, fit: TailFit | None, grid: np.ndarray, replicates: int, seed: int
) -> Replicates:
    """Rows resampled as a multinomial draw over the distinct pairs (drawing n rows with replacement, at a cost set by
    the distinct lengths), the tail refitted each time."""
    rng = np.random.default_rng(seed)
    n = rows.rows
    honest_cut = rows.honest  # at the rows' cap (a runaway stopped early is below it)
    tail_from = int(rows.values[honest_cut].min()) if honest_cut.any() else 0
    shares, tokens, tails, loops = [], [], [], []
    for _ in range(replicates):
        c = rng.multinomial(n, rows.counts / n)
        b = rows.where(c > 0, c)
        bfit = None
        if fit and b.honest.any():  # (a resample without honest cut rows has no tail: no fit needed)
            h = ~b.loop
            bst = sufficient_stats(b.values[h], b.cut[h], b.counts[h], fit.fit_from_tokens)
            if bst["k"] < 2:
                continue  # too few uncut rows in the window for this replicate to mean anything
            bfit = fit_lognormal(bst, (fit.mu, fit.sigma))
        if fit:
            tail = lognormal_sf(np.log(grid), *bfit) / lognormal_sf(math.log(tail_from), *bfit) if bfit else 0 * grid
            tails.append((b.counts[b.honest].sum() * tail + b.counts[b.fixed].sum()) / n)
        o, t = predict(b, caps, bfit)
        shares.append(o / n)
        tokens.append(t)
        loops.append(b.counts[b.loop].sum() / n)
    shape = (-1, len(caps))
    tail_grid = np.array(tails).reshape(len(tails), len(grid))
    return Replicates(np.array(shares).reshape(shape), np.array(tokens).reshape(shape), tail_grid, np.array(loops))


def interval(point: float, samples: np.ndarray, scale: float = 1.0) -> Estimate:
    if len(samples) < 2:
        return Estimate(point * scale, point * scale, point * scale)
    low, high = np.quantile(samples, [0.025, 0.975])
    return Estimate(point * scale, float(low) * scale, float(high) * scale)


@dataclass(frozen=True)
class Lengths:
    """One config's rows as the plan reads them, a column a field, at the cap they were made with; `runaway`: which
    cut rows loop (kept out of the tail)."""

    completion_tokens: Any
    truncated: Any
    cap: int
    prompt_tokens: Any = None
    runaway: Any = None
    config_hash: str | None = None
    shard: str | None = None
    held: Any = None  # cut rows the window policy sized below the cap (rules.WINDOW_SIZED_SQL): final at every cap


@dataclass(frozen=True)
class PlanOptions:
    """How to plan: the candidate caps, the fleet's tok/s and servers (hours), the servers' context length, the prompt
    count the totals are scaled to (default: the rows), the tail's `fit_from` quantile and the bootstrap."""

    candidates: Iterable[int] = DEFAULT_CANDIDATES
    tokens_per_s: float | None = None
    context_length: int | None = None
    prompts: int | None = None
    fit_from: float = 0.0
    bootstrap: int = 200
    seed: int = 0
    servers: int | None = None  # the servers the tok/s was measured on: hours times them are GPU-hours


@dataclass(frozen=True)
class _Figures:
    """What plan_from_lengths has computed when it writes each cap's estimate."""

    rows: Distinct
    caps: np.ndarray
    over: np.ndarray
    tokens: np.ndarray
    boot: Replicates
    measured: Measured | None
    probe: ProbeSample | None
    prompt_tokens: Any  # an array of one per prompt, or None

    @property
    def n(self) -> int:
        return self.rows.rows

    @property
    def n_cut(self) -> int:
        return int(self.rows.counts[self.rows.cut].sum())

    @property
    def n_loop(self) -> int:
        return int(self.rows.counts[self.rows.loop].sum())

    @property
    def n_honest(self) -> int:
        return int(self.rows.counts[self.rows.honest].sum())


def _distinct(rows: Lengths) -> Distinct:
    """The rows as distinct triples; refused when there is nothing to plan from."""
    lengths = np.asarray(rows.completion_tokens, dtype=np.int64)
    cut = np.asarray(rows.truncated, dtype=bool)
    none = np.zeros(len(lengths), bool)
    loop = cut & (none if rows.runaway is None else np.asarray(rows.runaway, dtype=bool))
    held = cut & ~loop & (none if rows.held is None else np.asarray(rows.held, dtype=bool))
    n, n_cut, cap = len(lengths), int(cut.sum()), rows.cap
    if n == 0:
        raise PlanError("no completion rows to plan from: generate a sample at the current cap first")
    if n_cut == n and (~loop & ~held).any():
        raise PlanError(
            f"all {num(n)} rows were cut at the cap of {num(cap)} tokens: nothing is known about the "
            f"lengths below it, so no tail can be fitted. Run a sample at a larger cap first "
            f"(e.g. {num(4 * cap)}) and plan from that"
        )
    return Distinct.of(lengths, cut, loop, cap, held)


def _tail(rows: Distinct, caps: np.ndarray, fit_from: float, notes: list[str]) -> tuple[TailFit | None, np.ndarray]:
    """The lognormal tail of the honest cut rows (none without them) and the grid its picture is drawn on."""
    cap, n_cut, n_loop = rows.cap, int(rows.counts[rows.cut].sum()), int(rows.counts[rows.loop].sum())
    fit, grid = None, np.array([])
    if rows.honest.any():
        h = ~rows.loop
        fit = fit_tail(rows.values[h], rows.cut[h], rows.counts[h], fit_from, notes)
        grid = np.geomspace(cap, caps.max() * 1.25, 48)
    elif held := int(rows.counts[rows.held].sum()):
        notes.append(
            f"every honest cut row ({num(held)}) was cut where the window policy sized its request, below the cap "
            f"{num(cap)}: final at every cap, so no tail model is needed (a larger cap changes no request)"
        )
    else:
        but = " but runaways" if n_loop else ""
        change = "nothing but what the runaways cost" if n_loop else "nothing"
        notes.append(
            f"no row was cut at the cap of {num(cap)} tokens{but}: every {'other ' if n_loop else ''}length is "
            f"observed, no tail model is needed (larger caps change {change})"
        )
    if n_loop:
        notes.append(
            f"{num(n_loop)} of the {num(n_cut)} cut rows ({pct(n_loop / rows.rows)} of all rows) are runaways "
            f"(cut while repeating themselves): they are counted as cut at every cap and cost all of it, "
            f"and are left out of the tail"
        )
    return fit, grid


def _measure(rows: Distinct, caps: np.ndarray, probe: ProbeSample | None, options: PlanOptions, notes: list[str]):
    """The probe's measurement of the caps between the current cap and its own; None without one that says
    anything."""
    n, n_loop, cap = rows.rows, int(rows.counts[rows.loop].sum()), rows.cap
    if probe is None or not rows.honest.any():
        return None
    in_probe = (caps > cap) & (caps <= probe.cap)
    if probe.cap <= cap:
        notes.append(
            f"the length probe's cap {num(probe.cap)} is not above the current cap {num(cap)}: it "
            f"measures nothing the rows do not"
        )
        return None
    if not in_probe.any():
        return None
    measured = measure_with_probe(rows, probe, caps[in_probe], options.bootstrap, options.seed)
    if measured is None:
        notes.append(
            f"the length probe has fewer than 10 rows above the current cap {num(cap)}: too few "
            f"to measure the tail; the figures beyond the cap stay model-based"
        )
    elif wilson(measured.probe_runaways, probe.rows)[0] > wilson(n_loop, n)[1]:
        notes.append(
            f"the probe has {pct(measured.probe_runaways / probe.rows)} runaways, the rows at "
            f"the cap {pct(n_loop / n)}: loops that start after the cap; the probe's figures "
            f"count them with the honest tail"
        )
    return measured


def _estimates(f: _Figures, options: PlanOptions) -> tuple[list[CapEstimate], list[ProbePrecision], Estimate]:
    """Each candidate cap's estimate, the probe's precision at the caps it measured, and the range the rows (and
    probe) support beyond what is measured: no fewer than the runaways, no more than what is cut now."""
    n, n_cut, n_loop, cap = f.n, f.n_cut, f.n_loop, f.rows.cap
    bounds = Estimate(n_cut / n, wilson(n_cut - f.n_honest, n)[0], wilson(n_cut, n)[1])
    loop_share = interval(n_loop / n, f.boot.loops)
    estimates, precision, k = [], [], 0
    for i, c in enumerate(f.caps.tolist()):
        rate, tok = (
            interval(float(f.over[i] / n), f.boot.shares[:, i]),
            interval(float(f.tokens[i]), f.boot.tokens[:, i]),
        )
        loops, basis = loop_share, "rows" if c <= cap or not f.n_honest else "model"
        if f.measured is not None and f.probe is not None and cap < c <= f.probe.cap:
            m = f.measured
            rate = interval(float(m.rate[k]), m.boot_rate[:, k])
            rate = replace(rate, low=min(rate.low, float(m.score_low[k])), high=max(rate.high, float(m.score_high[k])))
            loops = interval(float(m.runaway[k]), m.boot_runaway[:, k])
            tok = interval(float(m.tokens_per_prompt[k] * n), m.boot_tokens[:, k] * n)
            continued = f.probe.continued_from is not None
            precision.append(
                ProbePrecision.of(
                    c, (n_cut - n_loop) / n, int(m.hits[k]), m.honest_above, f.probe.rows, continued=continued
                )
            )
            basis, k = "probe", k + 1
            # a larger cap cuts no more than this one: beyond the probe, the rows and probe support at most this
            bounds = replace(bounds, value=rate.value, high=rate.high)
        estimates.append(_at_cap(c, tok, rate, loops, basis, bounds, f, options))
    return estimates, precision, bounds


def _at_cap(
    c: int, tok: Estimate, rate: Estimate, loops: Estimate, basis: str, bounds: Estimate, f: _Figures, o: PlanOptions
) -> CapEstimate:
    prompts = o.prompts or f.n
    tok = Estimate(*(v * prompts / f.n for v in (tok.value, tok.low, tok.high)))
    hours = Estimate(*(v / o.tokens_per_s / 3600 for v in (tok.value, tok.low, tok.high))) if o.tokens_per_s else None
    pt, over_ctx = f.prompt_tokens, None
    if o.context_length is not None and pt is not None:
        over_ctx = int(np.count_nonzero(overflows(pt, c, o.context_length)))  # pt is an array: one per prompt
    return CapEstimate(
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


def _curves(f: _Figures, fit: TailFit | None, grid: np.ndarray) -> tuple[list, list, list]:
    """For the picture: the fitted tail with its band above the cap, the observed P(L > x) at the distinct uncut
    lengths, and the probe's."""
    n, n_loop, honest, cap, rows = f.n, f.n_cut - f.n_honest, f.n_honest, f.rows.cap, f.rows
    tail = []
    if fit:
        point = (
            honest * lognormal_sf(np.log(grid), fit.mu, fit.sigma) / lognormal_sf(math.log(cap), fit.mu, fit.sigma)
            + n_loop
        ) / n
        band = f.boot.tails if len(f.boot.tails) >= 2 else point[None, :]
        lows, highs = np.quantile(band, 0.025, axis=0), np.quantile(band, 0.975, axis=0)
        tail = [(float(x), float(s), float(a), float(b)) for x, s, a, b in zip(grid, point, lows, highs)]
    above = n - np.cumsum(rows.counts)  # rows above each distinct (length, cut) pair, in sorted order
    empirical = [(int(v), float(a / n)) for v, a, c in zip(rows.values, above, rows.cut) if not c]
    probe, probe_survival = f.probe, []
    if probe is not None and probe.rows:
        pv, pc = np.unique(probe.completion_tokens, return_counts=True)
        probe_survival = [(int(v), float(a / probe.rows)) for v, a in zip(pv, probe.rows - np.cumsum(pc))]
        if probe.continued_from:  # its shares are of the honest cut rows: P(L > x) = R + p0 * share, beyond the cap
            probe_survival = [(v, (n_loop + honest * a) / n) for v, a in probe_survival]
    return tail, empirical, probe_survival


def plan_from_lengths(
    rows: Lengths,
    options: PlanOptions = PlanOptions(),
    probe: ProbeSample | None = None,
    notes: list[str] | None = None,
) -> CapPlan:
    """The plan from one config's rows: each candidate cap's figures, measured where the rows or the `probe` reach,
    else from the fitted tail, with bootstrap intervals. `notes` are said before the plan's own."""
    notes = list(notes or [])
    distinct = _distinct(rows)
    caps = np.array(sorted({int(c) for c in options.candidates} | {int(rows.cap)}), dtype=np.int64)
    fit, grid = _tail(distinct, caps, options.fit_from, notes)
    over, tokens = predict(distinct, caps, (fit.mu, fit.sigma) if fit else None)
    boot = bootstrap_replicates(distinct, caps, fit, grid, options.bootstrap, options.seed)
    measured = _measure(distinct, caps, probe, options, notes)
    pt = None if rows.prompt_tokens is None else np.ma.asarray(rows.prompt_tokens).compressed().astype(np.int64)
    figures = _Figures(
        distinct,
        caps,
        over,
        tokens,
        boot,
        measured,
        probe if measured else None,
        pt if pt is not None and len(pt) else None,
    )
    estimates, precision, bounds = _estimates(figures, options)
    if any(e.basis == "model" for e in estimates):
        first = next(e.cap for e in estimates if e.basis == "model")
        notes.append(
            f"from {num(first)} tokens on the figures come from a model (a lognormal tail), not a "
            f"measurement: its 95% band holds only if the lengths are lognormal. The rows alone say only "
            f"that between {pct(bounds.low)} and {pct(bounds.high)} would still be cut at any larger cap. "
            f"A length probe measures it instead"
        )
    tail, empirical, probe_survival = _curves(replace(figures, probe=probe), fit, grid)
    return CapPlan(
        config_hash=rows.config_hash,
        shard=rows.shard,
        cap=int(rows.cap),
        rows=figures.n,
        truncated=figures.n_cut,
        prompts=options.prompts or figures.n,
        tokens_per_s=options.tokens_per_s,
        context_length=options.context_length,
        fit=fit,
        estimates=estimates,
        empirical=empirical,
        tail=tail,
        bootstrap=len(boot.tokens),
        notes=notes,
        runaways=figures.n_loop,
        held=figures.n_cut - figures.n_loop - figures.n_honest,
        probe=probe if measured is not None else None,
        probe_survival=probe_survival,
        probe_precision=precision,
    )
