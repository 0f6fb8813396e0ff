"""Sensors: keep the shard partitions in step with the prompt source; fail the runs whose process died."""

import dagster as dg

from dflash_assets.defs.quality.jobs import quality_checks_job
from dflash_assets.defs.partitions import shard_partitions
from dflash_assets.defs.pools import reap_dead_runs
from dflash_assets.defs.resources import PromptSource
from dflash_assets.generation.prompts import SourceError, shard_keys


def missing_shards(instance: dg.DagsterInstance, prompt_source: PromptSource) -> list[str]:
    keys = shard_keys(prompt_source.resolved(), prompt_source.shard_size)
    existing = set(instance.get_dynamic_partitions(shard_partitions.name))
    return [k for k in keys if k not in existing]


@dg.sensor(minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Adds a shard partition for every `shard_size` lines of the prompt source, so a grown "
                       "source shows its new shards in the UI, ready to materialise or backfill.")
def shard_partitions_sensor(context: dg.SensorEvaluationContext, prompt_source: PromptSource) -> dg.SensorResult:
    try:
        new = missing_shards(context.instance, prompt_source)
    except SourceError as e:
        return dg.SensorResult(skip_reason=str(e))
    if not new:
        return dg.SensorResult(skip_reason="every shard of the prompt source has a partition")
    return dg.SensorResult(dynamic_partitions_requests=[shard_partitions.build_add_request(new)])


@dg.asset_sensor(asset_key=dg.AssetKey("completions"), job=quality_checks_job, minimum_interval_seconds=60,
                 default_status=dg.DefaultSensorStatus.RUNNING,
                 description="When new completions land, runs the check suite over all shards and refreshes the "
                             "summary report, so a bad shard shows on the dashboard without waiting for the hour.")
def completions_landed_sensor(context: dg.SensorEvaluationContext, asset_event: dg.EventLogEntry):
    materialization = asset_event.asset_materialization
    yield dg.RunRequest(run_key=f"{asset_event.run_id}:{asset_event.timestamp}",
                        tags={"dflash/trigger": f"completions {materialization.partition or ''}".strip()})


@dg.sensor(minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Fails the runs of this host whose worker process is gone (SIGKILLed, crashed, its machine's "
                       "`dagster dev` killed) and frees every pool slot an ended run still holds, so a dead run never "
                       "blocks the next one (defs/pools.py).")
def dead_runs_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    released = reap_dead_runs(context.instance)
    if not released:
        return dg.SensorResult(skip_reason="no run of this host is dead, no ended run holds a pool slot")
    return dg.SensorResult(skip_reason="freed the slots of " + ", ".join(
        f"run {h.run_id} ({'its process died: failed' if h.dead else 'ended'})" for h in released))
