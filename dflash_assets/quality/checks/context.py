"""Context overflow (rules.OVERFLOW_SQL), in completions and in rejects: a completion row that overflows was generated
under a budget it did not get, and a config whose prompts are mostly rejected leaves a hole in the data.
"""

import duckdb

from dflash_assets.quality.outcome import Finding, MetadataValue, bullets, num, pct, share
from dflash_assets.rules import OVERFLOW_SQL
from dflash_assets.settings import QualitySettings

PER_CONFIG = f"""
WITH a AS (
    SELECT config_hash, count(*) AS attempted FROM outcomes GROUP BY ALL
), c AS (
    SELECT config_hash, count(*) AS rows, count(*) FILTER (WHERE {OVERFLOW_SQL}) AS over_rows,
           max(server_context_length) FILTER (WHERE {OVERFLOW_SQL}) AS over_context
    FROM completions GROUP BY ALL
), r AS (
    SELECT config_hash, count(*) AS over_prompts, max(context) AS over_context
    FROM (SELECT config_hash, shard, prompt_id, max(server_context_length) AS context
          FROM rejects WHERE stage <> 'source' AND {OVERFLOW_SQL} GROUP BY ALL)
    GROUP BY ALL
), caps AS (
    SELECT config_hash, list(DISTINCT max_output_tokens ORDER BY max_output_tokens) AS caps FROM (
        SELECT config_hash, max_output_tokens FROM completions
        UNION ALL SELECT config_hash, max_output_tokens FROM rejects WHERE stage <> 'source'
    ) GROUP BY ALL
)
SELECT a.config_hash, coalesce(caps.caps, []), a.attempted, coalesce(c.rows, 0), coalesce(c.over_rows, 0),
       c.over_context, coalesce(r.over_prompts, 0), r.over_context
FROM a LEFT JOIN c USING (config_hash) LEFT JOIN r USING (config_hash) LEFT JOIN caps USING (config_hash)
ORDER BY a.config_hash
"""


def context_overflow(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Fails when any config has completion rows over the context (share > context_overflow_rate_max) or
    rejects more of its attempted prompts for overflow than context_overflow_reject_rate_max.

    A config's attempted prompts are its outcomes (rules.outcomes_sql); a reject overflows by its recorded numbers.
    """
    result = con.execute(PER_CONFIG).fetchall()
    lines: list[str] = []
    failing = 0
    sums = {"attempted": 0, "rows": 0, "over_rows": 0, "over_prompts": 0}
    for config_hash, caps, attempted, rows, over_rows, over_ctx, over_prompts, rej_ctx in result:
        label = f"config `{config_hash}` (max_output_tokens {'/'.join(str(c) for c in caps)})"
        for key, value in zip(sums, (attempted, rows, over_rows, over_prompts)):
            sums[key] += value
        bad_rows = share(over_rows, rows) > quality.context_overflow_rate_max
        bad_rejects = share(over_prompts, attempted) > quality.context_overflow_reject_rate_max
        failing += bad_rows or bad_rejects
        if over_prompts:
            lines.append(
                f"{label}: {num(over_prompts)} of {num(attempted)} attempted prompts "
                f"({pct(share(over_prompts, attempted))}) rejected because {OVERFLOW_SQL} "
                f"(context up to {num(rej_ctx)}); lower max_output_tokens or raise the server's "
                "--context-length."
            )
        if over_rows:
            lines.append(
                f"{label}: {num(over_rows)} of {num(rows)} completion rows ({pct(share(over_rows, rows))}) were "
                f"generated with {OVERFLOW_SQL} (context up to {num(over_ctx)}): "
                "the server clamped them silently or preflight did not run."
            )
    head = (
        f"{num(sums['over_rows'])} completion rows and {num(sums['over_prompts'])} rejected prompts have "
        f"{OVERFLOW_SQL}; {failing} of {len(result)} configs fail "
        f"(limits: {pct(quality.context_overflow_rate_max)} of completion rows, "
        f"{pct(quality.context_overflow_reject_rate_max)} of attempted prompts rejected)."
    )
    metadata: dict[str, MetadataValue] = {
        "configs": len(result),
        "failing_configs": failing,
        "attempted_prompts": sums["attempted"],
        "rows": sums["rows"],
        "completion_overflow_rows": sums["over_rows"],
        "completion_overflow_rate": share(sums["over_rows"], sums["rows"]),
        "rejected_overflow_prompts": sums["over_prompts"],
        "rejected_overflow_rate": share(sums["over_prompts"], sums["attempted"]),
        "threshold_completion_rows": quality.context_overflow_rate_max,
        "threshold_rejected_prompts": quality.context_overflow_reject_rate_max,
    }
    # regenerate: all_turns preflights each turn when it is sent: which turn of a conversation did not fit
    by_turn = con.execute(
        f"SELECT turn, count(*) FROM rejects WHERE stage <> 'source' AND turn IS NOT NULL "
        f"AND {OVERFLOW_SQL} GROUP BY ALL ORDER BY turn"
    ).fetchall()
    if by_turn:
        metadata["rejected_overflow_by_turn"] = ", ".join(f"turn {k}: {num(n)}" for k, n in by_turn)
        lines.append(f"overflow rejects by turn: {metadata['rejected_overflow_by_turn']}")
    return Finding(failing == 0, head + ("\n\n" + bullets(lines) if lines else ""), metadata)
