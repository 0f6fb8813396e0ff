"""quality_checks_schedule: the quality checks on a clock, over every materialised shard (its cron read at load)."""

import dagster as dg

from dflash_assets.defs.quality.jobs import quality_checks_job
from dflash_assets.defs.resources import DataDirResource, PromptSourceResource, refusal
from dflash_assets.settings import Deployment


@dg.schedule(
    name="quality_checks_schedule",
    job=quality_checks_job,
    cron_schedule=Deployment.CHECKS_CRON.value(),
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Runs the check suite over all materialised shards and refreshes the summary (hourly unless "
    "DFLASH_CHECKS_CRON says otherwise), unless the data dir belongs to another prompt source. Switch it off in "
    "the UI under Automation.",
)
def quality_checks_schedule(
    context: dg.ScheduleEvaluationContext, prompt_source: PromptSourceResource, data_dir: DataDirResource
) -> dg.RunRequest | dg.SkipReason:
    if refused := refusal(prompt_source, data_dir):  # no report of another source's data in this instance
        return dg.SkipReason(refused)
    return dg.RunRequest()
