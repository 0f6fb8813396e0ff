"""Parquet tables under the data dir, written so that a crash at any moment leaves them consistent.

The one ledger of "done": a completion exists iff its row is in a committed Parquet part. A part is
written to a temporary name, fsynced, renamed into place and the directory fsynced; a torn temporary
file from a crash is ignored and removed. Compaction writes one file that names, in its Parquet
metadata, the parts it replaces; those parts are deleted after the rename, and on the next start any
part a compacted file covers is deleted (the crash window between the two steps).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

COVERS_KEY = b"dflash.covers"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(table: pa.Table, path: Path, metadata: dict[bytes, bytes] | None = None) -> Path:
    """Write `table` to `path` so that readers see either nothing or the whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        pq.write_table(table, f, compression="zstd")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def read_table(paths: Iterable[Path], columns: list[str] | None, schema: pa.Schema) -> pa.Table:
    tables = [pq.read_table(p, columns=columns) for p in paths]
    if not tables:
        return (schema if columns is None else pa.schema([schema.field(c) for c in columns])).empty_table()
    return pa.concat_tables(tables)


class PartStore:
    """Committed parts of one table for one shard: `<root>/<table>/shard=<key>/*.parquet`."""

    def __init__(self, data_dir: Path, table: str, shard: str, schema: pa.Schema):
        self.dir = Path(data_dir) / table / f"shard={shard}"
        self.schema = schema

    def _files(self) -> list[Path]:
        if not self.dir.exists():
            return []
        return sorted(p for p in self.dir.iterdir() if p.suffix == ".parquet" and not p.name.startswith("."))

    def recover(self) -> None:
        """Remove torn temporary files and parts that a compacted file already holds."""
        if not self.dir.exists():
            return
        for p in self.dir.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)
        for covered in self._covered():
            (self.dir / covered).unlink(missing_ok=True)

    def _covered(self) -> set[str]:
        covered: set[str] = set()
        for p in self._files():
            if p.name.startswith("compact-"):
                meta = pq.read_schema(p).metadata or {}
                covered.update(json.loads(meta.get(COVERS_KEY, b"[]")))
        return covered

    def parts(self) -> list[Path]:
        """The committed files, each row in exactly one of them."""
        covered = self._covered()
        return [p for p in self._files() if p.name not in covered]

    def read(self, columns: list[str] | None = None) -> pa.Table:
        return read_table(self.parts(), columns, self.schema)

    def commit(self, rows: list[dict]) -> Path | None:
        if not rows:
            return None
        table = pa.Table.from_pylist(rows, schema=self.schema)
        name = f"part-{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:6]}.parquet"
        return write_atomic(table, self.dir / name)

    def compact(self) -> Path | None:
        """Merge all parts into one file, atomically. Returns the new file, or None if nothing to merge."""
        parts = self.parts()
        if len(parts) <= 1:
            return None
        name = f"compact-{time.time_ns():020d}-{os.getpid()}.parquet"
        out = self.dir / name
        tmp = out.with_name(f".{name}.tmp")
        schema = self.schema.with_metadata({COVERS_KEY: json.dumps([p.name for p in parts]).encode()})
        # streamed part by part, so memory stays at one part however large the shard
        with open(tmp, "wb") as f:
            with pq.ParquetWriter(f, schema, compression="zstd") as writer:
                for p in parts:
                    writer.write_table(pq.read_table(p).cast(schema))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        fsync_dir(self.dir)
        for p in parts:
            p.unlink(missing_ok=True)
        fsync_dir(self.dir)
        return out

    def replace(self, rows: list[dict], name: str) -> None:
        """A whole-file table (rejects, failures): replace `name` atomically, or remove it when empty."""
        path = self.dir / name
        if rows:
            write_atomic(pa.Table.from_pylist(rows, schema=self.schema), path)
        elif path.exists():
            path.unlink()
            fsync_dir(self.dir)

    @contextmanager
    def lock(self):
        """One writer per shard: a second run of the same shard fails fast instead of duplicating rows.

        flock is released by the kernel when the process dies, so kill -9 never leaves a stale lock.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                raise RuntimeError(f"{self.dir} is being written by {holder}; wait for it or stop it") from None
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()}")
            f.flush()
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
