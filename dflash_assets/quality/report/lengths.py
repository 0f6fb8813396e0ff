"""The length-quality report: how long completions are, how many the cap cut, broken down every useful way
(percentiles nearest-rank: rules.PERCENTILE_DEFINITION).
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Self

import duckdb

from dflash_assets.quality.outcome import share
from dflash_assets.quality.tables import judged_window, one, open_quality_db
from dflash_assets.rules import (
    CUT_SQL,
    FIGURE,
    OVERFLOW_SQL,
    PERCENTILE_DEFINITION,
    PROMPT_OVER_CONTEXT_SQL,
    STOPPED_EARLY_SQL,
    percentile_sql,
)
from dflash_assets.settings import RunawaySettings, TrainerSettings

PROMPT_BUCKETS = (512, 1024, 2048, 4096, 8192)
CONFIG = "config_hash, config_cap"  # the config's cap: under the window policy each row asks its own

# truncated_rows: the rows the model did not end, cut at the cap or stopped while looping (runaway_stopped_rows)
# the answer's figures (rules.FIGURES) by their own definitions: cut_at_cap_rows, fills_window_rows (turn rows) here,
# the conversations' in CONVERSATIONS
STATS = f"""count(*) AS rows, count(*) FILTER (WHERE {CUT_SQL}) AS truncated_rows,
    count(*) FILTER (WHERE {FIGURE['cut at the cap'].sql}) AS cut_at_cap_rows,
    count(*) FILTER (WHERE {FIGURE['filling the window'].sql}) AS fills_window_rows,
    count(*) FILTER (WHERE runaway) AS runaway_rows,
    count(*) FILTER (WHERE cut_inside_window) AS cut_inside_window_rows,
    count(*) FILTER (WHERE window_complete) AS window_complete_rows,
    coalesce(sum(trained_tokens) FILTER (WHERE window_complete), 0)::BIGINT AS window_complete_tokens,
    coalesce(sum(completion_tokens), 0)::BIGINT AS decoded_tokens,
    coalesce(sum(trained_tokens), 0)::BIGINT AS trained_tokens,
    count(*) FILTER (WHERE {STOPPED_EARLY_SQL}) AS runaway_stopped_rows,
    {percentile_sql('completion_tokens', (0.5, 0.9, 0.95, 0.99))} AS q, max(completion_tokens) AS max"""

# a group's conversations, counted over its rows grouped by conversation first: DuckDB spills a grouped aggregate past
# its memory limit, but holds a DISTINCT over every row whole (three of them ran a million rows out of 30 MB)
CONVERSATIONS = f"""
SELECT {{group}}, count(*) AS conversations, count(*) FILTER (WHERE shortened) AS shortened_conversations FROM (
    SELECT {{select}}, {FIGURE['shortened'].sql} AS shortened FROM completions WHERE {{where}}
    GROUP BY {{group}}, shard, prompt_id)
