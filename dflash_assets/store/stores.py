"""Each shard's stores in the data dir: prompts, completions, rejects (by stage) and failures, each a PartStore; and
the committed parts of a table as DuckDB reads them (parquet_files, parquet_source)."""

from collections.abc import Iterator
from pathlib import Path, PurePath, PurePosixPath

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import (
    COMPLETION_SCHEMA,
    FAILURE_SCHEMA,
    PROMPT_SCHEMA,
    REJECT_SCHEMA,
    CompletionRow,
    PromptRow,
    rows_as,
)
from dflash_assets.store.storage import Storage, open_storage


def prompt_store(data_dir: str | Path | Storage, shard: str) -> PartStore:
    return PartStore(data_dir, "prompt_shards", shard, PROMPT_SCHEMA)


def reject_store(data_dir: str | Path | Storage, shard: str, stage: str) -> PartStore:
    return PartStore(data_dir, "rejects", f"{shard}/stage={stage}", REJECT_SCHEMA)


def prompt_batches(store: PartStore, columns: list[str] | None = None, size: int = 2048) -> Iterator[list[PromptRow]]:
    """A shard's prompts a batch at a time, so a large shard is never all in memory; a column not read, or that a
    part written before it existed lacks (tools_json), reads as null."""
    for part in store.parts():
        file = store.storage.parquet_file(part)
        present = columns if columns is None else [c for c in columns if c in file.schema_arrow.names]
        for batch in file.iter_batches(batch_size=size, columns=present):
            yield rows_as(PromptRow, batch)


def completion_batches(
    store: PartStore, config_hash: str, columns: list[str] | None = None, wanted: set[str] | None = None, size=256
) -> Iterator[list[CompletionRow]]:
    """Committed rows of one config (of the prompts `wanted`, when given), a batch at a time; a column not read, or
    that a part written before it existed lacks, reads as null."""
    parts = store.parts()
    if not parts or wanted == set():
        return
    where = pc.field("config_hash") == config_hash
    if wanted is not None:
        where = where & pc.field("prompt_id").isin(sorted(wanted))
    dataset = store.storage.dataset(parts, schema=COMPLETION_SCHEMA)
    for batch in dataset.to_batches(columns=columns, filter=where, batch_size=size):
        if batch.num_rows:
            yield rows_as(CompletionRow, batch)


def ids_in_other_shards(data_dir: str | Path | Storage, shard: str, ids: list[str]) -> dict[str, str]:
    """prompt_id -> shard of those of `ids` that a materialised shard other than this one holds (the two id columns
    are read a batch at a time and only the matches kept: what is held is one shard's ids, however many shards)."""
    storage = open_storage(data_dir)
    root = storage.root / "prompt_shards"
    if not storage.exists(root) or not ids:
        return {}
    found = (pc.field("shard") != shard) & pc.field("prompt_id").isin(ids)
    table = storage.dataset(root, partitioning=None).to_table(columns=["prompt_id", "shard"], filter=found)
    return dict(zip(table["prompt_id"].to_pylist(), table["shard"].to_pylist()))


def largest_prompt(data_dir: str | Path | Storage) -> int | None:
    """The most prompt_tokens of any prompt in the data dir's prompt shards, or None before any shard is built."""
    storage = open_storage(data_dir)
    root = storage.root / "prompt_shards"
    if not storage.exists(root):
        return None
    tokens = storage.dataset(root, partitioning=None).to_table(columns=["prompt_tokens"])["prompt_tokens"]
    return pc.max(tokens).as_py() if len(tokens) else None


def completion_store(data_dir: str | Path | Storage, shard: str) -> PartStore:
    return PartStore(data_dir, "completions", shard, COMPLETION_SCHEMA)


def failure_store(data_dir: str | Path | Storage, shard: str) -> PartStore:
    return PartStore(data_dir, "failures", shard, FAILURE_SCHEMA)


def suspect_store(data_dir: str | Path | Storage, shard: str) -> PartStore:
    """Prompts in flight when a server died, with the deaths they were in flight at (generation/quarantine.py)."""
    return PartStore(data_dir, "suspects", shard, FAILURE_SCHEMA)


def committed_ids(store: PartStore, config_hash: str) -> set[str]:
    table = store.read(["prompt_id", "config_hash"])
    return set(table.filter(pc.equal(table["config_hash"], config_hash))["prompt_id"].to_pylist())


def committed_keys(store: PartStore, config_hash: str) -> set[tuple[str, int | None]]:
    """(prompt_id, turn) of every row of this config in a store of completions or rejects (turn: null for a
    conversation's only generated turn)."""
    if not (parts := store.parts()):
        return set()
    dataset = store.storage.dataset(parts, schema=store.schema)  # parts from before `turn` read it as null
    mine = dataset.to_table(columns=["prompt_id", "turn"], filter=pc.field("config_hash") == config_hash)
    return set(zip(mine["prompt_id"].to_pylist(), mine["turn"].to_pylist()))


