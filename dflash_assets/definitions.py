"""The one `defs`: assets, checks, jobs, schedules, sensors and resources of dflash-assets."""

import dagster as dg

from dflash_assets.defs import jobs
from dflash_assets.defs.completions import assets as completion_assets
from dflash_assets.defs.completions import checks as completion_checks
from dflash_assets.defs.prompts import assets as prompt_assets
from dflash_assets.defs.quality import assets as quality_assets
from dflash_assets.defs.resources import from_env
from dflash_assets.defs.sensors import shard_partitions_sensor

defs = dg.Definitions(
    assets=dg.load_assets_from_modules([prompt_assets, completion_assets, quality_assets]),
    asset_checks=dg.load_asset_checks_from_modules([completion_checks]),
    jobs=[jobs.shard_pipeline_job],
    sensors=[shard_partitions_sensor],
    resources=from_env(),
)
