"""shard_partitions_sensor: keep the shard partitions in step with the prompt source.

A key for every `shard_size` lines of the source, none past its end unless the data dir has completions there
(generation/shards.py source_refusal), so another source on the same DAGSTER_HOME finds its own partitions.
"""

import dagster as dg

from dflash_assets.defs.partitions import SHARDS, shard_partitions
from dflash_assets.defs.resources import DataDirResource, PromptSourceResource, refusal
from dflash_assets.generation.prompts import SourceError, shard_keys
from dflash_assets.store.source import has_completions


def shard_changes(
    instance: dg.DagsterInstance, prompt_source: PromptSourceResource, data_dir: DataDirResource
) -> tuple[list[str], list[str], list[str]]:
    """(the source's shard keys, the keys to add, the keys past its end to remove: those without completions)."""
    keys = shard_keys(prompt_source.resolved(), prompt_source.shard_size)
    existing = instance.get_dynamic_partitions(SHARDS)
    past_end = [k for k in existing if k not in set(keys) and not has_completions(data_dir.resolved(), k)]
    return keys, [k for k in keys if k not in set(existing)], past_end


@dg.sensor(
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Keeps a shard partition for every `shard_size` lines of the prompt source, so a grown source "
    "shows its new shards in the UI, ready to materialise or backfill; a key past the end of the source is "
    "removed unless the data dir has completions for it.",
)
def shard_partitions_sensor(
    context: dg.SensorEvaluationContext, prompt_source: PromptSourceResource, data_dir: DataDirResource
) -> dg.SensorResult:
    # a source the data dir does not belong to never adds its partitions to the instance (store/source.py)
    if refused := refusal(prompt_source, data_dir):
        return dg.SensorResult(skip_reason=refused)
    try:
        _, new, past_end = shard_changes(context.instance, prompt_source, data_dir)
    except SourceError as e:
        return dg.SensorResult(skip_reason=str(e))
    if not new and not past_end:
        return dg.SensorResult(skip_reason="the shard partitions are those of the prompt source")
    requests: list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest] = (
        [shard_partitions.build_add_request(new)] if new else []
    )
    requests += [shard_partitions.build_delete_request(past_end)] if past_end else []
    return dg.SensorResult(dynamic_partitions_requests=requests)
