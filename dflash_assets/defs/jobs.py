"""Jobs: the whole shard pipeline, partitioned by shard."""

import dagster as dg

shard_pipeline_job = dg.define_asset_job(
    "shard_pipeline",
    selection=dg.AssetSelection.groups("generation", "quality"),
    description="prompt_shards -> completions -> length_quality_report with the checks, for one shard.",
)
