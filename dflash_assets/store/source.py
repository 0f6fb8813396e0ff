"""Which prompt source a data dir belongs to: each prompt shard's file records, in its Parquet metadata (committed with
its prompts), the source's path, the shard size, its line count and a fingerprint of those lines
(generation/prompts.py shard_fingerprint); generation/shards.py source_refusal compares a source with it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import COMPLETION_SCHEMA
from dflash_assets.store.storage import Storage, open_storage

SOURCE_KEY = b"dflash.source"


@dataclass(frozen=True)
class ShardSource:
    """What one prompt shard was cut from: lines [index * shard_size, + lines) of `path`, with their fingerprint."""

    path: str
    shard_size: int
    lines: int
    fingerprint: str

    def metadata(self) -> dict[bytes, bytes]:
        return {SOURCE_KEY: json.dumps(asdict(self), sort_keys=True).encode()}


def recorded_sources(data_dir: str | Path | Storage) -> dict[str, ShardSource]:
    """shard -> the source its prompt shard records (shards written before the record existed are left out)."""
    storage = open_storage(data_dir)
    root = storage.root / "prompt_shards"
    found = {}
    for path in storage.walk(root):
        if path.name == "prompts.parquet" and path.parent.name.startswith("shard="):
            meta = storage.read_schema(path).metadata or {}
            if SOURCE_KEY in meta:
                found[path.parent.name.removeprefix("shard=")] = ShardSource(**json.loads(meta[SOURCE_KEY]))
    return dict(sorted(found.items()))


def has_completions(data_dir: str | Path | Storage, shard: str) -> bool:
    """Whether the shard holds a committed completion part (of any config)."""
    return bool(PartStore(data_dir, "completions", shard, COMPLETION_SCHEMA).parts())
