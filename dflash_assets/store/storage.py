"""Where the tables live: a local directory or an S3-compatible prefix (`open_storage`), behind one small interface:
a `pyarrow.fs.FileSystem` and the root in it. Reads go through `storage.fs` on both (DuckDB after `attach`); commits,
deletes and the writer lock differ (deploy/README.md: the data dir on S3).

Commit on S3: there is no rename, but an object becomes visible only whole, when its upload completes; and a pyarrow
output stream that is closed (by `with`, or the garbage collector) completes the upload with what was written so far.
So a part is serialised to memory and written in ONE write; a compacted file is streamed to a temporary name
(`.<name>.<rand>.tmp`, never read) and copied server-side to its final name (CopyObject: atomic, at most 5 GB).

Lock on S3: an flock on a LOCAL file keyed by the shard's URI (pyarrow sends no conditional writes). It stops two
processes on one host, not two hosts: S3 mode assumes one writer host per shard at a time (the instance's per-shard
pool). Two writers would not corrupt a file, but could duplicate rows, which the `duplicates` check reports.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import re
import socket
import tempfile
import uuid
from collections.abc import Iterable
from contextlib import contextmanager, suppress
from pathlib import Path, PurePath, PurePosixPath
from urllib.parse import urlsplit

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dflash_assets.settings import Deployment

URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
COPY_LIMIT = 4 * 1024**3  # S3 CopyObject copies at most 5 GiB in one atomic request; keep a margin
# ours first (settings.Deployment.S3_ENDPOINT), then the AWS SDK's own, which the AWS documentation defines
ENDPOINT_VARS = (Deployment.S3_ENDPOINT.name, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def is_uri(data_dir: str | os.PathLike) -> bool:
    return isinstance(data_dir, str) and URI.match(data_dir) is not None


def write_refusal(data_dir: str) -> str | None:
    """Why a local data dir cannot be written, in one sentence with the fix, or None when it can: it is a file, lies
    under one, or it (or, not made yet, the directory it would be made in) refuses a file: read-only, full, not
    ours. Tried with a small file, removed at once, so nothing is left and nothing of the data dir is made."""
    if is_uri(data_dir):
        return None  # an object store answers for itself at the run's first write
    path = Path(data_dir).resolve()
    at = path
    while not at.exists() and at != at.parent:
        at = at.parent
    if not at.is_dir():
        where = "is a file" if at == path else f"lies under {at}, a file"
        return f"the data dir {path} {where}: give --data-dir a directory (an empty or a new one for new prompts)"
    try:
        fd, probe = tempfile.mkstemp(dir=at, prefix=".dflash-write-check-")
        try:
            os.write(fd, b"dflash")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        where = f"the data dir {path}" if at == path else f"{at}, where the data dir {path} would be made,"
        return f"{where} cannot be written ({e.strerror}): give --data-dir a directory you can write to, with room"
    return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(table: pa.Table, path: Path) -> Path:
    """Write `table` to the local `path` so that readers see either nothing or the whole file."""
    return write_local(Path(path), table.schema, [table])


def write_local(path: Path, schema: pa.Schema, tables: Iterable[pa.Table]) -> Path:
    """Commit one local Parquet file made of `tables`, one at a time in memory: written to a temporary name, fsynced,
    renamed into place, its directory fsynced. A temporary file that could not be written whole is removed at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            with pq.ParquetWriter(f, schema, compression="zstd") as writer:
                for table in tables:
                    writer.write_table(table)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):  # a read-only filesystem cannot remove it either: recover() will
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


