"""completions_landed_sensor: the check suite as soon as new completions land."""

import dagster as dg

from dflash_assets.defs.completions.assets import completions
from dflash_assets.defs.quality.jobs import quality_checks_job


@dg.asset_sensor(
    asset_key=completions.key,
    job=quality_checks_job,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="When new completions land, runs the check suite over all shards and refreshes the "
    "summary report, so a bad shard shows on the dashboard without waiting for the hour.",
)
def completions_landed_sensor(context: dg.SensorEvaluationContext, asset_event: dg.EventLogEntry):
    materialization = asset_event.asset_materialization
    yield dg.RunRequest(
        run_key=f"{asset_event.run_id}:{asset_event.timestamp}",
        tags={
            "dflash/trigger": f"completions {(materialization.partition if materialization else None) or ''}".strip()
        },
    )
