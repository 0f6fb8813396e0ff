"""What the probe tests share: a project (prompt shards built on an emulator, in an in-memory Dagster instance), and
completions and probes written straight to a data dir."""

from contextlib import contextmanager
from datetime import UTC
from pathlib import Path

import dagster as dg

from dflash_assets.defs.prompts.assets import prompt_shards
from tests.support import dagster_run
from tests.support.dagster_run import resources
from tests.support.forks import start_emulator
from tests.support.shards import write_prompts


@contextmanager
def probe_project(tmp: Path, flags: list[str], shards: list[str], per_shard: int):
    """(instance, resources) with `shards` of `per_shard` prompts (sources "math" and "chat") materialised."""
    write_prompts(
        tmp / "prompts.jsonl",
        (
            {
                "id": f"q{i:04d}",
                "prompt": f"Question {i}: explain topic {i * 7 % 31}.",
                "source": "math" if i % 3 == 0 else "chat",
            }
            for i in range(len(shards) * per_shard)
        ),
    )
    with start_emulator(flags) as emu, dagster_run.instance() as instance:
        instance.add_dynamic_partitions("shards", shards)
        res = resources(tmp, emu.url, per_shard)
        for shard in shards:
            assert dg.materialize([prompt_shards], partition_key=shard, instance=instance, resources=res).success
        yield instance, res


def write_completions(data_dir, shard: str, config_hash: str, lengths, cap: int, temperature: float = 0.6, **sampling):
    from datetime import datetime

    from dflash_assets.store.stores import completion_store

    now = datetime.now(UTC)
    completion_store(data_dir, shard).commit(
        [
            {
                "prompt_id": f"p{i}",
                "shard": shard,
                "source": "t",
                "config_hash": config_hash,
                "finish_reason": "length" if n > cap else "stop",
                "prompt_tokens": 50,
                "completion_tokens": min(n, cap),
                "reasoning_tokens": 0,
                "max_output_tokens": cap,
                "server_context_length": 32768,
                "server_url": "u",
                "model": "m",
                "temperature": temperature,
                "top_p": 0.95,
                "top_k": 20,
                "enable_thinking": True,
                **sampling,
                "content": "x",
                "reasoning_content": None,
                "latency_s": 1.0,
                "attempt": 1,
                "created_at": now,
            }
            for i, n in enumerate(lengths)
        ]
    )


def write_probe(data_dir, config_hash: str, lengths, sample: int, temperature: float = 0.6, **sampling):
    from dflash_assets.generation.probe import PROBE_SHARD, probe_root
    from dflash_assets.store.stores import prompt_store

    root = probe_root(data_dir)
    write_completions(root, PROBE_SHARD, config_hash, lengths, 32000, temperature, **sampling)
    prompt_store(root, PROBE_SHARD).replace(
        [
            {
                "prompt_id": f"p{i}",
                "shard": PROBE_SHARD,
                "line": i + 1,
                "source": "t",
                "messages_json": "[]",
                "prompt_tokens": 50,
                "template_kwargs_json": "{}",
            }
            for i in range(sample)
        ],
        "prompts.parquet",
    )
