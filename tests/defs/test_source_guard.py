"""An instance never gains another source's partitions nor a report of another source's data: the partitions
sensor, the checks schedule and the completions sensor skip, with the one-line reason, when the definitions' prompt
source is not the one their data dir belongs to (defs/resources.py refusal)."""

import json

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_assets.definitions import defs
from dflash_assets.defs.completions.assets import completions
from dflash_assets.defs.prompts.sensors import shard_partitions_sensor
from dflash_assets.defs.quality.schedules import quality_checks_schedule
from dflash_assets.defs.quality.sensors import completions_landed_sensor
from dflash_assets.defs.resources import DataDirResource, PromptSourceResource
from dflash_assets.store.source import ShardSource

SHARD_SIZE = 3


@pytest.fixture
def mine_data_dir(tmp_path):
    """A data dir whose prompt shard records mine.jsonl (cut at 3), as generation writes it; and the two sources."""
    mine, other = tmp_path / "mine.jsonl", tmp_path / "other.jsonl"
    for path, word in ((mine, "why"), (other, "how")):
        path.write_text("".join(json.dumps({"prompt": f"{word} {i}?"}) + "\n" for i in range(SHARD_SIZE)))
    shard = tmp_path / "data" / "prompt_shards" / "shard=00000"
    shard.mkdir(parents=True)
    record = ShardSource(str(mine), SHARD_SIZE, lines=SHARD_SIZE, fingerprint="f").metadata()
    pq.write_table(pa.table({"prompt_id": ["a"]}).replace_schema_metadata(record), shard / "prompts.parquet")
    return tmp_path / "data", mine, other


def resources(data_dir, source) -> dict:
    return {
        "prompt_source": PromptSourceResource(path=str(source), shard_size=SHARD_SIZE),
        "data_dir": DataDirResource(path=str(data_dir)),
    }


def completions_event(instance: dg.DagsterInstance) -> None:
    instance.report_runless_asset_event(dg.AssetMaterialization(completions.key, partition="00000"))


def test_another_source_adds_no_partition_and_schedules_no_report(mine_data_dir):
    data_dir, mine, other = mine_data_dir
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("shards", ["00000"])
        completions_event(instance)
        res = resources(data_dir, other)
        added = shard_partitions_sensor(dg.build_sensor_context(instance=instance, resources=res))
        scheduled = quality_checks_schedule.evaluate_tick(dg.build_schedule_context(instance, resources=res))
        landed = completions_landed_sensor.evaluate_tick(
            dg.build_sensor_context(instance=instance, resources=res, definitions=defs)
        )
        said = f"data dir {data_dir} holds the prompt shards of {mine}, not of {other}"
        assert added.dynamic_partitions_requests == [] and added.skip_reason.skip_message.startswith(said)
        assert scheduled.run_requests == [] and scheduled.skip_message.startswith(said)
        assert landed.run_requests == [] and landed.skip_message.startswith(said)
        assert instance.get_dynamic_partitions("shards") == ["00000"]


def test_its_own_source_schedules_the_checks_and_a_landing_starts_them(mine_data_dir):
    data_dir, mine, _ = mine_data_dir
    with dg.instance_for_test() as instance:
        completions_event(instance)
        res = resources(data_dir, mine)
        scheduled = quality_checks_schedule.evaluate_tick(dg.build_schedule_context(instance, resources=res))
        landed = completions_landed_sensor.evaluate_tick(
            dg.build_sensor_context(instance=instance, resources=res, definitions=defs)
        )
        assert len(scheduled.run_requests) == 1 and len(landed.run_requests) == 1
