"""The rejects of a data dir, for people: how many by stage and reason, and the first few with their line numbers."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dflash_assets.generation.shards import reason_kind
from dflash_assets.store.schema import REJECT_SCHEMA
from dflash_assets.store.storage import Storage, connect_duckdb
from dflash_assets.store.stores import parquet_source

FIRST = 5  # the rejects shown one by one


@dataclass(frozen=True)
class Reject:
    shard: str
    stage: str  # source | preflight | server
    line: int | None
    reason: str


@dataclass(frozen=True)
class Rejects:
    """The rejects of some shards (and one config's preflight and server ones, or every config's)."""

    counts: list[tuple[str, str, int]]  # (stage, reason kind, rows), most first
    first: list[Reject]  # the first FIRST, by stage (source first), shard and line

    @property
    def total(self) -> int:
        return sum(n for *_, n in self.counts)

    def by_stage_and_reason(self) -> list[dict]:
        """The counts as the manifest records them."""
        return [{"stage": stage, "reason": reason, "rows": n} for stage, reason, n in self.counts]

    def markdown(self) -> str:
        """A table for the UI: each reason with its count, then the first rejects with their lines."""
        if not self.counts:
            return "no rejects"
        rows = "\n".join(f"| {stage} | {reason} | {n} |" for stage, reason, n in self.counts)
        first = "\n".join(
            f"| {r.shard} | {r.line if r.line is not None else '-'} | {r.reason.replace('|', chr(92) + '|')} |"
            for r in self.first
        )
        return (
            f"| stage | reason | rows |\n|---|---|---|\n{rows}\n\n"
            f"The first {len(self.first)} of {self.total}:\n\n| shard | line | reason |\n|---|---|---|\n{first}"
        )

    def lines(self, where: str) -> list[str]:
        """For the terminal: the count by reason, the first rejects with their lines, and `where` (the command that
        lists them all) when some are not shown."""
        if not self.counts:
            return []
        reasons = ", ".join(f"{reason} ({stage}) {n}" for stage, reason, n in self.counts)
        shown = "every one" if len(self.first) == self.total else "the first"
        out = [f"rejected {self.total}, by reason: {reasons}; {shown}:"]
        out += [
            f"  shard {r.shard} line {r.line if r.line is not None else '-'} ({r.stage}): {r.reason}"
            for r in self.first
        ]
        if len(self.first) < self.total:
            out.append(f"every reject, with its line and reason: {where}")
        return out


def read_rejects(
    data_dir: str | Path | Storage,
    shards: list[str] | None = None,
    config_hash: str | None = None,
    first: int | None = FIRST,
) -> Rejects:
    """The rejects of `shards` (None: every shard); with `config_hash`, the preflight and server rejects of that
    config only (the source's are every config's); `first` of them one by one (None: every one)."""
    with connect_duckdb() as con:
        src = parquet_source(con, data_dir, "rejects", REJECT_SCHEMA)
        rows = con.execute(
            f"SELECT shard, stage, line, reason FROM {src} WHERE ($shards IS NULL OR list_contains($shards, shard)) "
            f"AND ($config IS NULL OR stage = 'source' OR config_hash = $config) "
            f"ORDER BY stage <> 'source', stage, shard, line NULLS LAST",
            {"shards": shards, "config": config_hash},
        ).fetchall()
    counts = Counter((stage, reason_kind(reason)) for _, stage, _, reason in rows)
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = [
        Reject(shard, stage, line, re.sub(r"^line \d+: ", "", reason)) for shard, stage, line, reason in rows[:first]
    ]
    return Rejects([(s, r, n) for (s, r), n in ordered], shown)