@contextmanager
def flock(lock_file: Path, what: str):
    """An exclusive, non-blocking flock on `lock_file`; the kernel releases it when the process dies."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise RuntimeError(f"{what} is being written by {holder}; wait for it or stop it") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Storage:
    """A filesystem and the root of the tables in it. Paths are PurePaths under `root` (Path when local)."""

    fs: pafs.FileSystem
    root: PurePath
    uri: str  # the data dir as the user gave it, for messages
    max_streamed_bytes: int | None = None  # the largest file write_streamed can commit (None: no limit)

    def __str__(self) -> str:
        return self.uri

    # ---- listing -------------------------------------------------------------------------------------------
    def files(self, folder: PurePath) -> list[PurePath]:
        """The files directly in `folder`, sorted by name; [] when it does not exist."""
        infos = self.fs.get_file_info(pafs.FileSelector(str(folder), allow_not_found=True))
        return sorted(
            (folder / PurePosixPath(i.path).name for i in infos if i.type == pafs.FileType.File), key=lambda p: p.name
        )

    def walk(self, folder: PurePath) -> list[PurePath]:
        """Every file below `folder`, at any depth."""
        infos = self.fs.get_file_info(pafs.FileSelector(str(folder), allow_not_found=True, recursive=True))
        return [folder / PurePosixPath(i.path).relative_to(str(folder)) for i in infos if i.type == pafs.FileType.File]

    def exists(self, path: PurePath) -> bool:
        return self.fs.get_file_info(str(path)).type != pafs.FileType.NotFound

    def size(self, path: PurePath) -> int:
        return self.fs.get_file_info(str(path)).size or 0

    # ---- reading (one code path for every backend) ---------------------------------------------------------
    def read_table(self, path: PurePath, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(str(path), columns=columns, filesystem=self.fs)

    def read_schema(self, path: PurePath) -> pa.Schema:
        return pq.read_schema(str(path), filesystem=self.fs)

    def parquet_file(self, path: PurePath) -> pq.ParquetFile:
        return pq.ParquetFile(str(path), filesystem=self.fs)

    def dataset(self, source: PurePath | Iterable[PurePath], **kwargs) -> ds.Dataset:
        paths = str(source) if isinstance(source, PurePath) else [str(p) for p in source]
        return ds.dataset(paths, filesystem=self.fs, format="parquet", **kwargs)

    def duckdb_path(self, path: PurePath) -> str:
        """The name DuckDB reads `path` by (after `attach`)."""
        return str(path)

    def attach(self, con) -> None:
        """Make the files readable by DuckDB connection `con` (nothing to do for local files)."""

    # ---- writing (backend-specific) ------------------------------------------------------------------------
    def write_table(self, table: pa.Table, path: PurePath) -> PurePath:
        """Commit `table` as the Parquet file `path`: readers see either nothing (or the old file) or all of it."""
        raise NotImplementedError

    def write_streamed(self, path: PurePath, schema: pa.Schema, tables: Iterable[pa.Table]) -> PurePath:
        """Commit one Parquet file made of `tables`, one at a time in memory, atomically."""
        raise NotImplementedError

    def delete(self, path: PurePath) -> None:
        """Remove `path` if it exists."""
        raise NotImplementedError

    def sync(self, folder: PurePath) -> None:
        """Make the deletes/renames in `folder` durable."""

    def is_temporary(self, path: PurePath) -> bool:
        return path.name.startswith(".") and path.name.endswith(".tmp")

    def lock(self, folder: PurePath):
        """One writer per shard folder (a context manager)."""
        raise NotImplementedError


class LocalStorage(Storage):
    """A local directory: temp file + fsync + rename + directory fsync, flock in the shard folder."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.uri = str(root)
        self.fs = pafs.LocalFileSystem()

    # the local paths are Paths; the interface says PurePath (an S3 key is one), so each method takes its Path of it
    def files(self, folder: PurePath) -> list[PurePath]:
        if not (folder := Path(folder)).is_dir():
            return []
        return sorted((p for p in folder.iterdir() if p.is_file()), key=lambda p: p.name)

    def walk(self, folder: PurePath) -> list[PurePath]:
        return [p for p in Path(folder).rglob("*") if p.is_file()] if Path(folder).exists() else []

    def exists(self, path: PurePath) -> bool:
        return Path(path).exists()

    def write_table(self, table: pa.Table, path: PurePath) -> PurePath:
        return write_atomic(table, Path(path))

    def write_streamed(self, path: PurePath, schema: pa.Schema, tables: Iterable[pa.Table]) -> PurePath:
        return write_local(Path(path), schema, tables)

    def delete(self, path: PurePath) -> None:
        Path(path).unlink(missing_ok=True)

    def sync(self, folder: PurePath) -> None:
        if Path(folder).is_dir():
            fsync_dir(Path(folder))

    def lock(self, folder: PurePath):
        """flock is released by the kernel when the process dies, so kill -9 never leaves a stale lock."""
        return flock(Path(folder) / ".lock", str(folder))


def s3_filesystem() -> pafs.S3FileSystem:
    """An S3FileSystem for the endpoint in the environment (AWS itself when none is set)."""
    kwargs: dict[str, str] = {}
    endpoint = next((os.environ[v] for v in ENDPOINT_VARS if os.environ.get(v)), None)
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        kwargs.update(endpoint_override=parts.netloc, scheme=parts.scheme)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    # no credentials here: the AWS SDK reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN,
    # AWS_PROFILE and instance roles itself
    return pafs.S3FileSystem(allow_delayed_open=True, **kwargs)


def lock_dir() -> Path:
    home = os.environ.get("DAGSTER_HOME")
    return Path(home) / "locks" if home else Path(tempfile.gettempdir()) / "dflash-locks"


