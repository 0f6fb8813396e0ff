"""Checks on lengths: did the cap cut completions, does it fit the context, will the trainer cut the rows."""

import duckdb

from dflash_assets.quality.outcome import Finding, MetadataValue, Thresholds, bullets, config_label, num, pct, share
from dflash_assets.quality.rates import group_counts, group_line, rate_finding, totals, worst_first

LENGTH = "finish_reason = 'length'"


def truncation_rate(con: duckdb.DuckDBPyConnection, t: Thresholds) -> Finding:
    """Share of rows with finish_reason = 'length', judged per config and per shard (any group over fails)."""
    configs = group_counts(con, LENGTH, by="config")
    shards = group_counts(con, LENGTH, by="shard")
    rows, truncated = totals(configs)
    rate, limit = share(truncated, rows), t.truncation_rate_max
    configs_over = [g for g in worst_first(configs) if g.rate > limit]
    shards_over = [g for g in worst_first(shards) if g.rate > limit]
    over = "over" if rate > limit else "within"
    lines = [f"**{pct(rate)}** of {num(rows)} rows hit the cap (finish_reason = 'length'), {over} the {pct(limit)} threshold."]
    if configs_over:
        lines.append("Configs over the threshold:\n" + bullets([group_line(g) for g in configs_over]))
    if shards_over:
        lines.append("Shards over the threshold:\n" + bullets([group_line(g) for g in shards_over]))
    if configs_over or shards_over:
        lines.append(
            "Truncated rows are the hardest prompts, the most valuable ones: raise max_output_tokens and "
            "regenerate them (check context_overflow first)."
        )
    metadata: dict[str, MetadataValue] = {
        "rows": rows,
        "truncated_rows": truncated,
        "truncation_rate": rate,
        "threshold": limit,
        "configs_over_threshold": len(configs_over),
        "shards_over_threshold": len(shards_over),
    }
    for kind, groups in (("config", configs), ("shard", shards)):
        if groups:
            worst = worst_first(groups)[0]
            metadata[f"worst_{kind}"] = worst.key
            metadata[f"worst_{kind}_rate"] = worst.rate
    return Finding(not configs_over and not shards_over, "\n\n".join(lines), metadata)


def cap_saturation(con: duckdb.DuckDBPyConnection, t: Thresholds) -> Finding:
    """A high percentile of completion_tokens equal to the cap is the tell-tale of a cap too low for the prompts.

    Percentiles are nearest-rank (DuckDB quantile_disc): Pq is the value at 1-based rank ceil(q * n) of the
    sorted completion_tokens, always an observed value, so when more than 10% of rows stop at the cap,
    P90 = P99 = the cap exactly, as in the story.
    """
    q = t.cap_saturation_percentile
    result = con.execute(
        "SELECT config_hash, max_output_tokens, count(*), "
        "quantile_disc(completion_tokens, [0.5, 0.9, 0.99, $q]) FROM completions "
        "GROUP BY ALL ORDER BY config_hash, max_output_tokens",
        {"q": q},
    ).fetchall()
    metadata: dict[str, MetadataValue] = {"configs": len(result), "percentile": q}
    lines, saturated = [], []
    for config_hash, cap, rows, (p50, p90, p99, pq) in result:
        key = f"{config_hash}/{cap}"
        metadata.update({f"{key} p50": p50, f"{key} p90": p90, f"{key} p99": p99, f"{key} cap": cap})
        line = (
            f"{config_label(config_hash, cap)}: P50 {num(p50)}, P90 {num(p90)}, P99 {num(p99)} "
            f"over {num(rows)} rows"
        )
        if cap is not None and pq >= cap:
            saturated.append(key)
            line += f"; **P{q * 100:g} reaches the cap {num(cap)}**"
        lines.append(line)
    metadata["saturated_configs"] = len(saturated)
    head = (
        f"P{q * 100:g} of completion_tokens reaches the cap in {len(saturated)} of {len(result)} configs: "
        "at least that share of completions stopped at the cap, not at an answer; raise max_output_tokens."
        if saturated
        else f"P{q * 100:g} of completion_tokens is below the cap in every config ({len(result)})."
    )
    return Finding(not saturated, head + ("\n\n" + bullets(lines) if lines else ""), metadata)


def cap_hit_agreement(con: duckdb.DuckDBPyConnection, t: Thresholds) -> Finding:
    """`completion_tokens >= max_output_tokens` must agree with finish_reason = 'length', both ways.

    'length' below the cap means the server cut earlier than asked (a silent clamp to its context length);
    at the cap but not 'length' means the finish reason or the token count is wrong (a parser or usage bug).
    """
    at_cap_not_length = f"completion_tokens >= max_output_tokens AND finish_reason IS DISTINCT FROM 'length'"
    length_under_cap = f"{LENGTH} AND completion_tokens < max_output_tokens"
    a = group_counts(con, at_cap_not_length)
    b = group_counts(con, length_under_cap)
    both = group_counts(con, f"({at_cap_not_length}) OR ({length_under_cap})")
    finding = rate_finding(
        "mismatch",
        "disagree between completion_tokens >= max_output_tokens and finish_reason = 'length'",
        both,
        t.cap_mismatch_rate_max,
    )
    n_a, n_b = totals(a)[1], totals(b)[1]
    detail = (
        f"{num(n_a)} rows reached the cap without finish_reason 'length'; "
        f"{num(n_b)} rows finished 'length' below the cap (the server cut them short: a silent clamp?)."
    )
    metadata = finding.metadata | {"at_cap_not_length_rows": n_a, "length_under_cap_rows": n_b}
    return Finding(finding.passed, finding.summary_md + "\n\n" + detail, metadata)


def max_length_overflow(con: duckdb.DuckDBPyConnection, t: Thresholds) -> Finding:
    """Share of rows whose prompt_tokens + completion_tokens exceed the trainer's max_length: it cuts them."""
    over = f"prompt_tokens + completion_tokens > {int(t.training_max_length)}"
    finding = rate_finding(
        "over_max_length",
        f"exceed the trainer's max_length {num(t.training_max_length)} (prompt_tokens + completion_tokens)",
        group_counts(con, over),
        t.max_length_overflow_rate_max,
        why="The trainer truncates these rows: raise its max_length or expect their tails to be lost.",
    )
    stop_rows, stop_over = totals(group_counts(con, over, among_sql="finish_reason = 'stop'"))
    metadata = finding.metadata | {
        "max_length": t.training_max_length,
        "stop_rows": stop_rows,
        "stop_over_max_length_rows": stop_over,
    }
    return Finding(finding.passed, finding.summary_md, metadata)
