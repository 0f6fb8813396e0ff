"""The data dir as a few small temp tables in one in-memory DuckDB (`open_quality_db`): what every check and report
reads. The committed Parquet parts are scanned once and only read (a check never holds a lock the writer needs);
`completions` keeps the key and token columns and flags computed from the text (COMPLETION_COLUMNS,
COMPLETION_FLAGS, window_flags_sql), so no check re-reads the text. Every table exists, empty when its directory has
no files yet.

Scope: `shard` reads only `<table>/shard=<key>/`; `config_hash` keeps that config's rows (and every source-stage
reject, which comes before any config). The other configs of the shards are only counted (other_outcomes,
config_writes), never pooled into a figure.
"""

from pathlib import Path

import duckdb
import pyarrow as pa

from dflash_assets.generation.runaway import is_runaway
from dflash_assets.quality.training.trainer_format import think_marker_sql
from dflash_assets.rules import (
    CONFIG_CAP_SQL,
    STOPPED_EARLY_SQL,
    WINDOW_SIZED_SQL,
    blank_sql,
    cut_inside_window_sql,
    outcomes_sql,
    row_window_sql,
    trained_tokens_sql,
    window_complete_sql,
)
from dflash_assets.settings import RunawaySettings, TrainerSettings
from dflash_assets.store.schema import COMPLETION_SCHEMA, FAILURE_SCHEMA, PROMPT_SCHEMA, REJECT_SCHEMA
from dflash_assets.store.storage import connect_duckdb, open_storage, release_memory
from dflash_assets.store.stores import parquet_source

COMPLETION_COLUMNS = f"""
    prompt_id, shard, source, config_hash, finish_reason, prompt_tokens, completion_tokens, max_output_tokens,
    server_context_length, enable_thinking, turn, turns, {CONFIG_CAP_SQL} AS config_cap, {WINDOW_SIZED_SQL} AS window_sized,
    policy_cap IS NOT NULL AS window_policy, trainer_max_length, tool_calls_json"""

# a turn of tool calls answers with its calls: its content may be empty (generation/tools.py)
COMPLETION_FLAGS = f"""
    {blank_sql('content')} AND tool_calls_json IS NULL AS content_empty,
    {think_marker_sql("content", "reasoning_content")} AS think_marker,
    {blank_sql('reasoning_content')} AS reasoning_empty"""


def one(con: duckdb.DuckDBPyConnection, sql: str, params: object = None) -> tuple:
    """The row of a query that gives exactly one (an aggregate: DuckDB's fetchone() is None only for no row)."""
    row = con.execute(sql, params).fetchone()
    if row is None:
        raise RuntimeError(f"the query gave no row: {sql}")
    return row


def window_flags_sql(max_length: int) -> str:
    """The window's flags of a completion row (over a select that has `runaway` and `trainer_max_length`), judged
    by the row's own window (rules.row_window_sql)."""
    window = row_window_sql(max_length)
    return (
        f"{window} AS judged_window, "
        f"{cut_inside_window_sql(window)} AS cut_inside_window, "
        f"{window_complete_sql(window)} AND NOT runaway AS window_complete, "
        f"{trained_tokens_sql(window)} AS trained_tokens"
    )


def recorded_windows(con: duckdb.DuckDBPyConnection, max_length: int) -> dict[int, int]:
    """The windows the rows in scope are judged by other than `max_length` (the trainer's in force), with their rows."""
    return dict(
        con.execute(
            "SELECT judged_window, count(*) FROM completions WHERE judged_window <> $m GROUP BY ALL ORDER BY ALL",
            {"m": max_length},
        ).fetchall()
    )


def judged_window(con: duckdb.DuckDBPyConnection, max_length: int) -> tuple[int, str]:
    """(the window the rows in scope are judged by: one recorded window for every row, else the setting's; a sentence
    naming the recorded ones, when there are)."""
    other = recorded_windows(con, max_length)
    if not other:
        return max_length, ""
    (rows,) = one(con, "SELECT count(*) FROM completions")
    (only, n), *more = other.items()
    window = only if not more and n == rows else max_length
    said = ", ".join(f"{n:,} rows at {w:,}" for w, n in other.items())
    return window, (
        f"Window-policy rows are judged by the window their requests were sized to ({said}), not by the trainer "
        f"setting's {max_length:,}; to train them at another window, generate at it (or grow it: dflash continue "
        f"--to-window)."
    )


def runaway_sql(runaway: RunawaySettings) -> str:
    """The `runaway` flag of a completion row (needs `register_runaway`): a row stopped while streaming, or a cut
    row whose last generated text (the answer, else the reasoning) loops."""
    tail = (
        f"CASE WHEN {blank_sql('content')} "
        f"THEN right(reasoning_content, {runaway.tail_chars}) ELSE right(content, {runaway.tail_chars}) END"
    )
    return (
        f"CASE WHEN {STOPPED_EARLY_SQL} THEN true "
        f"WHEN finish_reason = 'length' THEN coalesce(is_runaway({tail}), false) ELSE false END"
    )


