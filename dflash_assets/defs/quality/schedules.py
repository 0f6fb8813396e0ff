"""quality_checks_schedule: the quality checks on a clock, over every materialised shard.

A schedule's cron is part of its definition, which Dagster fixes when the code location loads (it takes no
EnvVar): settings.Deployment reads DFLASH_CHECKS_CRON then.
"""

import dagster as dg

from dflash_assets.defs.quality.jobs import quality_checks_job
from dflash_assets.settings import Deployment

quality_checks_schedule = dg.ScheduleDefinition(
    name="quality_checks_schedule",
    job=quality_checks_job,
    cron_schedule=Deployment.CHECKS_CRON.value(),
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Runs the check suite over all materialised shards and refreshes the summary (hourly unless "
    "DFLASH_CHECKS_CRON says otherwise). Switch it off in the UI under Automation.",
)
