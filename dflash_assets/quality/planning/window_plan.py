"""The cap plan in trained tokens: what each candidate cap, and the window policy, decode and what the trainer reads.

Per cap c, with the trainer's window L: decoded(c) = Σ min(length, c), trained(c) = Σ over the rows the export
writes of min(length, L - prompt) (rules.trained_tokens). Every figure a row settles is read from it; only the rows
cut inside the window at the current cap have unknown lengths above it, taken from the cap plan's lognormal tail
(planner.py) conditioned on each row's own length, and the figure says "model". The window policy's trained tokens
are the floor: every prompt's first L tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from dflash_assets.generation.turns import split_turns
from dflash_assets.quality.outcome import num, pct
from dflash_assets.quality.planning.estimate import Lengths, PlanOptions
from dflash_assets.quality.planning.fit import TailFit
from dflash_assets.quality.tables import one, open_quality_db
from dflash_assets.rules import percentile
from dflash_assets.settings import GenerationSettings, RunawaySettings, TrainerSettings
from dflash_assets.store.schema import PROMPT_SCHEMA
from dflash_assets.store.stores import parquet_source

GRID = 256  # points of the numerical integral of the tail, per row


@dataclass(frozen=True)
class TrainedEstimate:
    label: str  # "cap 8,192" or "window policy"
    cap: int | None  # None for the window policy
    decoded: float
    trained: float
    basis: str  # "rows" (every figure read from the rows) or "model" (the tail of the rows cut inside the window)
    hours: float | None = None  # decoded / the fleet's measured tok/s
    gpu_hours: float | None = None  # hours times the servers that measured it

    @property
    def per_trained(self) -> float | None:
        return self.decoded / self.trained if self.trained else None


@dataclass(frozen=True)
class TurnsCost:
    """What regenerating every assistant turn costs against regenerating the last one, on a multi-turn config's
    measured lengths. Decoded tokens only: a follow-up turn's prompt is mostly prefix-cached (docs/multi-turn.md)."""

    mode: str  # the config's: "all_turns" or "last_turn"
    conversations: int
    all_turns: float  # decoded tokens under all_turns
    last_turn: float  # under last_turn: the last answer of each conversation
    basis: str  # "rows": both read from the rows; "model": one side estimated (the mean answer per turn)
    tokens_per_s: float | None = None
    servers: int | None = None

    def hours(self, decoded: float) -> str:
        if not self.tokens_per_s:
            return ""
        hours = decoded / self.tokens_per_s / 3600
        return f" ({hours * self.servers:,.1f} GPU-h)" if self.servers else f" ({hours:,.1f} h)"

    def line(self) -> str:
        ratio = f"{self.all_turns / self.last_turn:.2f}x" if self.last_turn else "-"
        model = " (model: the mean answer for the turns not generated)" if self.basis == "model" else ""
        return (
            f"regenerate, over {num(self.conversations)} conversations (this config: {self.mode}): all_turns "
            f"decodes {num(round(self.all_turns))} tokens{self.hours(self.all_turns)}, last_turn "
            f"{num(round(self.last_turn))}{self.hours(self.last_turn)}: {ratio}, the price of training only on the "
            f"target model's own answers{model}"
        )


# by prompt first, then summed: DuckDB spills a grouped aggregate past its memory limit, but holds a DISTINCT over
# every row whole
TURNS_COST = """
WITH r AS (
    SELECT c.prompt_id, c.turn, c.completion_tokens, coalesce(m.user_turns, 1) AS user_turns
    FROM completions c LEFT JOIN multi_turn m USING (prompt_id) WHERE c.completion_tokens IS NOT NULL
), p AS (
    SELECT count(*) AS rows, sum(completion_tokens) AS decoded, bool_or(turn IS NOT NULL) AS numbered,
        bool_or(turn = user_turns) AS has_last, sum(completion_tokens) FILTER (WHERE turn = user_turns) AS last,
        sum(greatest(user_turns - 1, 0)) AS earlier
    FROM r GROUP BY prompt_id
)
SELECT coalesce(sum(rows), 0), sum(decoded), count(*), bool_or(numbered), count(*) FILTER (WHERE has_last), sum(last),
    sum(earlier)
FROM p
"""


