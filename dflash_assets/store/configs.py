"""The configs of a data dir, side by side: each one's settings, shards, counts and when it was written. A config
is read off its rows (every row records the config that made it), never off a second ledger, and only their small
columns are read (no text, no token ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from dflash_assets.rules import CUT_AT_CAP_SQL, cut_inside_window_sql, latest_first, outcomes_sql, row_window_sql
from dflash_assets.settings import SAMPLING_PARAMS, TrainerSettings
from dflash_assets.store.schema import COMPLETION_SCHEMA, FAILURE_SCHEMA, PROMPT_SCHEMA, REJECT_SCHEMA
from dflash_assets.store.storage import Storage, connect_duckdb, open_storage
from dflash_assets.store.stores import committed_parts, parquet_source

# what a config is: the settings its rows record (the same for every row of one config_hash)
SETTINGS = ("model", *SAMPLING_PARAMS, "parent_config_hash", "thinking_share", "mode_seed")
ROW_COLUMNS = [
    "config_hash",
    "shard",
    "prompt_id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "max_output_tokens",
    "policy_cap",
    "trainer_max_length",
    "server_context_length",
    "turn",
    "created_at",
    "enable_thinking",  # per row: a seeded mix of modes has both in one config
    *SETTINGS,
]


@dataclass(frozen=True)
class ShardCounts:
    """One shard of one config: `prompts = completed + rejected + failed` when the config is complete there."""

    shard: str
    prompts: int  # the shard's prompts (its prompt_shards file)
    rows: int  # completion rows (a row per turn under all_turns)
    completed: int  # prompts with a committed row
    rejected: int  # prompts refused at preflight or by the server (and without a row)
    failed: int  # prompts whose retries ran out (and without a row or a reject)

    @property
    def missing(self) -> int:
        return self.prompts - self.completed - self.rejected - self.failed

    @property
    def complete(self) -> bool:
        return self.missing <= 0


@dataclass(frozen=True)
class Config:
    """A generation config of the data dir, as its rows record it."""

    config_hash: str
    cap: int | None  # the config's cap (policy_cap under the window policy, whose rows each ask their own)
    cap_policy: str  # "fixed" or "window"
    window: int | None  # the trainer's window a window-policy config sized its requests to (None: fixed cap)
    settings: dict  # model, sampling, thinking, parent (a continued config), server context lengths
    first_written: datetime | None  # created_at of its first and last committed row
    last_written: datetime | None
    rows: int
    cut_inside_window: int  # rows cut inside the window they are judged by (rules.row_window_sql)
    cut_at_cap: int  # rows the cap ended (rules.FIGURES "cut at the cap"), inside the window or past it
    max_length: int  # the trainer's window in force (a window-policy config is judged by its own)
    shards: tuple[ShardCounts, ...]
    thinking_rows: float | None = None  # the share of its rows generated with thinking on (a mix: between 0 and 1)

    @property
    def complete(self) -> bool:
        """Every prompt of its shards accounted for: completed, rejected or failed."""
        return bool(self.shards) and all(s.complete for s in self.shards)

    @property
    def cut_inside_window_rate(self) -> float:
        return self.cut_inside_window / self.rows if self.rows else 0.0

    @property
    def cut_at_cap_rate(self) -> float:
        return self.cut_at_cap / self.rows if self.rows else 0.0

    @property
    def judged_at(self) -> int:
        """The window its cut rows are judged by: the one a window-policy config recorded, else `max_length`."""
        return self.window if self.cap_policy == "window" and self.window else self.max_length

    @property
    def policy(self) -> str:
        """The cap and its policy in a few words: "cap 4096", "cap 4096, window 4096 (+32)"."""
        return f"cap {self.cap}" + (f", window policy {self.window}" if self.cap_policy == "window" else "")

    def cells(self) -> list[str]:
        """Its row of the configs table (TABLE_COLUMNS): `dflash configs` and length_quality_summary's `configs`."""
        done = "yes" if self.complete else f"no: {sum(max(0, s.missing) for s in self.shards):,} missing"
        return [
            self.config_hash,
            f"{self.cap} fixed" if self.cap_policy == "fixed" else f"{self.cap} window {self.window}",
            f"{self.judged_at:,}",
            f"{self.rows:,}",
            str(len(self.shards)),
            done,
            f"{self.cut_at_cap_rate:.2%} ({self.cut_at_cap:,})",
            f"{self.cut_inside_window_rate:.2%} ({self.cut_inside_window:,})",
            self.thinking,
            _when(self.last_written),
        ]

    @property
    def thinking(self) -> str:
        """Its rows' mode: on, off, or under a seeded mix the share of rows with thinking on."""
        share = self.thinking_rows
        return "-" if share is None else "on" if share == 1 else "off" if share == 0 else f"{share:.1%} on"

    def line(self) -> str:
        """The config in one line, for a list of the others beside a run's own."""
        done = "complete" if self.complete else f"incomplete ({sum(max(0, s.missing) for s in self.shards)} missing)"
        when = _when(self.last_written) + " UTC"
        return (
            f"config {self.config_hash} ({self.policy}): {self.rows:,} rows in {len(self.shards)} shard(s), {done}, "
            f"{self.cut_at_cap_rate:.2%} cut at the cap, {self.cut_inside_window_rate:.2%} cut inside the window "
            f"{self.judged_at:,}, last written {when}"
        )


# "judged at": the trainer's window (max_length) the cut rows are judged against, the same for every config listed;
# rows are turn rows, the cut shares rules.FIGURES' "cut at the cap" and "cut inside the window"
TABLE_COLUMNS = (
    "config",
    "cap, policy",
    "judged at",
    "rows",
    "shards",
    "complete",
    "cut at the cap",
    "cut inside window",
    "thinking",
    "last written (UTC)",
)


