"""Parquet tables under the data dir, written so that a crash at any moment leaves them consistent.

The one ledger of "done": a completion exists iff its row is in a committed Parquet part (committed as storage.py
says). A torn temporary file from a crash is ignored and removed. A compacted file names, in its Parquet metadata,
the parts it replaces; they are deleted after it is committed, or on the next start if a crash came between.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePath

import pyarrow as pa

from dflash_assets.store.schema import Row, table_of
from dflash_assets.store.storage import Storage, open_storage, release_memory

COVERS_KEY = b"dflash.covers"


def read_table(
    paths: Iterable[PurePath], columns: list[str] | None, schema: pa.Schema, storage: Storage | None = None
) -> pa.Table:
    storage = storage or open_storage(".")
    tables = [storage.read_table(p, columns=columns) for p in paths]
    if not tables:
        return (schema if columns is None else pa.schema([schema.field(c) for c in columns])).empty_table()
    return pa.concat_tables(tables)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` in `schema`: a part written before a column existed gets it as nulls."""
    columns = [table[f.name] if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


class PartStore:
    """Committed parts of one table for one shard: `<root>/<table>/shard=<key>/*.parquet`."""

    def __init__(self, data_dir: str | Path | Storage, table: str, shard: str, schema: pa.Schema):
        self.storage = open_storage(data_dir)
        self.dir = self.storage.root / table / f"shard={shard}"
        self.schema = schema

    def _files(self) -> list[PurePath]:
        return [p for p in self.storage.files(self.dir) if p.suffix == ".parquet" and not p.name.startswith(".")]

    def recover(self) -> None:
        """Remove torn temporary files and parts that a compacted file already holds."""
        for p in self.storage.files(self.dir):
            if self.storage.is_temporary(p):
                self.storage.delete(p)
        for covered in self._covered():
            self.storage.delete(self.dir / covered)

    def _covered(self) -> set[str]:
        covered: set[str] = set()
        for p in self._files():
            if p.name.startswith("compact-"):
                meta = self.storage.read_schema(p).metadata or {}
                covered.update(json.loads(meta.get(COVERS_KEY, b"[]")))
        return covered

    def parts(self) -> list[PurePath]:
        """The committed files, each row in exactly one of them."""
        covered = self._covered()
        return [p for p in self._files() if p.name not in covered]

    def read(self, columns: list[str] | None = None) -> pa.Table:
        return read_table(self.parts(), columns, self.schema, self.storage)

    def commit(self, rows: Sequence[Row] | Sequence[dict]) -> PurePath | None:
        if not rows:
            return None
        table = table_of(rows, self.schema)
        name = f"part-{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:6]}.parquet"
        return self.storage.write_table(table, self.dir / name)

    def compact(self) -> PurePath | None:
        """Merge all parts into one file, atomically. Returns the new file, or None if nothing to merge."""
        parts = self.parts()
        if len(parts) <= 1:
            return None
        limit = self.storage.max_streamed_bytes
        if limit is not None and sum(self.storage.size(p) for p in parts) > limit:
            return None  # too large to commit in one atomic step there: the parts stay, each row in one of them
        name = f"compact-{time.time_ns():020d}-{os.getpid()}.parquet"
        schema = self.schema.with_metadata({COVERS_KEY: json.dumps([p.name for p in parts]).encode()})
        # streamed part by part, so memory stays at one part however large the shard
        out = self.storage.write_streamed(
            self.dir / name, schema, (conform(self.storage.read_table(p), schema) for p in parts)
        )
        for p in parts:
            self.storage.delete(p)
        self.storage.sync(self.dir)
        release_memory()  # a shard's parts were read and written: what Arrow's pool freed goes back
        return out

    def replace(
        self, rows: Sequence[Row] | Sequence[dict], name: str, metadata: dict[bytes, bytes] | None = None
    ) -> None:
        """A whole-file table (rejects, failures): replace `name` atomically, or remove it when empty. `metadata`
        goes into the file's Parquet schema, committed with its rows (store/source.py); a file with metadata is
        written even without rows (a prompt shard whose every line was rejected: built, zero prompts)."""
        path = self.dir / name
        if rows or metadata:
            schema = self.schema.with_metadata(metadata) if metadata else self.schema
            self.storage.write_table(table_of(rows, schema), path)
            release_memory()
        elif self.storage.exists(path):
            self.storage.delete(path)
            self.storage.sync(self.dir)

    def lock(self):
        """One writer per shard: a second run of the same shard fails fast instead of duplicating rows (storage.py:
        an flock the kernel releases when the process dies)."""
        if isinstance(self.dir, Path):
            self.dir.mkdir(parents=True, exist_ok=True)
        return self.storage.lock(self.dir)
