"""Jobs: the shard pipeline (partitioned), the check suite over every shard, and the training export."""

import dagster as dg

from dflash_assets.defs.quality.assets import length_quality_report

shard_pipeline_job = dg.define_asset_job(
    "shard_pipeline",
    selection=dg.AssetSelection.assets("prompt_shards", "completions", "length_quality_report"),
    description="prompt_shards -> completions -> length_quality_report with the checks, for one shard.",
)

quality_checks_job = dg.define_asset_job(
    "quality_checks",
    selection=dg.AssetSelection.checks_for_assets(length_quality_report) | dg.AssetSelection.assets("length_quality_summary"),
    description="The check suite over every materialised shard (a run with no partition checks them all) and "
                "the summary report. Materialises no completions.",
)

training_job = dg.define_asset_job(
    "training_export",
    selection=dg.AssetSelection.assets("length_quality_summary", "drafter_training_set"),
    description="The summary report and the drafter training set (refused while a blocking check fails).",
)

continue_job = dg.define_asset_job(
    "continue_shards",
    selection=dg.AssetSelection.assets("continued_completions"),
    description="Truncated rows continued to a larger cap from where they stopped (token ids), stopped rows copied: "
                "the unbiased way to raise the cap (`dflash continue --to C`).",
)
