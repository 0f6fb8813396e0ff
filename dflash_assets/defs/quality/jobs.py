"""quality_checks: the check suite over every materialised shard, and the summary report."""

import dagster as dg

from dflash_assets.defs.quality.assets import length_quality_report, length_quality_summary

quality_checks_job = dg.define_asset_job(
    "quality_checks",
    selection=dg.AssetSelection.checks_for_assets(length_quality_report)
    | dg.AssetSelection.assets(length_quality_summary),
    description="The check suite over every materialised shard (a run with no partition checks them all) and "
    "the summary report. Materialises no completions.",
)
