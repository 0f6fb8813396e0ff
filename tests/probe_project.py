"""A project the probe tests share: prompt shards built on an emulator, in a test Dagster instance."""

import json
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

from dflash_assets.defs.prompts.assets import prompt_shards
from dflash_assets.defs.resources import DataDir, FleetResource, PromptSource, QualityThresholds
from dflash_assets.emulator.process import start_emulator


@contextmanager
def probe_project(tmp: Path, flags: list[str], shards: list[str], per_shard: int):
    """(instance, resources) with `shards` of `per_shard` prompts (sources "math" and "chat") materialised."""
    (tmp / "prompts.jsonl").write_text("".join(
        json.dumps({"id": f"q{i:04d}", "prompt": f"Question {i}: explain topic {i * 7 % 31}.",
                    "source": "math" if i % 3 == 0 else "chat"}) + "\n" for i in range(len(shards) * per_shard)))
    with start_emulator(flags) as emu, dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("shards", shards)
        res = {"fleet": FleetResource(mode="attach", urls=emu.url),
               "prompt_source": PromptSource(path=str(tmp / "prompts.jsonl"), shard_size=per_shard),
               "data_dir": DataDir(path=str(tmp / "data")), "quality": QualityThresholds()}
        for shard in shards:
            assert dg.materialize([prompt_shards], partition_key=shard, instance=instance, resources=res).success
        yield instance, res
