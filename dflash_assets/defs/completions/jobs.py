"""shard_pipeline: a shard's prompts, its completions and its report with the checks, in one (partitioned) run."""

import dagster as dg

from dflash_assets.defs.completions.assets import completions
from dflash_assets.defs.prompts.assets import prompt_shards
from dflash_assets.defs.quality.assets import length_quality_report

shard_pipeline_job = dg.define_asset_job(
    "shard_pipeline",
    selection=dg.AssetSelection.assets(prompt_shards, completions, length_quality_report),
    description="prompt_shards -> completions -> length_quality_report with the checks, for one shard.",
)
