"""Runaway generations: rows the cap cut while they were repeating themselves (runaway.py says how that is told)."""

import duckdb

from dflash_assets.quality.outcome import Finding, MetadataValue, Thresholds, bullets, num, pct, share, verdict
from dflash_assets.quality.rates import group_counts, group_line, totals, worst_first


def runaway_rate(con: duckdb.DuckDBPyConnection, t: Thresholds) -> Finding:
    """Share of rows cut at the cap while looping (the tail repeats itself), per config and per shard.

    A runaway is not a long answer: a larger cap only makes it longer. They are counted apart from honest
    truncation, and the cap planner leaves them out of the tail it extrapolates.
    """
    configs = group_counts(con, "runaway", by="config")
    shards = group_counts(con, "runaway", by="shard")
    rows, runaways = totals(configs)
    truncated = totals(group_counts(con, "truncated", by="config"))[1]
    rate, limit = share(runaways, rows), t.runaway_rate_max
    over = [g for g in worst_first(configs) if g.rate > limit] + [g for g in worst_first(shards) if g.rate > limit]
    lines = [f"**{pct(rate)}** of {num(rows)} rows ({num(runaways)}) were cut at the cap while repeating themselves "
             f"(runaways), {verdict(rate, limit)}; {num(truncated - runaways)} other rows were cut honestly."]
    if over:
        lines.append(bullets([group_line(g) for g in over]))
        lines.append("A runaway loops to any cap: raising max_output_tokens only makes it longer. Look at the "
                     "sampling settings (temperature, repetition/presence penalty) or drop these rows; the cap plan "
                     "counts them apart from the tail.")
    metadata: dict[str, MetadataValue] = {
        "rows": rows,
        "runaway_rows": runaways,
        "runaway_rate": rate,
        "truncated_rows": truncated,
        "honest_truncated_rows": truncated - runaways,
        "threshold": limit,
    }
    for kind, groups in (("config", configs), ("shard", shards)):
        if groups:
            worst = worst_first(groups)[0]
            metadata[f"worst_{kind}"] = worst.key
            metadata[f"worst_{kind}_rate"] = worst.rate
    return Finding(not over, "\n\n".join(lines), metadata)
