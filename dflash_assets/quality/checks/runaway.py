"""Runaway generations: rows the cap cut while they were repeating themselves (generation/runaway.py says how that is told)."""

import duckdb

from dflash_assets.quality.checks.rates import group_counts, group_line, totals, worst_first
from dflash_assets.quality.outcome import Finding, MetadataValue, bullets, num, pct, share, verdict
from dflash_assets.settings import QualitySettings


def runaway_rate(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Share of rows cut while looping (the tail repeats itself), per config and per shard: at the cap, or stopped
    early while streaming (finish_reason 'runaway', short of the cap).

    A larger cap only makes a runaway longer (generation/runaway.py): the cap planner leaves them out of its tail.
    """
    configs = group_counts(con, "runaway", by="config")
    shards = group_counts(con, "runaway", by="shard")
    rows, runaways = totals(configs)
    stopped = totals(group_counts(con, "runaway_stopped", by="config"))[1]
    truncated = totals(group_counts(con, "truncated", by="config"))[1] + stopped  # cut at the cap, or stopped
    honest = truncated - runaways  # the cap's cuts that do not loop
    rate, limit = share(runaways, rows), quality.runaway_rate_max
    over = [g for g in worst_first(configs) if g.rate > limit] + [g for g in worst_first(shards) if g.rate > limit]
    lines = [
        f"**{pct(rate)}** of {num(rows)} rows ({num(runaways)}) were cut at the cap while repeating themselves "
        f"(runaways), {verdict(rate, limit)}; {num(honest)} other rows were cut honestly."
    ]
    if stopped:
        lines[0] = lines[0].replace(" were cut at the cap while", " were cut while", 1)
        lines.append(
            f"{num(stopped)} of the runaways were stopped while streaming, before the cap "
            f"(finish_reason 'runaway'): they cost only the tokens decoded until the loop was seen."
        )
    if over:
        lines.append(bullets([group_line(g) for g in over]))
        lines.append(
            "A runaway loops to any cap: raising max_output_tokens only makes it longer. Look at the "
            "sampling settings (temperature, repetition/presence penalty) or drop these rows; the cap plan "
            "counts them apart from the tail."
        )
    metadata: dict[str, MetadataValue] = {
        "rows": rows,
        "runaway_rows": runaways,
        "runaway_rate": rate,
        "truncated_rows": truncated,
        "honest_truncated_rows": honest,
        "runaway_stopped_rows": stopped,
        "threshold": limit,
    }
    for kind, groups in (("config", configs), ("shard", shards)):
        if groups:
            worst = worst_first(groups)[0]
            metadata[f"worst_{kind}"] = worst.key
            metadata[f"worst_{kind}_rate"] = worst.rate
    return Finding(not over, "\n\n".join(lines), metadata)
