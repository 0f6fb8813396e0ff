"""The shard partitions follow the prompt source: shard_partitions_sensor adds a key per shard_size lines and removes
the keys past the source's end that the data dir has no completions for."""

import json

import dagster as dg

from dflash_assets.defs.partitions import shard_partitions
from dflash_assets.defs.prompts.sensors import shard_partitions_sensor
from dflash_assets.defs.resources import DataDirResource, PromptSourceResource
from tests.support import dagster_run
from tests.support.quality_data import CONFIG_A, completion, prompt, write


def test_the_partitions_follow_the_source_and_keep_a_shard_with_completions(tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"q {i}"}) + "\n" for i in range(5)))  # shards 00000, 00001
    write(tmp_path / "data", "completions", "00003", [completion(prompt("00003", 0, 10, "x"), CONFIG_A, 5)])
    resources = {
        "prompt_source": PromptSourceResource(path=str(source), shard_size=3),
        "data_dir": DataDirResource(path=str(tmp_path / "data")),
    }
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000", "00002", "00003"])  # another source's
        with dg.build_sensor_context(instance=instance, resources=resources) as context:
            result = shard_partitions_sensor(context)
    add, delete = result.dynamic_partitions_requests
    assert isinstance(add, dg.AddDynamicPartitionsRequest) and list(add.partition_keys) == ["00001"]
    # 00002 is past the end and has no completions: removed; 00003 has completions: kept (a refused source's)
    assert isinstance(delete, dg.DeleteDynamicPartitionsRequest) and list(delete.partition_keys) == ["00002"]


def test_a_source_the_data_dir_does_not_belong_to_adds_no_partition_to_the_instance(tmp_path):
    from dflash_assets.store.source import ShardSource
    from dflash_assets.store.stores import prompt_store

    mine, other = tmp_path / "mine.jsonl", tmp_path / "other.jsonl"
    for path in (mine, other):
        path.write_text("".join(json.dumps({"prompt": f"{path.stem} {i}"}) + "\n" for i in range(7)))
    record = ShardSource(str(mine.resolve()), 3, 3, "f")  # the data dir's shards were cut from mine.jsonl
    prompt_store(tmp_path / "data", "00000").replace(
        [prompt("00000", 0, 10, "x")], "prompts.parquet", record.metadata()
    )
    resources = {
        "prompt_source": PromptSourceResource(path=str(other), shard_size=3),
        "data_dir": DataDirResource(path=str(tmp_path / "data")),
    }
    with dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, ["00000"])
        with dg.build_sensor_context(instance=instance, resources=resources) as context:
            result = shard_partitions_sensor(context)
        assert instance.get_dynamic_partitions(shard_partitions.name) == ["00000"]
    assert not result.dynamic_partitions_requests
    assert result.skip_reason and f"holds the prompt shards of {mine.resolve()}, not of {other.resolve()}" in str(
        result.skip_reason
    )