def committed_rows(
    data_dir: str | Path | Storage, shards: list[str] | None = None, config_hash: str | None = None
) -> dict[str, int]:
    """Completion rows committed per shard (every shard when None; of one config, when given): a recount of the
    committed parts."""
    storage = open_storage(data_dir)
    if shards is None:
        infos = storage.fs.get_file_info(pafs.FileSelector(str(storage.root / "completions"), allow_not_found=True))
        shards = sorted(
            PurePosixPath(i.path).name.removeprefix("shard=") for i in infos if i.type == pafs.FileType.Directory
        )
    counts = {}
    for shard in shards:
        table = completion_store(storage, shard).read(["config_hash"])
        mine = table.num_rows if config_hash is None else pc.sum(pc.equal(table["config_hash"], config_hash)).as_py()
        counts[shard] = mine or 0
    return counts


def committed_parts(data_dir: str | Path | Storage, table: str, shard: str | None = None) -> list[PurePath]:
    """The committed Parquet parts of one table (or one shard of it), in a stable order: folder by folder, each
    PartStore's own rule (no temp files, no part a compacted file already holds)."""
    storage = open_storage(data_dir)
    root = storage.root / table
    base = root if shard is None else root / f"shard={shard}"
    folders = sorted({p.parent for p in storage.walk(base) if p.suffix == ".parquet"})
    parts: list[PurePath] = []
    for folder in folders:
        key = folder.relative_to(root).as_posix()  # shard=<key> or shard=<key>/stage=<stage>
        if key.startswith("shard="):
            parts += PartStore(storage, table, key.removeprefix("shard="), None).parts()
    return sorted(parts)


def parquet_files(data_dir: str | Path | Storage, table: str, shard: str | None = None) -> list[str]:
    """The committed Parquet parts (PartStore.parts) of one table (or one shard of it), sorted, as DuckDB names them
    (`s3://` URIs on an object store)."""
    storage = open_storage(data_dir)
    return sorted(storage.duckdb_path(p) for p in committed_parts(storage, table, shard))


# a committed part never changes: its columns, by the name DuckDB reads it by (dropped all at once when full)
_COLUMNS: dict[str, tuple[str, ...]] = {}
COLUMNS_KEPT = 8192


def _columns(storage: Storage, part: PurePath) -> tuple[str, ...]:
    name = storage.duckdb_path(part)
    if (columns := _COLUMNS.get(name)) is None:
        if len(_COLUMNS) >= COLUMNS_KEPT:
            _COLUMNS.clear()
        try:
            columns = _COLUMNS[name] = tuple(storage.parquet_file(part).schema_arrow.names)
        except (pa.ArrowException, OSError) as e:  # a part written by hand, or cut short outside our writers
            raise ValueError(f"{name} is not a readable Parquet file: {e}") from e
    return columns


def parquet_source(
    con: duckdb.DuckDBPyConnection,
    data_dir: str | Path | Storage,
    table: str,
    schema: pa.Schema,
    shard: str | None = None,
    row_position: bool = False,
    parts: list[PurePath] | None = None,
) -> str:
    """A FROM clause over the table's committed parts (or those given), or over an empty table of its schema when
    there are none yet. `row_position` adds `filename` and `file_row_number`: a row's stable identity across
    queries."""
    storage = open_storage(data_dir)
    parts = committed_parts(storage, table, shard) if parts is None else parts
    if row_position:
        schema = schema.append(pa.field("filename", pa.string())).append(pa.field("file_row_number", pa.int64()))
    empty = f"_empty_{table}"
    con.register(empty, schema.empty_table())
    if not parts:
        return empty
    storage.attach(con)
    # parts written before a column existed (turn, policy_cap, ...) read it as null: the parts of each set of
    # columns are read together, the sets and the schema's empty table joined BY NAME. (DuckDB's union_by_name
    # opens every file at once to unify them: about 0.7 MB a file, 70 MB over a hundred shards.)
    groups: dict[tuple[str, ...], list[str]] = {}
    for part in parts:
        groups.setdefault(_columns(storage, part), []).append(storage.duckdb_path(part))
    position = ", filename = true, file_row_number = true" if row_position else ""
    reads = []
    for i, files in enumerate(groups.values()):
        name = f"_files_{table}_{i}"
        con.execute(f"SET VARIABLE {name} = $files", {"files": sorted(files)})
        reads.append(f"SELECT * FROM read_parquet(getvariable('{name}'), hive_partitioning = false{position})")
    return f"({' UNION ALL BY NAME '.join([*reads, f'SELECT * FROM {empty}'])})"