# `other_outcomes` (rules.outcomes_sql) are those of every config but the scope's
OTHER_CONFIGS = """getvariable('scope_config') IS NOT NULL AND config_hash IS DISTINCT FROM getvariable('scope_config')
    AND ($shard IS NULL OR shard = $shard)"""

CONFIG_WRITES = """
CREATE TEMP TABLE config_writes AS
SELECT config_hash, min(created_at) AS first_written, max(created_at) AS last_written FROM (
    SELECT shard, config_hash, created_at FROM {completions}
    UNION ALL SELECT shard, config_hash, created_at FROM {rejects} WHERE stage <> 'source'
    UNION ALL SELECT shard, config_hash, created_at FROM {failures}
) WHERE $shard IS NULL OR shard = $shard
GROUP BY ALL
"""


def open_quality_db(
    data_dir: str | Path,
    shard: str | None = None,
    config_hash: str | None = None,
    runaway: RunawaySettings = RunawaySettings(),
    max_length: int = TrainerSettings().max_length,
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB holding the scoped temp tables (module doc); close it (or use it as a context manager).
    `max_length` is the trainer's window the rows are judged against. What the stages before it freed, and the
    scan's own buffers after it, go back to the OS: every row's text goes through the scan (release_memory)."""
    release_memory()
    con = connect_duckdb()
    register_runaway(con, runaway)
    storage = open_storage(data_dir)  # one filesystem for the four tables
    params = {"shard": shard, "config": config_hash}
    # the scope itself, for checks whose meaning depends on it (accounting: which configs a shard owes)
    con.execute("SET VARIABLE scope_config = $config::VARCHAR", {"config": config_hash})
    shard_ok = "($shard IS NULL OR shard = $shard)"
    config_ok = "($config IS NULL OR config_hash = $config)"

    sources = {
        table: parquet_source(con, storage, table, schema, shard)
        for table, schema in (
            ("completions", COMPLETION_SCHEMA),
            ("rejects", REJECT_SCHEMA),
            ("failures", FAILURE_SCHEMA),
        )
    }
    src = sources["completions"]
    con.execute("SET VARIABLE trainer_max_length = $m", {"m": max_length})
    con.execute(
        f"CREATE TEMP TABLE completions AS SELECT *, {window_flags_sql(max_length)} FROM ("
        f"SELECT {COMPLETION_COLUMNS}, {COMPLETION_FLAGS}, {runaway_sql(runaway)} AS runaway "
        f"FROM {src} WHERE {shard_ok} AND {config_ok})",
        params,
    )
    src = sources["rejects"]
    con.execute(
        "CREATE TEMP TABLE rejects AS SELECT shard, stage, line, prompt_id, config_hash, reason, prompt_tokens, "
        f"max_output_tokens, server_context_length, turn FROM {src} "
        f"WHERE {shard_ok} AND ({config_ok} OR stage = 'source')",
        params,
    )
    src = sources["failures"]
    con.execute(
        f"CREATE TEMP TABLE failures AS SELECT shard, prompt_id, config_hash, error, attempts FROM {src} "
        f"WHERE {shard_ok} AND {config_ok}",
        params,
    )
    src = parquet_source(con, storage, "prompt_shards", PROMPT_SCHEMA, shard)
    con.execute(
        f"CREATE TEMP TABLE prompts AS SELECT prompt_id, shard, tools_json FROM {src} WHERE {shard_ok}",
        {"shard": shard},
    )
    con.execute(f"CREATE TEMP TABLE outcomes AS {outcomes_sql()}")
    con.execute(f"CREATE TEMP TABLE other_outcomes AS {outcomes_sql(OTHER_CONFIGS, **sources)}", {"shard": shard})
    con.execute(CONFIG_WRITES.format(**sources), {"shard": shard})
    release_memory()
    return con


def register_runaway(con: duckdb.DuckDBPyConnection, runaway: RunawaySettings = RunawaySettings()) -> None:
    """`is_runaway(tail VARCHAR) -> BOOLEAN` on `con`, judged by `runaway`, a batch of rows per call (Arrow)."""

    def batch(tails: pa.Array) -> pa.Array:
        return pa.array([is_runaway(t, runaway) for t in tails.to_pylist()], pa.bool_())

    # duckdb's stubs type a UDF by the Python values it returns; an Arrow UDF returns a pa.Array
    con.create_function("is_runaway", batch, ["VARCHAR"], "BOOLEAN", type="arrow", null_handling="special")  # type: ignore[call-overload]
