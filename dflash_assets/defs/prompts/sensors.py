"""shard_partitions_sensor: keep the shard partitions in step with the prompt source."""

import dagster as dg

from dflash_assets.defs.partitions import SHARDS, shard_partitions
from dflash_assets.defs.resources import PromptSourceResource
from dflash_assets.generation.prompts import SourceError, shard_keys


def missing_shards(instance: dg.DagsterInstance, prompt_source: PromptSourceResource) -> list[str]:
    keys = shard_keys(prompt_source.resolved(), prompt_source.shard_size)
    existing = set(instance.get_dynamic_partitions(SHARDS))
    return [k for k in keys if k not in existing]


@dg.sensor(
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds a shard partition for every `shard_size` lines of the prompt source, so a grown "
    "source shows its new shards in the UI, ready to materialise or backfill.",
)
def shard_partitions_sensor(
    context: dg.SensorEvaluationContext, prompt_source: PromptSourceResource
) -> dg.SensorResult:
    try:
        new = missing_shards(context.instance, prompt_source)
    except SourceError as e:
        return dg.SensorResult(skip_reason=str(e))
    if not new:
        return dg.SensorResult(skip_reason="every shard of the prompt source has a partition")
    return dg.SensorResult(dynamic_partitions_requests=[shard_partitions.build_add_request(new)])