def turns_cost(con: duckdb.DuckDBPyConnection, options: PlanOptions) -> TurnsCost | None:
    """The cost from a config's rows (`completions`) and its multi-turn prompts (`multi_turn`; None without any): the
    mode not run is estimated at the mean answer length."""
    rows, decoded, ids, numbered, lasts, last, earlier = one(con, TURNS_COST)
    if not rows or not one(con, "SELECT count(*) FROM multi_turn")[0]:
        return None
    tok_s, servers = options.tokens_per_s, options.servers
    if numbered:
        mean = (last or 0) / lasts if lasts else decoded / rows
        basis = "rows" if lasts == ids else "model"
        return TurnsCost("all_turns", ids, decoded, (last or 0) + mean * (ids - lasts), basis, tok_s, servers)
    return TurnsCost("last_turn", rows, decoded + decoded / rows * earlier, decoded, "model", tok_s, servers)


@dataclass(frozen=True)
class WindowPlan:
    max_length: int
    overshoot: int
    cap: int  # the current cap
    rows: int
    floor: float  # every prompt's first L tokens (the window policy's trained tokens)
    estimates: list[TrainedEstimate]  # the current cap and the candidates, in cap order
    window: TrainedEstimate  # the window policy
    recommended: TrainedEstimate  # never a cap past the one that already lets every prompt fill the window
    cut_inside_window: int
    window_complete: int
    tokens_per_s: float | None = None
    notes: list[str] = field(default_factory=list)
    prompt_p50: int = 0  # the median prompt: the window sits at max_length - prompt_p50 completion tokens for it
    filling: int = 0  # rows whose prompt fills the window: decoded at every cap, never trained (no room)
    filling_decoded: int = 0  # their decoded tokens at the current cap
    turns: TurnsCost | None = None  # a multi-turn source: all_turns against last_turn

    @property
    def window_at(self) -> int:
        """Where the window ends in completion tokens for the median prompt (the picture marks it)."""
        return max(self.max_length - self.prompt_p50, 1)

    def at(self, cap: int) -> TrainedEstimate:
        return next(e for e in self.estimates if e.cap == cap)

    def raising(self, a: int, b: int) -> str:
        """'raising the cap from A to B adds X trained tokens (+Y%) for Z more decoded (+W%)'."""
        x, y = self.at(a), self.at(b)
        dt, dd = y.trained - x.trained, y.decoded - x.decoded
        gain = pct(dt / x.trained) if x.trained else "from none"
        model = " (model)" if "model" in (x.basis, y.basis) else ""
        return (
            f"raising the cap from {num(a)} to {num(b)} adds {num(round(dt))} trained tokens (+{gain}) for "
            f"{num(round(dd))} more decoded (+{pct(dd / x.decoded) if x.decoded else '-'}){model}"
        )