def table(configs: list[Config]) -> tuple[list[str], list[list[str]]]:
    """The configs table's columns and rows (`dflash configs`, length_quality_summary's `configs`): `thinking` only
    where it tells the configs apart or one is a seeded mix (every config thinking on, the default, says nothing)."""
    columns = [c for c in TABLE_COLUMNS if c != "thinking" or any(x.thinking != "on" for x in configs)]
    return columns, [[cell for name, cell in zip(TABLE_COLUMNS, c.cells()) if name in columns] for c in configs]


def _when(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t else "-"  # UTC, as created_at


def list_configs(data_dir: str | Path | Storage, max_length: int = TrainerSettings().max_length) -> list[Config]:
    """Every config with committed rows, the latest (most recently written) first; `max_length` is the trainer's
    window the cut rows are judged against."""
    storage = open_storage(data_dir)
    with connect_duckdb() as con:  # DuckDB reads the columns it needs from the files (not an Arrow table of them)
        for view, table, schema, columns in (
            ("completions", "completions", COMPLETION_SCHEMA, ROW_COLUMNS),
            ("rejects", "rejects", REJECT_SCHEMA, ["shard", "stage", "prompt_id", "config_hash"]),
            ("failures", "failures", FAILURE_SCHEMA, ["shard", "prompt_id", "config_hash"]),
            ("prompts", "prompt_shards", PROMPT_SCHEMA, ["shard", "prompt_id"]),
        ):
            src = parquet_source(con, storage, table, schema)
            con.execute(f"CREATE TEMP VIEW {view} AS SELECT {', '.join(columns)} FROM {src}")
        configs = con.execute(
            f"""SELECT config_hash, max(coalesce(policy_cap, max_output_tokens)) AS cap,
                CASE WHEN bool_or(policy_cap IS NOT NULL) THEN 'window' ELSE 'fixed' END AS cap_policy,
                CASE WHEN bool_or(policy_cap IS NOT NULL) THEN max(trainer_max_length) END AS window,
                min(created_at) AS first_written, max(created_at) AS last_written, count(*) AS rows,
                count(*) FILTER (WHERE {cut_inside_window_sql(row_window_sql(max_length))}) AS cut_inside_window,
                count(*) FILTER (WHERE {CUT_AT_CAP_SQL}) AS cut_at_cap,
                min(server_context_length) AS min_context, max(server_context_length) AS max_context,
                bool_or(turn IS NOT NULL) AS all_turns, avg(CAST(enable_thinking AS INTEGER)) AS thinking_rows,
                {", ".join(f"any_value({s}) AS {s}" for s in SETTINGS)}
            FROM completions GROUP BY config_hash"""
        ).fetchall()
        names = [d[0] for d in con.description]
        shards = con.execute(
            f"""WITH outcomes AS ({outcomes_sql()}),
            counts AS (
                SELECT config_hash, shard, count(*) FILTER (WHERE outcome = 1) AS completed,
                    count(*) FILTER (WHERE outcome = 2) AS rejected, count(*) FILTER (WHERE outcome = 3) AS failed
                FROM outcomes GROUP BY ALL),
            rows AS (SELECT config_hash, shard, count(*) AS rows FROM completions GROUP BY ALL),
            prompts AS (SELECT shard, count(DISTINCT prompt_id) AS prompts FROM prompts GROUP BY ALL)
            SELECT c.config_hash, c.shard, coalesce(p.prompts, 0), coalesce(r.rows, 0), completed, rejected, failed
            FROM counts c LEFT JOIN rows r USING (config_hash, shard) LEFT JOIN prompts p USING (shard)
            ORDER BY c.config_hash, c.shard"""
        ).fetchall()
    by_config: dict[str, list[ShardCounts]] = {}
    for h, shard, *counts in shards:
        by_config.setdefault(h, []).append(ShardCounts(shard, *counts))
    found = []
    for values in configs:  # a Config's fields by name, its settings gathered
        c = dict(zip(names, values))
        low, high, thinking = c.pop("min_context"), c.pop("max_context"), c["thinking_rows"]
        c["settings"] = {s: c.pop(s) for s in SETTINGS} | {
            "enable_thinking": None if thinking is None else thinking == 1,
            "server_context_length": low if low == high else f"{low}-{high}",
            "regenerate": "all_turns" if c.pop("all_turns") else "last_turn",
        }
        found.append(Config(**c, max_length=max_length, shards=tuple(by_config.get(c["config_hash"], ()))))
    order = [h for h, _, _ in latest_first((c.config_hash, c.last_written, c.cap or 0) for c in found)]
    return sorted(found, key=lambda c: order.index(c.config_hash))


def latest_order(data_dir: str | Path | Storage, shard: str | None = None) -> list[tuple[str, int]]:
    """(config_hash, cap) of every config with rows (in `shard`, or anywhere), the latest first: what `latest`
    picks from. Reads three small columns."""
    storage = open_storage(data_dir)
    if not (parts := committed_parts(storage, "completions", shard)):
        return []  # listed once: no DuckDB for a data dir without rows
    with connect_duckdb() as con:
        written = parquet_source(con, storage, "completions", COMPLETION_SCHEMA, parts=parts)
        rows = con.execute(
            f"SELECT config_hash, max(created_at), max(coalesce(policy_cap, max_output_tokens)) FROM {written} "
            "GROUP BY 1"
        ).fetchall()
    return [(h, cap) for h, _, cap in latest_first(rows)]


def latest_config(data_dir: str | Path | Storage) -> str | None:
    """The most recently written config of the data dir, or None when it has no rows."""
    order = latest_order(data_dir)
    return order[0][0] if order else None
