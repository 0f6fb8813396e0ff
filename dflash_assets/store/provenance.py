"""The provenance of each config of a data dir: what the fleet said it served when the config was written.

One small Parquet file per config, `provenance/<config_hash>.parquet` (written atomically, like a part): the SGLang
version, model path, revision as launched, weight version, `--chat-template` and the template's fingerprint, and
`in_hash`: whether they are part of the config's hash. A config written before provenance was recorded keeps its hash
(in_hash false): its first run since records the fleet it ran on, and every later run must match it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path, PurePath

import pyarrow as pa

from dflash_assets.store.storage import Storage, open_storage

FOLDER = "provenance"
PROVENANCE_SCHEMA = pa.schema(
    [
        ("config_hash", pa.string()),
        ("in_hash", pa.bool_()),
        ("sglang_version", pa.string()),
        ("model_path", pa.string()),
        ("revision", pa.string()),
        ("weight_version", pa.string()),
        ("chat_template", pa.string()),
        ("template_fingerprint", pa.string()),
        ("recorded_at", pa.timestamp("us", tz="UTC")),
    ]
)
FIELDS = [f.name for f in PROVENANCE_SCHEMA if f.name not in ("config_hash", "in_hash", "recorded_at")]


def _path(storage: Storage, config_hash: str) -> PurePath:
    return storage.root / FOLDER / f"{config_hash}.parquet"


def recorded(data_dir: str | Path | Storage, config_hash: str) -> dict | None:
    """The config's recorded provenance (its FIELDS and `in_hash`), or None when none was recorded."""
    storage = open_storage(data_dir)
    path = _path(storage, config_hash)
    if not storage.exists(path):
        return None
    row = storage.read_table(path).to_pylist()[0]
    return {k: row[k] for k in (*FIELDS, "in_hash")}


def hashed(data_dir: str | Path | Storage, config_hash: str) -> dict | None:
    """The provenance the config's hash covers (None: none, a config written before provenance was recorded)."""
    was = recorded(data_dir, config_hash)
    return {k: was[k] for k in FIELDS} if was is not None and was["in_hash"] else None


def record(data_dir: str | Path | Storage, config_hash: str, provenance: dict, in_hash: bool) -> None:
    """Record what the fleet said for a config (the same content whoever writes it: writers may race)."""
    storage = open_storage(data_dir)
    row = {
        "config_hash": config_hash,
        "in_hash": in_hash,
        **{k: provenance.get(k) for k in FIELDS},
        "recorded_at": datetime.now(UTC),
    }
    storage.write_table(pa.Table.from_pylist([row], schema=PROVENANCE_SCHEMA), _path(storage, config_hash))
