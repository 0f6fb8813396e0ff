"""completions_landed_sensor: the check suite as soon as new completions land."""

import dagster as dg

from dflash_assets.defs.completions.assets import completions
from dflash_assets.defs.quality.jobs import quality_checks_job
from dflash_assets.defs.resources import DataDirResource, PromptSourceResource, refusal


@dg.asset_sensor(
    asset_key=completions.key,
    job=quality_checks_job,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="When new completions land, runs the check suite over all shards and refreshes the "
    "summary report, so a bad shard shows on the dashboard without waiting for the hour.",
)
def completions_landed_sensor(
    context: dg.SensorEvaluationContext,
    asset_event: dg.EventLogEntry,
    prompt_source: PromptSourceResource,
    data_dir: DataDirResource,
):
    if refused := refusal(prompt_source, data_dir):  # no report of another source's data in this instance
        yield dg.SkipReason(refused)
        return
    materialization = asset_event.asset_materialization
    yield dg.RunRequest(
        run_key=f"{asset_event.run_id}:{asset_event.timestamp}",
        tags={
            "dflash/trigger": f"completions {(materialization.partition if materialization else None) or ''}".strip()
        },
    )
