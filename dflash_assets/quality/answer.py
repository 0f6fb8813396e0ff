"""The story's question answered for people: how much is cut at the cap, the length percentiles, what cap to use.

`dflash report` leads with it and `dflash demo` / `dflash backfill` print it when a blocking check stops a run.
Plain figures from the length report and the cap plan; the terminal layout is in console.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_assets.quality.outcome import Thresholds, num, pct
from dflash_assets.quality.planner import CapEstimate, CapPlan, PlanError, plan_caps
from dflash_assets.quality.report import length_quality
from dflash_assets.rules import most_rows_first


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

    @property
    def at_cap(self) -> list[str]:
        """Which of P90 and P99 equal the cap: the tell-tale that the cap, not the prompts, set the lengths."""
        return [name for name, v in (("P90", self.p90), ("P99", self.p99)) if v is not None and v >= self.cap]

    def headline(self) -> list[str]:
        figures = "  ".join(f"{k} {_n(v)}" for k, v in (("P50", self.p50), ("P90", self.p90), ("P99", self.p99),
                                                         ("max", self.max)))
        at_cap = f": {' and '.join(self.at_cap)} {'equal' if len(self.at_cap) > 1 else 'equals'} the cap" \
            if self.at_cap else ""
        return [f"config {self.config_hash}: {pct(self.truncation_rate)} of {num(self.rows)} rows cut at the cap "
                f"of {num(self.cap)}", f"  completion tokens {figures}{at_cap}"]


def _n(v: int | None) -> str:
    return "-" if v is None else num(v)


def recommended_cap(plan: CapPlan, limit: float) -> CapEstimate | None:
    """The smallest candidate cap at or above the current one whose predicted share cut is within `limit`.

    None when no row was cut (the cap is fine) or no candidate gets there (the largest is the best on offer).
    """
    if not plan.truncated or plan.truncated / plan.rows <= limit:
        return None
    larger = [e for e in plan.estimates if e.cap > plan.cap]
    within = [e for e in larger if e.truncation_rate.value <= limit]
    return within[0] if within else (larger[-1] if larger else None)


def cap_answers(data_dir: str | Path, thresholds: Thresholds = Thresholds(),
                config_hash: str | None = None) -> list[CapAnswer]:
    """One answer per config of the data dir (or the one asked for), the most rows first (rules.most_rows_first)."""
    report = length_quality(data_dir, max_length=thresholds.training_max_length, runaway=thresholds.runaway)
    by_hash = {row["config_hash"]: row for row in report["by_config"]}
    order = most_rows_first((h, r["rows"], r["max_output_tokens"]) for h, r in by_hash.items())
    answers = []
    for row in (by_hash[h] for h, _, _ in order):  # the plan's and the export's choice leads
        if config_hash and row["config_hash"] != config_hash:
            continue
        plan, error = None, None
        try:
            plan = plan_caps(data_dir, config_hash=row["config_hash"], bootstrap=100, runaway=thresholds.runaway)
        except PlanError as e:
            error = str(e)
        answers.append(CapAnswer(
            config_hash=row["config_hash"], cap=row["max_output_tokens"], rows=row["rows"],
            truncated=row["truncated_rows"], truncation_rate=row["truncation_rate"], p50=row["p50"],
            p90=row["p90"], p99=row["p99"], max=row["max"], plan=plan, plan_error=error,
            recommended=recommended_cap(plan, thresholds.truncation_rate_max) if plan else None))
    return answers