class S3Storage(Storage):
    """An S3-compatible prefix: whole-object writes under the final name, local flock (one writer host)."""

    def __init__(self, uri: str):
        bucket_and_prefix = match.group(2).strip("/") if (match := URI.match(uri)) else ""
        if not bucket_and_prefix:
            raise ValueError(f"data dir {uri!r} names no bucket: expected s3://bucket[/prefix]")
        self.uri = f"s3://{bucket_and_prefix}"
        self.root = PurePosixPath(bucket_and_prefix)
        self.fs = s3_filesystem()
        self.max_streamed_bytes = COPY_LIMIT

    def duckdb_path(self, path: PurePath) -> str:
        return f"s3://{path}"

    def attach(self, con) -> None:
        """DuckDB reads s3:// through this storage's own pyarrow S3FileSystem (no httpfs, no second credentials)."""
        fs = duckdb_filesystem(self.fs)
        if fs.protocol not in con.list_filesystems():
            con.register_filesystem(fs)

    def write_table(self, table: pa.Table, path: PurePath) -> PurePath:
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, compression="zstd")
        data = buffer.getvalue()  # the whole file, before anything is sent
        with self.fs.open_output_stream(str(path)) as out:
            out.write(data)  # one write: whatever closes the stream, it holds the complete file
        return path

    def write_streamed(self, path: PurePath, schema: pa.Schema, tables: Iterable[pa.Table]) -> PurePath:
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with self.fs.open_output_stream(str(tmp)) as out:
                with pq.ParquetWriter(out, schema, compression="zstd") as writer:
                    for table in tables:
                        writer.write_table(table)
            self.fs.copy_file(str(tmp), str(path))  # server-side CopyObject: atomic, the final name appears whole
        finally:
            self.delete(tmp)
        return path

    def delete(self, path: PurePath) -> None:
        try:
            self.fs.delete_file(str(path))
        except FileNotFoundError:
            pass

    def lock(self, folder: PurePath):
        uri = self.duckdb_path(folder)
        key = hashlib.sha256(uri.encode()).hexdigest()[:16]
        readable = re.sub(r"[^A-Za-z0-9=._-]+", "_", uri.removeprefix("s3://"))[-80:]
        return flock(lock_dir() / f"{readable}-{key}.lock", uri)


def duckdb_filesystem(fs: pafs.FileSystem):
    """`fs` as the fsspec filesystem `duckdb.register_filesystem` takes, claiming s3://."""
    from fsspec.implementations.arrow import ArrowFSWrapper

    class DuckDBFileSystem(ArrowFSWrapper):
        """s3://bucket/key -> bucket/key on a pyarrow S3FileSystem. A file's info (a HEAD request, asked several
        times per file) is kept for the connection's life: a committed part never changes under its name."""

        protocol = "s3"
        cachable = False  # fsspec's instance cache could otherwise hand back one made for another endpoint

        def __init__(self, fs, **kwargs):
            super().__init__(fs, **kwargs)
            self._infos: dict[str, dict] = {}

        @classmethod
        def _strip_protocol(cls, path):
            path = path[0] if isinstance(path, list) else path
            return path.removeprefix("s3://").rstrip("/")

        def info(self, path, **kwargs):
            path = self._strip_protocol(path)
            if path not in self._infos:
                found = super().info(path, **kwargs)
                if found["type"] != "file":
                    return found
                self._infos[path] = found
            return self._infos[path]

        def modified(self, path):
            return self.info(path)["mtime"]

    return DuckDBFileSystem(fs)


def open_storage(data_dir: str | os.PathLike | Storage) -> Storage:
    """The Storage of a data dir: a local path, or `s3://bucket/prefix`."""
    if isinstance(data_dir, Storage):
        return data_dir
    text = os.fspath(data_dir)
    match = URI.match(text)
    if match:
        scheme = match.group(1).lower()
        if scheme in ("s3", "s3a"):
            return S3Storage(text)
        if scheme == "file":
            return LocalStorage(urlsplit(text).path)
        raise ValueError(f"data dir {text!r}: unsupported scheme {scheme}:// (a local path or s3://bucket/prefix)")
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:/[^/]", text) and not Path(text).exists():
        # Path("s3://b/x") is "s3:/b/x": a URI that went through pathlib; never create a local dir "s3:" for it
        raise ValueError(
            f"data dir {text!r} looks like a URI mangled by pathlib (one '/' after the scheme); "
            f"pass the URI as a string"
        )
    return LocalStorage(text)


def connect_duckdb(spill_dir: Path | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB held to DFLASH_DUCKDB_MEMORY_LIMIT, spilling past it to `spill_dir` (by default its own
    folder in the temp dir, removed at close): a reader of every row stays flat at millions of rows."""
    con = duckdb.connect(":memory:")
    con.execute("SET memory_limit = $limit", {"limit": Deployment.DUCKDB_MEMORY_LIMIT.value()})
    con.execute("SET threads = $n", {"n": Deployment.DUCKDB_THREADS.value()})
    spill = spill_dir or Path(tempfile.gettempdir()) / f"dflash-duckdb-{uuid.uuid4().hex[:12]}"
    con.execute("SET temp_directory = $dir", {"dir": str(spill)})
    return con


def release_memory() -> None:
    """Give back to the OS the pages Arrow's pool (jemalloc: dflash_assets/__init__.py) and the C heap keep of what was
    freed since: they keep them for reuse, and a backfill's Parquet and text, shard after shard, would otherwise grow
    its resident memory."""
    pa.default_memory_pool().release_unused()
    with suppress(OSError, AttributeError):  # glibc's; other C libraries give back on their own
        ctypes.CDLL(None).malloc_trim(0)
