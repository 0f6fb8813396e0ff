"""The quality gate: DuckDB checks, length reports and the training export over the data dir's Parquet tables (no
Dagster import)."""

from dflash_assets.quality.checks.registry import (
    CHECKS,
    CHECKS_BY_NAME,
    CheckSpec,
    ConfigVerdict,
    gate_passed,
    judge_each_config,
    run_checks,
)
from dflash_assets.quality.outcome import CheckOutcome, Finding, Severity
from dflash_assets.quality.report.lengths import PERCENTILE_DEFINITION, length_quality
from dflash_assets.quality.tables import open_quality_db
from dflash_assets.quality.training.export import EXCLUSION_REASONS, TrainingExport, export_training_set

__all__ = [
    "CHECKS",
    "CHECKS_BY_NAME",
    "EXCLUSION_REASONS",
    "PERCENTILE_DEFINITION",
    "CheckOutcome",
    "CheckSpec",
    "ConfigVerdict",
    "Finding",
    "Severity",
    "TrainingExport",
    "export_training_set",
    "gate_passed",
    "judge_each_config",
    "length_quality",
    "open_quality_db",
    "run_checks",
]