def _tail_mean(fit: TailFit | None, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """E[min(L, high) - low | L > low] under the fit, per row (0 without a fit or where high <= low)."""
    out = np.zeros(len(low))
    rows = np.flatnonzero(np.asarray(high) > np.asarray(low))
    if fit is None or not len(rows):
        return out
    for chunk in np.array_split(rows, -(-len(rows) // 512)):  # 512 rows' grids at a time, not a loop a row
        a, b = np.asarray(low, dtype=float)[chunk], np.asarray(high, dtype=float)[chunk]
        t = np.linspace(a, b, GRID, axis=1)
        s = fit.survival(np.maximum(t, 1.0)) / np.maximum(fit.survival(np.maximum(a, 1.0)), 1e-300)[:, None]
        out[chunk] = np.trapezoid(np.minimum(s, 1.0), t, axis=1)
    return out


def _survive(fit: TailFit | None, low: np.ndarray, x: np.ndarray) -> np.ndarray:
    """P(L > x | L > low) under the fit (1 without a fit: nothing is known beyond the cut)."""
    if fit is None:
        return np.ones(len(low))
    return np.minimum(1.0, fit.survival(np.maximum(x, 1.0)) / np.maximum(fit.survival(np.maximum(low, 1.0)), 1e-300))


def _at_cap(c: int, p, length, cut, loop, window: int, fit: TailFit | None) -> tuple[float, float, bool]:
    """(decoded, trained, modelled) at cap c."""
    room = np.maximum(window - p, 0).astype(float)
    beyond = cut & (c > length)  # cut now, asked for more at c: its length above the current cap is unknown
    honest = beyond & ~loop
    # at or below a row's known length: the cap c cuts it (written iff p + c reaches the window) or it stopped
    stops = ~cut & (length <= c)
    cut_at_c = ~beyond & ~stops
    dec = np.where(beyond, float(c), np.minimum(length, c)).astype(float)  # a runaway loops to any cap
    tr = np.where(
        stops, np.minimum(length, room), np.where(cut_at_c & ~loop & (p + c >= window), np.minimum(float(c), room), 0.0)
    )
    if honest.any():  # the tail, from each row's own length: only rows cut at the current cap
        lo, r = length[honest].astype(float), room[honest]
        dec[honest] = lo + _tail_mean(fit, lo, np.full(len(lo), float(c)))
        reach = np.minimum(r, float(c))
        whole = np.where(lo >= r, r, lo + _tail_mean(fit, lo, reach))  # E[min(L, room)]; past the window: room
        stopped = whole - reach * _survive(fit, lo, reach)  # E[L 1{L <= reach}]: written only when it stops
        tr[honest] = np.where(p[honest] + c >= window, whole, stopped)
    return float(dec.sum()), float(tr.sum()), bool(honest.any())


def plan_window(
    rows: Lengths,
    max_length: int,
    options: PlanOptions = PlanOptions(),
    fit: TailFit | None = None,
    overshoot: int = GenerationSettings().overshoot,
) -> WindowPlan:
    """The plan from one config's rows (Lengths); `fit` is the cap plan's tail (None: no honest cut row)."""
    p, length = np.asarray(rows.prompt_tokens, dtype=np.int64), np.asarray(rows.completion_tokens, dtype=np.int64)
    cut = np.asarray(rows.truncated, dtype=bool)
    loop = (np.zeros(len(cut), bool) if rows.runaway is None else np.asarray(rows.runaway, dtype=bool)) & cut
    room = np.maximum(max_length - p, 0)
    inside = cut & ~loop & (length < room)  # cut inside the window: its length is unknown above the cap
    scaled = _Scaled(options, len(length))
    caps = sorted({int(c) for c in options.candidates if c >= rows.cap} | {int(rows.cap)})
    at_caps = [scaled(f"cap {num(c)}", c, *_at_cap(c, p, length, cut, loop, max_length, fit)) for c in caps]
    window = scaled(
        "window policy", None, *_window_policy(p, length, cut, loop, room, max(caps[-1], rows.cap), overshoot, fit)
    )
    # the smallest cap that lets every prompt reach the window: past it a larger cap buys only untrained tokens
    ceiling = int(room.max()) if len(length) else rows.cap
    enough = [e for e in at_caps if e.cap is not None and e.cap >= ceiling]  # every one has a cap
    recommended = window if not inside.any() else (enough[0] if enough else at_caps[-1])
    no_tail = inside.any() and fit is None
    return WindowPlan(
        max_length,
        overshoot,
        rows.cap,
        len(length),
        window.trained,
        at_caps,
        window,
        recommended,
        int(inside.sum()),
        int((cut & ~loop & ~inside).sum()),
        options.tokens_per_s,
        ["rows were cut inside the window but none honestly (all runaways): nothing to extrapolate"] if no_tail else [],
        percentile(p, 0.5) if len(length) else 0,
        int((room == 0).sum()),
        int(length[room == 0].sum()),
    )


@dataclass(frozen=True)
class _Scaled:
    """An estimate's figures scaled to the options' prompt count, with hours at their tok/s and servers."""

    options: PlanOptions
    rows: int

    def __call__(self, label: str, cap: int | None, decoded: float, trained: float, modelled: bool) -> TrainedEstimate:
        scale = (self.options.prompts or self.rows) / self.rows if self.rows else 1.0
        decoded, trained = decoded * scale, trained * scale
        tok_s, servers = self.options.tokens_per_s, self.options.servers
        hours = decoded / tok_s / 3600 if tok_s else None
        gpu_hours = hours * servers if hours is not None and servers else None
        return TrainedEstimate(label, cap, decoded, trained, "model" if modelled else "rows", hours, gpu_hours)


def _window_policy(p, length, cut, loop, room, largest: int, overshoot: int, fit: TailFit | None):
    """(decoded, trained, modelled) under the window policy: each prompt that does not fill the window asks
    min(largest cap, room + overshoot); runaways are decoded and left out."""
    fits = room > 0
    ask = np.minimum(room + overshoot, largest)
    short = cut & ~loop & (length < ask)  # cut below what the window policy asks: the tail
    inside = cut & ~loop & (length < room)
    dec = np.where(
        short,
        length + _tail_mean(fit, length.astype(float), ask.astype(float)),
        np.where(cut & loop, ask, np.minimum(length, ask)),
    ).astype(float)
    tr = np.where(
        inside, length + _tail_mean(fit, length.astype(float), room.astype(float)), np.minimum(length, room)
    ).astype(float)
    return float(dec[fits].sum()), float(tr[fits & ~loop].sum()), bool(short.any())


def window_plan(
    data_dir: str | Path,
    config_hash: str | None,
    cap: int,
    trainer: TrainerSettings = TrainerSettings(),
    fit: TailFit | None = None,
    runaway: RunawaySettings = RunawaySettings(),
    **kwargs,
) -> WindowPlan:
    """plan_window over one config's committed rows, with what all_turns costs against last_turn."""
    with open_quality_db(data_dir, config_hash=config_hash, runaway=runaway, max_length=trainer.max_length) as con:
        rows = con.execute(  # a cut the window policy sized is final: at any cap, what a row that stopped there is
            "SELECT prompt_tokens, completion_tokens, finish_reason = 'length' AND NOT window_sized AS cut, runaway "
            "FROM completions WHERE finish_reason IN ('stop', 'length') AND completion_tokens IS NOT "
            "NULL AND prompt_tokens IS NOT NULL"
        ).fetchnumpy()
        con.register("multi_turn", _multi_turn(con, data_dir))
        cost = turns_cost(con, options := PlanOptions(**kwargs))
    lengths = Lengths(rows["completion_tokens"], rows["cut"], cap, rows["prompt_tokens"], rows["runaway"])
    return replace(plan_window(lengths, trainer.max_length, options, fit), turns=cost)


# two turns need two messages of role user or tool: only the conversations that may have them are parsed
MAYBE_TURNS = """
SELECT prompt_id, messages_json FROM {prompts}
WHERE shard IN (SELECT shard FROM completions) AND regexp_matches(messages_json, '(?s)"(?:user|tool)".*"(?:user|tool)"')
"""


def _multi_turn(con: duckdb.DuckDBPyConnection, data_dir: str | Path) -> pa.Table:
    """(prompt_id, user_turns) of the prompts of the shards in scope with more than one user turn, from the prompt
    shards' messages."""
    ids, turns = [], []
    maybe = con.execute(MAYBE_TURNS.format(prompts=parquet_source(con, data_dir, "prompt_shards", PROMPT_SCHEMA)))
    while batch := maybe.fetchmany(4096):
        for prompt_id, conversation in batch:
            if (n := len(split_turns(json.loads(conversation))[1])) > 1:
                ids.append(prompt_id)
                turns.append(n)
    return pa.table({"prompt_id": pa.array(ids, pa.string()), "user_turns": pa.array(turns, pa.int64())})


def window_plan_lines(plan: WindowPlan, command: str = "") -> list[str]:
    """The plan for people: a line per cap and for the window policy, the raising sentence, the recommendation."""

    def row(e: TrainedEstimate) -> str:
        ratio = f"{e.per_trained:.2f}x" if e.per_trained else "∞"
        hours = (
            f", {e.gpu_hours:,.1f} GPU-h"
            if e.gpu_hours is not None
            else f", {e.hours:,.1f} h"
            if e.hours is not None
            else ""
        )
        return (
            f"{e.label}: {num(round(e.decoded))} decoded, {num(round(e.trained))} trained, {ratio} decoded per "
            f"trained{hours}{' (model)' if e.basis == 'model' else ''}"
        )

    lines = [
        f"trained tokens, for {TrainerSettings(max_length=plan.max_length).named()} (floor: every prompt's "
        f"first {num(plan.max_length)} tokens = {num(round(plan.floor))}):"
    ]
    lines += [f"  {row(e)}" for e in plan.estimates] + [f"  {row(plan.window)}"]
    if plan.filling:
        lines.append(
            f"  prompts that fill the window: {num(plan.filling)}, their {num(plan.filling_decoded)} decoded tokens "
            f"counted decoded, none trained (the window policy rejects such prompts before any request)"
        )
    caps = [e.cap for e in plan.estimates if e.cap is not None]  # all of them: only the window policy has none
    if len(caps) > 1:  # the usual bump: to twice the cap when it is a candidate
        to = 2 * plan.cap if 2 * plan.cap in caps else caps[1]
        lines.append("  " + plan.raising(plan.cap, to))
    if plan.turns is not None:
        lines.append("  " + plan.turns.line())
    if plan.cut_inside_window == 0:
        lines.append(
            f"  every cut row lies at or past the window: window-complete, so a larger cap adds no trained "
            f"token; the window policy decodes {plan.window.per_trained or 0:.2f}x per trained token"
            + (f": {command}" if command else "")
        )
    elif plan.recommended.cap is not None:
        lines.append(
            f"  recommended: cap {num(plan.recommended.cap)}, the smallest that lets every prompt reach the "
            f"window (a larger one adds only tokens past it), or the window policy"
            + (f": {command}" if command else "")
        )
    return lines
