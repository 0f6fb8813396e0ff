"""Checks on lengths: did the cap cut completions, does it fit the context, will the trainer cut the rows."""

import duckdb

from dflash_assets.quality.checks.rates import GroupCount, group_counts, group_line, rate_finding, totals, worst_first
from dflash_assets.quality.outcome import (
    Finding,
    MetadataValue,
    bullets,
    config_label,
    num,
    pct,
    plural,
    share,
    verdict,
)
from dflash_assets.quality.tables import judged_window, one
from dflash_assets.rules import percentile_sql
from dflash_assets.settings import QualitySettings


def truncation_rate(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Share of rows cut inside the trainer's window (finish_reason = 'length' and prompt + completion <
    max_length: the trainer reads an end the model did not choose), judged per config and per shard (any group
    over fails). Rows cut at or past the window are window-complete: counted beside it, never over the limit.
    A window-policy config is judged by the window its rows recorded (tables.judged_window), and says so."""
    window, recorded = judged_window(con, quality.trainer.max_length)
    configs = group_counts(con, "cut_inside_window", by="config")
    shards = group_counts(con, "cut_inside_window", by="shard")
    rows, inside = totals(configs)
    cut = totals(group_counts(con, "truncated"))[1]
    complete = totals(group_counts(con, "window_complete"))[1]
    rate, limit = share(inside, rows), quality.truncation_rate_max
    configs_over = [g for g in worst_first(configs) if g.rate > limit]
    shards_over = [g for g in worst_first(shards) if g.rate > limit]
    lines = [
        f"**{pct(rate)}** of {num(rows)} rows were cut inside the trainer's window max_length {num(window)} "
        f"(finish_reason = 'length', prompt + completion < {num(window)}), {verdict(rate, limit)}; "
        f"{plural(complete, 'row')} ({pct(share(complete, rows))}) were cut at or past it: window-complete, "
        f"read by the trainer as a complete answer is. {pct(share(cut, rows))} hit the cap in all.",
        recorded or f"The window is {quality.trainer.named()}.",
    ]
    if configs_over:
        lines.append("Configs over the threshold:\n" + bullets([group_line(g) for g in configs_over]))
    if shards_over:
        lines.append("Shards over the threshold:\n" + bullets([group_line(g) for g in shards_over]))
    if configs_over or shards_over:
        lines.append(
            "Rows cut inside the window are the hardest prompts, the most valuable ones: raise max_output_tokens "
            "and continue them (check context_overflow first), or size the requests to the window "
            "(cap_policy window)."
        )
    metadata: dict[str, MetadataValue] = {
        "rows": rows,
        "max_length": window,
        "cut_inside_window_rows": inside,
        "cut_inside_window_rate": rate,
        "window_complete_rows": complete,
        "window_complete_rate": share(complete, rows),
        "truncated_rows": cut,
        "truncation_rate": share(cut, rows),
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


def decoded_past_window(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Decoded tokens past the trainer's window, which no training step reads, beside the rows cut at or past it
    (window-complete: exported, the trainer reads them whole); warns when the tokens past the window exceed
    decoded_past_window_rate_max of all decoded tokens (a cap larger than the window needs: cap_policy window
    decodes only what is read). Formerly window_complete (severity overrides may still name it)."""
    window, recorded = judged_window(con, quality.trainer.max_length)
    rows, complete, complete_tokens, decoded, trained = one(
        con,
        "SELECT count(*), count(*) FILTER (WHERE window_complete), "
        "coalesce(sum(trained_tokens) FILTER (WHERE window_complete), 0), "
        "coalesce(sum(completion_tokens), 0), coalesce(sum(trained_tokens), 0) FROM completions",
    )
    past = decoded - trained
    rate, limit = share(past, decoded), quality.decoded_past_window_rate_max
    ratio = f"{decoded / trained:.2f}" if trained else "-"
    lines = [
        f"{num(past)} of {num(decoded)} decoded tokens ({pct(rate)}) lie past the trainer's window max_length "
        f"{num(window)}, {verdict(rate, limit)}; decoded per trained token {ratio} (the floor is 1.00). "
        f"{plural(complete, 'row')} ({pct(share(complete, rows))} of {num(rows)}) were cut at or past the window: "
        f"window-complete, exported, {num(complete_tokens)} trained tokens.",
        recorded or f"The window is {quality.trainer.named()}.",
    ]
    if rate > limit:
        lines.append(
            "Those tokens cost GPU time and no training step reads them: generate with cap_policy window "
            f"(--cap-policy window --trainer-max-length {window}) to ask each request only for what the "
            "window reads."
        )
    metadata: dict[str, MetadataValue] = {
        "rows": rows,
        "max_length": window,
        "window_complete_rows": complete,
        "window_complete_rate": share(complete, rows),
        "window_complete_trained_tokens": int(complete_tokens),
        "decoded_tokens": int(decoded),
        "trained_tokens": int(trained),
        "decoded_past_window_tokens": int(past),
        "past_window_rate": rate,
        "threshold": limit,
    }
    return Finding(rate <= limit, "\n\n".join(lines), metadata)


