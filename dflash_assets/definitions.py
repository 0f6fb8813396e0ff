"""The one `defs`: assets, checks, jobs, schedules, sensors and resources of dflash-assets."""

import dagster as dg

from dflash_assets.defs import jobs
from dflash_assets.defs.completions import assets as completion_assets
from dflash_assets.defs.completions import checks as completion_checks
from dflash_assets.defs.continuation import assets as continuation_assets
from dflash_assets.defs.probe import assets as probe_assets
from dflash_assets.defs.prompts import assets as prompt_assets
from dflash_assets.defs.quality import assets as quality_assets
from dflash_assets.defs.resources import from_env
from dflash_assets.defs.schedules import quality_checks_schedule
from dflash_assets.defs.sensors import completions_landed_sensor, dead_runs_sensor, shard_partitions_sensor
from dflash_assets.defs.training import assets as training_assets

defs = dg.Definitions(
    assets=dg.load_assets_from_modules([prompt_assets, completion_assets, continuation_assets, quality_assets,
                                             training_assets, probe_assets]),
    asset_checks=dg.load_asset_checks_from_modules([completion_checks]),
    jobs=[jobs.shard_pipeline_job, jobs.quality_checks_job, jobs.training_job, jobs.continue_job],
    schedules=[quality_checks_schedule],
    sensors=[shard_partitions_sensor, completions_landed_sensor, dead_runs_sensor],
    resources=from_env(),
    # A run's steps follow one another (shards -> completions -> checks -> report) and are thin HTTP and
    # DuckDB work: one process per run, instead of a ~10 s process start per step on a small host.
    executor=dg.in_process_executor,
)
