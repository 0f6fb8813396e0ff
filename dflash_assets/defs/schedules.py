"""Schedules: the quality checks on a clock, over every materialised shard."""

import os

import dagster as dg

from dflash_assets.defs.jobs import quality_checks_job

quality_checks_schedule = dg.ScheduleDefinition(
    name="quality_checks_schedule",
    job=quality_checks_job,
    cron_schedule=os.environ.get("DFLASH_CHECKS_CRON", "0 * * * *"),
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Runs the check suite over all materialised shards and refreshes the summary (hourly unless "
                "DFLASH_CHECKS_CRON says otherwise). Switch it off in the UI under Automation.",
)
