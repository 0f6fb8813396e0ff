"""Which data a Dagster instance works on, resolved in one place for the commands and the definitions.

A data dir comes from `DFLASH_DATA_DIR` (`--data-dir`), else from `$DAGSTER_HOME/dflash-data.json`, where a demo or
backfill records the data dir it generates into; its prompt source from `DFLASH_PROMPTS` (`--prompts`), else from the
data dir's shards (store/source.py). So `DAGSTER_HOME=H dg dev` opens the data the commands ran on H, never the
defaults'.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dflash_assets.settings import Deployment
from dflash_assets.store.source import ShardSource, recorded_sources
from dflash_assets.store.storage import is_uri

INSTANCE_RECORD = "dflash-data.json"  # in DAGSTER_HOME: {"data_dir": ...}


@dataclass(frozen=True)
class DataInUse:
    """The data dir, its prompt source and shard size, and what gave the source (for the one line a bad one gets)."""

    data_dir: str
    prompts: str
    prompts_from: str
    shard_size: str

    def environment(self) -> dict[str, str]:
        return {
            Deployment.DATA_DIR.name: self.data_dir,
            Deployment.PROMPTS.name: self.prompts,
            Deployment.SHARD_SIZE.name: self.shard_size,
        }


def data_in_use(environ: Mapping[str, str] = os.environ) -> DataInUse:
    """Each setting from the environment first, then from the instance's record (the data dir) or the data dir's
    (its source and shard size: only when that source is the one in use), then the default."""
    data_dir, _ = _first(
        (environ.get(Deployment.DATA_DIR.name), Deployment.DATA_DIR.name),
        (_instance_data_dir(environ.get("DAGSTER_HOME")), f"the instance's {INSTANCE_RECORD}"),
        (Deployment.DATA_DIR.default, "the default"),
    )
    recorded = _recorded_source(data_dir)
    prompts, prompts_from = _first(
        (environ.get(Deployment.PROMPTS.name), Deployment.PROMPTS.name),
        (recorded.path if recorded else None, "the data dir's source record"),
        (Deployment.PROMPTS.default, "the default"),
    )
    same_source = recorded is not None and recorded.path == _absolute(prompts)
    shard_size, _ = _first(
        (environ.get(Deployment.SHARD_SIZE.name), Deployment.SHARD_SIZE.name),
        (str(recorded.shard_size) if recorded and same_source else None, "the data dir's source record"),
        (Deployment.SHARD_SIZE.default, "the default"),
    )
    return DataInUse(data_dir, prompts, prompts_from, shard_size)


def remember_data_dir(home: Path, data_dir: str) -> None:
    """Record in the instance the data dir a command works on (a local one as an absolute path), atomically."""
    record = home / INSTANCE_RECORD
    value = _absolute(data_dir)
    if _instance_data_dir(str(home)) == value:
        return
    partial = record.with_suffix(".partial")
    partial.write_text(json.dumps({"data_dir": value}) + "\n")
    partial.replace(record)


def _first(*candidates: tuple[str | None, str]) -> tuple[str, str]:
    return next((value, said_by) for value, said_by in candidates if value)


def _absolute(path: str) -> str:
    return path if is_uri(path) else str(Path(path).resolve())


def _instance_data_dir(home: str | None) -> str | None:
    if not home:
        return None
    try:
        return json.loads((Path(home) / INSTANCE_RECORD).read_text()).get("data_dir") or None
    except (OSError, ValueError):
        return None  # none yet, or unreadable: the next command rewrites it


def _recorded_source(data_dir: str) -> ShardSource | None:
    """The prompt source a data dir's shards record (the first shard's: generation/shards.py refuses a data dir
    whose shards disagree), or None for a new or unreachable data dir."""
    try:
        return next(iter(recorded_sources(data_dir).values()), None)
    except OSError:
        return None
