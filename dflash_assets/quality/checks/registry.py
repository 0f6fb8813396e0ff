"""The check registry the Dagster layer iterates over, and the one entry point that runs them all."""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import duckdb

from dflash_assets.quality.checks.accounting import WRITE_ORDER, accounting
from dflash_assets.quality.checks.content import empty_content, reasoning_misrouted, think_markers, truncated_thinking
from dflash_assets.quality.checks.context import context_overflow
from dflash_assets.quality.checks.integrity import config_consistency, duplicates
from dflash_assets.quality.checks.lengths import (
    cap_hit_agreement,
    cap_saturation,
    decoded_past_window,
    max_length_overflow,
    silent_clamp,
    truncation_rate,
)
from dflash_assets.quality.checks.runaway import runaway_rate
from dflash_assets.quality.checks.tools import tool_calls
from dflash_assets.quality.outcome import CheckOutcome, Finding, Severity
from dflash_assets.quality.tables import open_quality_db
from dflash_assets.settings import QualitySettings

CheckFn = Callable[[duckdb.DuckDBPyConnection, QualitySettings], Finding]


@dataclass(frozen=True)
class CheckSpec:
    """One check. `blocking` marks the training gate: drafter training waits until every blocking check passes."""

    name: str
    fn: CheckFn
    description: str
    blocking: bool
    default_severity: Severity

    def run(self, con: duckdb.DuckDBPyConnection, quality: QualitySettings = QualitySettings()) -> CheckOutcome:
        """Run over a connection from open_quality_db; the severity is the thresholds' override or the default."""
        found = self.fn(con, quality)
        # QualitySettings checked the overrides' values: each is a Severity
        severity = cast(Severity, quality.severity.get(self.name, self.default_severity))
        return CheckOutcome(self.name, found.passed, severity, found.summary_md, found.metadata, self.blocking)


def _spec(fn: CheckFn, blocking: bool, severity: Severity | None = None) -> CheckSpec:
    description = " ".join((fn.__doc__ or "").split("\n\n")[0].split())
    return CheckSpec(fn.__name__, fn, description, blocking, severity or ("ERROR" if blocking else "WARN"))


CHECKS: list[CheckSpec] = [
    _spec(truncation_rate, blocking=True),
    _spec(decoded_past_window, blocking=False),
    _spec(cap_saturation, blocking=False),
    _spec(cap_hit_agreement, blocking=False),
    _spec(silent_clamp, blocking=True),
    _spec(context_overflow, blocking=True),
    _spec(config_consistency, blocking=False),
    _spec(accounting, blocking=True),
    _spec(duplicates, blocking=True),
    _spec(empty_content, blocking=True),
    _spec(think_markers, blocking=True),
    _spec(reasoning_misrouted, blocking=False),
    _spec(truncated_thinking, blocking=False),
    _spec(max_length_overflow, blocking=False),
    _spec(runaway_rate, blocking=False),
    _spec(tool_calls, blocking=False),
]
CHECKS_BY_NAME = {spec.name: spec for spec in CHECKS}


def run_checks(
    data_dir: str | Path,
    shard: str | None = None,
    config_hash: str | None = None,
    quality: QualitySettings = QualitySettings(),
    names: Iterable[str] | None = None,
) -> list[CheckOutcome]:
    """Run every check (or those in `names`, in registry order) over one scan of the data dir."""
    wanted = set(CHECKS_BY_NAME) if names is None else set(names)
    unknown = (wanted | set(quality.severity)) - set(CHECKS_BY_NAME)
    if unknown:
        raise ValueError(f"unknown check names {sorted(unknown)}; the checks are {list(CHECKS_BY_NAME)}")
    if not wanted:  # no check asked for (a run none of whose checks stopped it): no scan
        return []
    with open_quality_db(data_dir, shard, config_hash, quality.runaway, quality.trainer.max_length) as con:
        return [spec.run(con, quality) for spec in CHECKS if spec.name in wanted]


@dataclass(frozen=True)
class ConfigVerdict:
    """One config's outcomes, judged as the run's own config. `superseded`: incomplete while a newer config was
    written; reported apart, it never fails a check result of the run (it still fails its own export)."""

    config_hash: str | None
    outcomes: list[CheckOutcome]
    superseded: bool = False


def judge_each_config(
    data_dir: str | Path,
    shard: str | None = None,
    quality: QualitySettings = QualitySettings(),
    names: Iterable[str] | None = None,
) -> list[ConfigVerdict]:
    """What a run with no config of its own (a checks-only run) judges: every config of the scope on its own, in
    the order written. The configs the newest one's accounting calls superseded are marked so. A scope without a
    config (nothing generated yet) is judged once, as run_checks does it."""
    with open_quality_db(data_dir, shard) as con:
        order = [h for (h,) in con.execute(WRITE_ORDER).fetchall()]
    if not order:
        return [ConfigVerdict(None, run_checks(data_dir, shard, None, quality, names))]
    verdicts = {h: run_checks(data_dir, shard, h, quality, names) for h in order}
    newest = next((o for o in verdicts[order[-1]] if o.name == "accounting"), None)
    if newest is None:
        (newest,) = run_checks(data_dir, shard, order[-1], quality, ["accounting"])
    superseded = set(str(newest.metadata["superseded"]).split(", "))
    return [ConfigVerdict(h, verdicts[h], h in superseded) for h in order]


def gate_passed(outcomes: Iterable[CheckOutcome]) -> bool:
    """True when every blocking check passed: the rows may go on to drafter training."""
    return all(o.passed for o in outcomes if o.blocking)
