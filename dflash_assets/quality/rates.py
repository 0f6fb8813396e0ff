"""The common shape of most checks: count the rows that match a defect, per config or per shard, judge the share."""

from dataclasses import dataclass

import duckdb

from dflash_assets.quality.outcome import Finding, MetadataValue, bullets, config_label, num, pct, share, verdict

GROUPINGS = {
    # a config is a (config_hash, max_output_tokens) pair: a hash that maps to two caps shows up as two configs
    "config": ("config_hash, max_output_tokens", "config_hash, max_output_tokens"),
    "shard": ("shard", "shard"),
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


def group_counts(
    con: duckdb.DuckDBPyConnection, hit_sql: str, among_sql: str = "TRUE", by: str = "config"
) -> list[GroupCount]:
    """Per group: rows satisfying `among_sql`, and how many of them satisfy `hit_sql`; groups in name order."""
    cols, order = GROUPINGS[by]
    result = con.execute(
        f"SELECT {cols}, count(*), count(*) FILTER (WHERE {hit_sql}) FROM completions "
        f"WHERE {among_sql} GROUP BY {cols} ORDER BY {order}"
    ).fetchall()
    if by == "config":
        return [GroupCount(config_label(h, cap), f"{h}/{cap}", rows, hits) for h, cap, rows, hits in result]
    return [GroupCount(f"shard `{s}`", str(s), rows, hits) for s, rows, hits in result]


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

    `metric` names the metadata keys (`<metric>_rows`, `<metric>_rate`), `what` completes the sentence
    "N of M rows (x%) ...", `why` is appended when the check fails to say what it means and what to change.
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
