"""Planned and generated per `source`: what prompt_shards drew of each source (its quota, its repeats left out), and
how many of those prompts a config has a completion of. A recount of the Parquet files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_assets.store.schema import COMPLETION_SCHEMA, PROMPT_SCHEMA
from dflash_assets.store.storage import Storage, connect_duckdb, open_storage
from dflash_assets.store.stores import parquet_source


@dataclass(frozen=True)
class SourceCount:
    source: str
    planned: int  # prompts of the source in the prompt shards
    generated: int  # of them, prompts with a completion row of the config

    def line(self) -> str:
        return f"{self.source}: planned {self.planned:,}, generated {self.generated:,}"


def by_source(data_dir: str | Path | Storage, config_hash: str) -> list[SourceCount]:
    """Planned and generated prompts of each source, for one config; the sources in name order. DuckDB reads the
    files (not an Arrow table of every prompt id first: 170 MB at a million rows)."""
    storage = open_storage(data_dir)
    with connect_duckdb() as con:
        prompts = parquet_source(con, storage, "prompt_shards", PROMPT_SCHEMA)
        rows = parquet_source(con, storage, "completions", COMPLETION_SCHEMA)
        found = con.execute(
            f"SELECT p.source, count(*), count(r.prompt_id) FROM (SELECT prompt_id, source FROM {prompts}) p LEFT JOIN "
            f"(SELECT DISTINCT prompt_id FROM {rows} WHERE config_hash = ?) r USING (prompt_id) GROUP BY 1 ORDER BY 1",
            [config_hash],
        ).fetchall()
    return [SourceCount(str(s), int(planned), int(generated)) for s, planned, generated in found]


def by_source_markdown(data_dir: str | Path | Storage, config_hash: str | None) -> str:
    """The table of planned and generated prompts per source, of one config."""
    if config_hash is None:
        return "no config"
    found = by_source(data_dir, config_hash)
    lines = [f"| {c.source} | {c.planned:,} | {c.generated:,} |" for c in found]
    return "| source | planned | generated |\n|---|---|---|\n" + "\n".join(lines) if lines else "no prompts"