GROUP BY {{group}}"""


@dataclass(frozen=True)
class LengthStats:
    """One STATS row read back typed: turn rows and conversations counted by rules.FIGURES, tokens, nearest-rank
    percentiles of completion_tokens; the shares are of `rows`."""

    rows: int = 0
    truncated_rows: int = 0  # the rows the model did not end: cut at the cap or stopped while looping
    cut_at_cap_rows: int = 0
    fills_window_rows: int = 0
    conversations: int = 0
    shortened_conversations: int = 0
    runaway_rows: int = 0  # of the truncated rows, those cut while looping (at the cap, or stopped early)
    cut_inside_window_rows: int = 0  # against the trainer's window (rules.py): the blocking share
    window_complete_rows: int = 0  # cut rows the trainer reads whole
    window_complete_tokens: int = 0
    decoded_tokens: int = 0
    trained_tokens: int = 0
    runaway_stopped_rows: int = 0
    p50: int | None = None
    p90: int | None = None
    p95: int | None = None
    p99: int | None = None
    max: int | None = None

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Self:
        """The stats of a row of the report (a STATS row flattened by _stats, or a dict of the same keys)."""
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})

    def share(self, count: int) -> float:
        """`count` as a share of the rows."""
        return share(count, self.rows)

    @property
    def rates(self) -> dict[str, float]:
        """The shares of `rows`, named as the report names them."""
        return {
            "truncation_rate": self.share(self.truncated_rows),
            "cut_at_cap_rate": self.share(self.cut_at_cap_rows),
            "runaway_rate": self.share(self.runaway_rows),
            "cut_inside_window_rate": self.share(self.cut_inside_window_rows),
            "window_complete_rate": self.share(self.window_complete_rows),
        }


@dataclass(frozen=True)
class ConfigStats(LengthStats):
    """A row of the report's `by_config`: one config's stats, its cap (the set one: rules.CONFIG_CAP_SQL), shards
    and policy."""

    config_hash: str = ""
    config_cap: int = 0
    shards: int = 0
    window_policy: bool = False


def _stats(row: dict[str, Any]) -> dict[str, Any]:
    """Flatten one STATS row: percentiles by name, the rates next to the counts."""
    q = row.pop("q") or [None] * 4
    row.update(zip(("p50", "p90", "p95", "p99"), q))
    return row | LengthStats.of(row).rates


def _grouped(
    con: duckdb.DuckDBPyConnection,
    select: str,
    group: str,
    extra: str = "",
    where: str = "true",
    params: dict | None = None,
) -> list[dict[str, Any]]:
    """STATS and the conversations of each group (`select` names its columns, `group` lists them), in group order."""
    cur = con.execute(
        f"SELECT {select}, {STATS}{extra} FROM completions WHERE {where} GROUP BY {group} ORDER BY {group}",
        params or {},
    )
    names = [d[0] for d in cur.description]
    groups = [dict(zip(names, values)) for values in cur.fetchall()]
    width, counted = len(group.split(",")), CONVERSATIONS.format(select=select, group=group, where=where)
    conversations = {
        tuple(values[:width]): dict(zip(("conversations", "shortened_conversations"), values[width:]))
        for values in con.execute(counted, params or {}).fetchall()
    }
    return [_stats(g | conversations[tuple(g.values())[:width]]) for g in groups]


def _bucket_sql(edges: tuple[int, ...]) -> tuple[str, list[str]]:
    """A CASE giving each prompt_tokens its bucket index, and the bucket labels: 0-511, 512-1023, ..., 8192+."""
    whens = " ".join(f"WHEN prompt_tokens < {e} THEN {i}" for i, e in enumerate(edges))
    lows = (0, *edges)
    labels = [f"{lo}-{hi - 1}" for lo, hi in zip(lows, edges)] + [f"{edges[-1]}+"]
    return f"CASE {whens} ELSE {len(edges)} END", labels


def length_quality(
    data_dir: str | Path,
    shard: str | None = None,
    max_length: int = TrainerSettings().max_length,
    prompt_buckets: tuple[int, ...] = PROMPT_BUCKETS,
    runaway: RunawaySettings = RunawaySettings(),
    config_hash: str | None = None,
) -> dict[str, Any]:
    """Rows, truncation rate and completion-token P50/P90/P95/P99/max of one config (`config_hash`; None: all
    configs pooled, labelled so), overall and by shard, prompt length bucket, source and turn, plus overflow counts;
    `by_config` lists every config side by side. `shard=None`: the summary over all shards.
    """
    with open_quality_db(data_dir, shard, runaway=runaway, max_length=max_length) as con:
        return length_quality_of(con, shard, max_length, prompt_buckets, config_hash)


def length_quality_of(
    con: duckdb.DuckDBPyConnection,
    shard: str | None,
    max_length: int,
    prompt_buckets: tuple[int, ...] = PROMPT_BUCKETS,
    config_hash: str | None = None,
) -> dict[str, Any]:
    """`length_quality` of a database open_quality_db opened for `shard` and `max_length` (which another reader
    of the same rows, the histogram, can share)."""
    of = "true" if config_hash is None else "config_hash = $config"
    params = {} if config_hash is None else {"config": config_hash}
    grouped = lambda select, group, extra="", where="true": _grouped(  # noqa: E731 - the config's rows only
        con, select, group, extra, f"({where}) AND {of}", params
    )
    overall = [{k: v for k, v in g.items() if k != "whole"} for g in grouped("1 AS whole", "whole")]
    bucket_case, labels = _bucket_sql(prompt_buckets)
    buckets = grouped(f"{bucket_case} AS bucket", "bucket")
    for b in buckets:
        b["bucket"] = labels[b["bucket"]]
    completion_over, over_max_length = one(
        con,
        f"SELECT count(*) FILTER (WHERE {OVERFLOW_SQL}), "
        f"count(*) FILTER (WHERE prompt_tokens + completion_tokens > judged_window) FROM completions WHERE {of}",
        params,
    )
    max_length = judged_window(con, max_length)[0]  # a window-policy config's own, when it is the whole scope
    rejects_over = one(
        con,
        f"SELECT count(*) FROM (SELECT DISTINCT shard, prompt_id, config_hash FROM rejects "
        f"WHERE (stage <> 'source' AND {OVERFLOW_SQL} AND {of}) OR (stage = 'source' AND {PROMPT_OVER_CONTEXT_SQL}))",
        params,
    )[0]
    return {
        "scope": {"shard": shard, "config_hash": config_hash},
        # whose figures the headline, the buckets, sources, turns, shards and overflows are: None is all configs
        "config_hash": config_hash,
        "config_label": f"config {config_hash}" if config_hash else "all configs",
        "percentile_definition": PERCENTILE_DEFINITION,
        **(overall[0] if overall else asdict(LengthStats()) | LengthStats().rates),
        "max_length": max_length,
        "by_config": _grouped(
            con,
            "config_hash, config_cap",
            CONFIG,
            ", count(DISTINCT shard) AS shards, bool_or(window_policy) AS window_policy",
        ),
        "by_shard": grouped(
            "shard", "shard", ", string_agg(DISTINCT config_hash, ',' ORDER BY config_hash) AS configs"
        ),
        "by_prompt_length": buckets,
        "by_source": grouped("source", "source"),
        # regenerate: all_turns: turn k of every conversation (empty when every row is one per prompt)
        "by_turn": grouped("turn", "turn", where="turn IS NOT NULL"),
        "overflow": {
            "completion_rows_over_context": completion_over,
            "rejected_prompts_over_context": rejects_over,
            "rows_over_max_length": over_max_length,
            "max_length": max_length,
        },
    }
