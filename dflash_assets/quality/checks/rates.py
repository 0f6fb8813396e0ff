"""The common shape of most checks: count the rows that match a defect (ROW_PREDICATES), per config or per shard, and
judge the share. The first count builds a `facts` temp table of each predicate's count per (shard, config_hash,
config_cap) in one scan; every later count is a roll-up of it.
"""

from dataclasses import dataclass

import duckdb

from dflash_assets.quality.outcome import Finding, MetadataValue, bullets, config_label, num, pct, share, verdict
from dflash_assets.rules import STOPPED_EARLY_SQL

_TRUNCATED_THINKING = "finish_reason = 'length' AND NOT reasoning_empty AND content_empty"
_AT_CAP_NOT_LENGTH = "completion_tokens >= max_output_tokens AND finish_reason IS DISTINCT FROM 'length'"
_LENGTH_UNDER_CAP = "finish_reason = 'length' AND completion_tokens < max_output_tokens"
ROW_PREDICATES = {
    "rows": "TRUE",
    "truncated": "finish_reason = 'length'",
    # judged against the trainer's window (rules.py, flags of tables.py): the blocking truncation, and the cut rows
    # the trainer reads as it reads a complete answer
    "cut_inside_window": "cut_inside_window",
    "window_complete": "window_complete",
    "runaway": "runaway",  # cut while repeating itself: at the cap (in truncated) or stopped early (generation/runaway.py)
    "runaway_stopped": STOPPED_EARLY_SQL,  # stopped while streaming, short of the cap (rules.RUNAWAY_FINISH)
    # the cap and the finish reason must agree: at the cap but not 'length', or 'length' below the cap
    "at_cap_not_length": _AT_CAP_NOT_LENGTH,
    "length_under_cap": _LENGTH_UNDER_CAP,
    "cap_mismatch": f"({_AT_CAP_NOT_LENGTH}) OR ({_LENGTH_UNDER_CAP})",
    # the cap cut the thinking: everything went to reasoning_content, content is "" (SGLang's split on `length`)
    "truncated_thinking": _TRUNCATED_THINKING,
    "empty_content": f"content_empty AND NOT ({_TRUNCATED_THINKING})",
    "think_marker": "think_marker",
    "thinking": "enable_thinking",
    # truncated thinking routed into content: no reasoning_content, content non-empty (a parser failure)
    "misrouted": "enable_thinking AND finish_reason = 'length' AND reasoning_empty AND NOT content_empty",
}
GROUPINGS = {
    # a config is a (config_hash, config_cap) pair: a hash that maps to two caps shows up as two configs
    # (config_cap is the config's cap; under the window policy each row's max_output_tokens is its request cap)
    "config": "config_hash, config_cap",
    "shard": "shard",
}


@dataclass(frozen=True)
class GroupCount:
    label: str  # Markdown name of the group: config `a1b2c3` (max_output_tokens 4096), shard `s1`
    key: str  # plain name for metadata: a1b2c3/4096, s1
    rows: int
    hits: int

    @property
    def rate(self) -> float:
        return share(self.hits, self.rows)


def _ensure_facts(con: duckdb.DuckDBPyConnection) -> None:
    counts = ", ".join(f"count(*) FILTER (WHERE {sql}) AS {name}" for name, sql in ROW_PREDICATES.items())
    con.execute(
        f"CREATE TEMP TABLE IF NOT EXISTS facts AS SELECT shard, config_hash, config_cap, "
        f"{counts} FROM completions GROUP BY ALL"
    )


def group_counts(con: duckdb.DuckDBPyConnection, hits: str, rows: str = "rows", by: str = "config") -> list[GroupCount]:
    """Per group (in name order): rows matching predicate `rows` and how many of them match `hits`.

    `hits` must imply `rows` (misrouted implies thinking); groups with no `rows` are left out.
    """
    _ensure_facts(con)
    cols = GROUPINGS[by]
    result = con.execute(
        f"SELECT {cols}, sum({rows})::BIGINT, sum({hits})::BIGINT FROM facts "
        f"GROUP BY {cols} HAVING sum({rows}) > 0 ORDER BY {cols}"
    ).fetchall()
    if by == "config":
        return [GroupCount(config_label(h, cap), f"{h}/{cap}", n, k) for h, cap, n, k in result]
    return [GroupCount(f"shard `{s}`", str(s), n, k) for s, n, k in result]


def totals(groups: list[GroupCount]) -> tuple[int, int]:
    return sum(g.rows for g in groups), sum(g.hits for g in groups)


def group_line(g: GroupCount, noun: str = "rows") -> str:
    return f"{g.label}: {num(g.hits)} of {num(g.rows)} {noun} ({pct(g.rate)})"


def worst_first(groups: list[GroupCount]) -> list[GroupCount]:
    return sorted(groups, key=lambda g: (-g.rate, g.key))


def rate_finding(
    metric: str, what: str, groups: list[GroupCount], limit: float, why: str = "", noun: str = "rows"
) -> Finding:
    """Judge the overall share of `groups` (per config) against `limit`; list every config with a hit.

    `metric` names the metadata keys (`<metric>_rows`, `<metric>_rate`), `what` completes "N of M rows (x%) ...",
    `why` says, when it fails, what it means and what to change.
    """
    rows, hits = totals(groups)
    rate = share(hits, rows)
    passed = rate <= limit
    lines = [f"{num(hits)} of {num(rows)} {noun} ({pct(rate)}) {what}, {verdict(rate, limit)}."]
    hit_groups = [group_line(g, noun) for g in worst_first(groups) if g.hits]
    if hit_groups:
        lines.append(bullets(hit_groups))
    if not passed and why:
        lines.append(why)
    metadata: dict[str, MetadataValue] = {
        "rows": rows,  # the denominator: the rows the share is taken over
        f"{metric}_rows": hits,
        f"{metric}_rate": rate,
        "threshold": limit,
    }
    return Finding(passed, "\n\n".join(lines), metadata)
