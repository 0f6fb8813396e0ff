"""The cap plan for people: the table, the glance and the by-turn view as Markdown (the UI's metadata and the
summary), with token counts and times in the units that show them."""

from __future__ import annotations

import math

from dflash_assets.quality.outcome import num, pct
from dflash_assets.quality.planning.estimate import CapEstimate, CapPlan, Estimate
from dflash_assets.quality.planning.probe_estimates import precision_text, probe_label


def tokens_text(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def hours_text(h: float) -> str:
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
        time_ = f"{_span(e.hours, hours_text)} | " if e.hours else ""
        fits = (
            "-"
            if e.prompts_over_context is None  # None with fits_context
            else "yes"
            if e.fits_context
            else f"no: {num(e.prompts_over_context)} rows over"
        )
        lines.append(
            f"| {label} | {_span(e.truncation_rate, pct)} | {_span(e.runaway_rate, pct)} | {basis} | "
            f"{_span(e.output_tokens, tokens_text)} | {time_}{e.output_tokens.value / now:.2f}× | {_needed(e)} "
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
