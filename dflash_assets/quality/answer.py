"""The story's question answered for people: how much is cut at the cap, the length percentiles, what cap to use.

`dflash report` leads with it and `dflash demo` / `dflash backfill` print it when a blocking check stops a run.
Plain figures from the length report and the cap plan; the terminal layout is in console.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_assets.quality.outcome import num, pct
from dflash_assets.quality.planner import CapEstimate, CapPlan, PlanError, plan_caps
from dflash_assets.quality.report import length_quality
from dflash_assets.quality.window_plan import WindowPlan, window_plan
from dflash_assets.settings import QualitySettings, TrainerSettings
from dflash_assets.store.configs import latest_order


@dataclass(frozen=True)
class CapAnswer:
    """One config: the share cut at its cap, the percentiles of completion tokens, and the plan's advice."""

    config_hash: str
    cap: int
    rows: int
    truncated: int
    truncation_rate: float
    p50: int | None
    p90: int | None
    p99: int | None
    max: int | None
    plan: CapPlan | None
    plan_error: str | None
    recommended: CapEstimate | None  # the smallest candidate cap whose predicted share cut is within the limit
    max_length: int = TrainerSettings().max_length  # the trainer's window the rows are judged against
    cut_inside_window: int = 0  # cut with prompt + completion < max_length: the blocking truncation
    window_complete: int = 0  # cut at or past the window (not runaways): the trainer reads them whole
    window_complete_tokens: int = 0  # their trained tokens
    decoded_tokens: int = 0
    trained_tokens: int = 0
    window_plan: WindowPlan | None = None  # decoded and trained tokens per candidate cap and the window policy

    @property
    def cuts_matter(self) -> bool:
        """Whether any cut row lies inside the window: only those change what the trainer reads."""
        return self.cut_inside_window > 0

    @property
    def at_cap(self) -> list[str]:
        """Which of P90 and P99 equal the cap: the tell-tale that the cap, not the prompts, set the lengths."""
        return [name for name, v in (("P90", self.p90), ("P99", self.p99)) if v is not None and v >= self.cap]

    def headline(self) -> list[str]:
        figures = "  ".join(
            f"{k} {_n(v)}" for k, v in (("P50", self.p50), ("P90", self.p90), ("P99", self.p99), ("max", self.max))
        )
        at_cap = (
            f": {' and '.join(self.at_cap)} {'equal' if len(self.at_cap) > 1 else 'equals'} the cap"
            if self.at_cap
            else ""
        )
        inside, complete = pct(self.cut_inside_window / self.rows), pct(self.window_complete / self.rows)
        ratio = f"{self.decoded_tokens / self.trained_tokens:.2f}" if self.trained_tokens else "-"
        return [
            f"config {self.config_hash}: {pct(self.truncation_rate)} of {num(self.rows)} rows cut at the cap "
            f"of {num(self.cap)}",
            f"  completion tokens {figures}{at_cap}",
            f"  against the trainer's window max_length {num(self.max_length)}: {inside} cut inside it "
            f"({num(self.cut_inside_window)} rows, the blocking share), {complete} window-complete "
            f"({num(self.window_complete)} rows, {num(self.window_complete_tokens)} trained tokens, exported); "
            f"decoded per trained token {ratio}",
        ]


def _n(v: int | None) -> str:
    return "-" if v is None else num(v)


def recommended_cap(
    plan: CapPlan, limit: float, cut_inside_window: int | None = None, ceiling: int | None = None
) -> CapEstimate | None:
    """The smallest candidate cap at or above the current one whose predicted share cut is within `limit`.

    None when no row was cut (the cap is fine), when no row was cut inside the trainer's window (a larger cap
    buys no trained token), or no candidate gets there (the largest is the best on offer). `ceiling`: the cap that
    lets every prompt reach the trainer's window; a larger one only buys tokens past it, so none is recommended.
    """
    cut = plan.truncated if cut_inside_window is None else cut_inside_window
    if not cut or cut / plan.rows <= limit:
        return None
    larger = [e for e in plan.estimates if e.cap > plan.cap and (ceiling is None or e.cap <= ceiling)]
    within = [e for e in larger if e.truncation_rate.value <= limit]
    return within[0] if within else (larger[-1] if larger else None)


def cap_answers(
    data_dir: str | Path, quality: QualitySettings = QualitySettings(), config_hash: str | None = None
) -> list[CapAnswer]:
    """One answer per config of the data dir (or the one asked for), each of its own rows, the latest (the most
    recently written: rules.latest_first) first."""
    report = length_quality(data_dir, max_length=quality.trainer.max_length, runaway=quality.runaway)
    by_hash = {row["config_hash"]: row for row in report["by_config"]}
    answers = []
    for row in (by_hash[h] for h, _ in latest_order(data_dir) if h in by_hash):  # the export's default leads
        if config_hash and row["config_hash"] != config_hash:
            continue
        plan, error, wp = None, None, None
        try:
            plan = plan_caps(data_dir, config_hash=row["config_hash"], bootstrap=100, runaway=quality.runaway)
        except PlanError as e:
            error = str(e)
        if plan is not None:
            wp = window_plan(
                data_dir,
                row["config_hash"],
                plan.cap,
                quality.trainer,
                plan.fit,
                quality.runaway,
                candidates=[e.cap for e in plan.estimates],
            )
        ceiling = wp.recommended.cap if wp is not None and wp.cut_inside_window else None
        answers.append(
            CapAnswer(
                config_hash=row["config_hash"],
                cap=row["config_cap"],
                rows=row["rows"],
                truncated=row["truncated_rows"],
                truncation_rate=row["truncation_rate"],
                p50=row["p50"],
                p90=row["p90"],
                p99=row["p99"],
                max=row["max"],
                plan=plan,
                plan_error=error,
                recommended=recommended_cap(plan, quality.truncation_rate_max, row["cut_inside_window_rows"], ceiling)
                if plan
                else None,
                window_plan=wp,
                max_length=quality.trainer.max_length,
                cut_inside_window=row["cut_inside_window_rows"],
                window_complete=row["window_complete_rows"],
                window_complete_tokens=row["window_complete_tokens"],
                decoded_tokens=row["decoded_tokens"],
                trained_tokens=row["trained_tokens"],
            )
        )
    return answers