def cap_saturation(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """A high percentile of completion_tokens equal to the cap is the tell-tale of a cap too low for the prompts.

    Percentiles are nearest-rank (rules.PERCENTILE_DEFINITION): Pq reaching the cap means more than (1 - q) of rows
    did.
    """
    q = quality.cap_saturation_percentile
    result = con.execute(
        "SELECT config_hash, config_cap, count(*), "
        "count(*) FILTER (WHERE completion_tokens >= max_output_tokens), "
        f"{percentile_sql('completion_tokens', (0.5, 0.9, 0.99, '$q'))} "
        "FROM completions GROUP BY config_hash, config_cap ORDER BY config_hash, config_cap",
        {"q": q},
    ).fetchall()
    metadata: dict[str, MetadataValue] = {"configs": len(result), "percentile": q}
    lines, saturated = [], []
    for config_hash, cap, rows, at_cap, (p50, p90, p99, pq) in result:
        key = f"{config_hash}/{cap}"
        metadata.update({f"{key} p50": p50, f"{key} p90": p90, f"{key} p99": p99, f"{key} cap": cap})
        line = (
            f"{config_label(config_hash, cap)}: P50 {num(p50)}, P90 {num(p90)}, P99 {num(p99)} "
            f"over {num(rows)} rows, {num(at_cap)} ({pct(share(at_cap, rows))}) at the cap"
        )
        if cap is not None and pq >= cap:
            saturated.append(key)
            line += f"; **P{q * 100:g} reaches the cap {num(cap)}**"
        lines.append(line)
    metadata["saturated_configs"] = len(saturated)
    name, configs = f"P{q * 100:g}", plural(len(result), "config")
    head = (
        f"{name} of completion_tokens reaches the cap in {len(saturated)} of {configs}: there, more than "
        f"{pct(1 - q)} of completions stopped at the cap rather than at an answer; raise max_output_tokens."
        if saturated
        else f"{name} of completion_tokens is below the cap in every config ({configs})."
    )
    return Finding(not saturated, head + ("\n\n" + bullets(lines) if lines else ""), metadata)


def cap_hit_agreement(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """`completion_tokens >= max_output_tokens` must agree with finish_reason = 'length', both ways.

    'length' below the cap means the server cut earlier than asked (a silent clamp to its context length);
    at the cap but not 'length' means the finish reason or the token count is wrong (a parser or usage bug).
    """
    both = group_counts(con, "cap_mismatch")
    finding = rate_finding(
        "mismatch",
        "disagree between completion_tokens >= max_output_tokens and finish_reason = 'length'",
        both,
        quality.cap_hit_agreement_rate_max,
    )
    n_a, n_b = totals(group_counts(con, "at_cap_not_length"))[1], totals(group_counts(con, "length_under_cap"))[1]
    detail = (
        f"{plural(n_a, 'row')} reached the cap without finish_reason 'length'; "
        f"{plural(n_b, 'row')} finished 'length' below the cap (the server cut them short: a silent clamp?)."
    )
    metadata = finding.metadata | {"at_cap_not_length_rows": n_a, "length_under_cap_rows": n_b}
    return Finding(finding.passed, finding.summary_md + ("\n\n" + detail if n_a or n_b else ""), metadata)


def silent_clamp(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Rows that finished 'length' below their own max_output_tokens: a cap nobody asked for.

    SGLang 0.5.23's scheduler lowers max_new_tokens to max_req_len - prompt - 1 without an error (preflight.py).
    """
    return rate_finding(
        "clamped",
        "finished 'length' below their max_output_tokens (the server cut them short)",
        group_counts(con, "length_under_cap"),
        quality.silent_clamp_rate_max,
        why="These rows record a cap they did not get: the server's KV pool (/server_info max_total_num_tokens) "
        "or context length was smaller than prompt + max_output_tokens. Regenerate them on servers whose "
        "max_req_input_len + 5 covers prompt + max_output_tokens + 1.",
    )


def max_length_overflow(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Share of rows whose prompt_tokens + completion_tokens exceed the trainer's max_length: it cuts them."""
    window, recorded = judged_window(con, quality.trainer.max_length)
    result = con.execute(
        "SELECT config_hash, config_cap, count(*), count(*) FILTER (WHERE over), "
        "count(*) FILTER (WHERE finish_reason = 'stop'), count(*) FILTER (WHERE finish_reason = 'stop' AND over) "
        "FROM (SELECT *, prompt_tokens + completion_tokens > judged_window AS over FROM completions) "
        "GROUP BY config_hash, config_cap ORDER BY config_hash, config_cap"
    ).fetchall()
    finding = rate_finding(
        "over_max_length",
        f"exceed the trainer's window max_length {num(window)} (prompt_tokens + completion_tokens)",
        [GroupCount(config_label(h, cap), f"{h}/{cap}", rows, over) for h, cap, rows, over, _, _ in result],
        quality.max_length_overflow_rate_max,
        why="The trainer truncates these rows: raise its max_length or expect their tails to be lost. "
        + (recorded or f"The window is {quality.trainer.named()}."),
    )
    metadata = finding.metadata | {
        "max_length": window,
        "stop_rows": sum(r[4] for r in result),  # the rows that can reach training
        "stop_over_max_length_rows": sum(r[5] for r in result),
    }
    return Finding(finding.passed, finding.summary_md, metadata)
