"""Accounting: every prompt of a shard ends up completed, rejected or failed under each config, none missing."""

import json
from dataclasses import asdict, dataclass

import duckdb

from dflash_assets.quality.outcome import Finding, MetadataValue, bullets, num, pct, plural, share
from dflash_assets.settings import QualitySettings

SUPERSEDED_COUNTS = "superseded_counts"  # metadata: JSON list of each superseded config's fields (Superseded)

PER_PAIR = """
WITH source_rejects AS (
    SELECT shard, count(*) AS n FROM rejects WHERE stage = 'source' GROUP BY ALL
), prompt_rows AS (
    SELECT shard, count(*) AS n FROM prompts GROUP BY ALL
), shards AS (
    SELECT shard FROM prompt_rows UNION SELECT shard FROM rejects UNION SELECT shard FROM outcomes
), every_outcome AS (
    SELECT * FROM outcomes UNION ALL SELECT * FROM other_outcomes
), pairs AS (
    SELECT DISTINCT s.shard, coalesce(getvariable('scope_config'), o.config_hash) AS config_hash, true AS judged
    FROM shards s LEFT JOIN (SELECT DISTINCT shard, config_hash FROM outcomes) o
        ON o.shard = s.shard AND getvariable('scope_config') IS NULL
    UNION ALL SELECT DISTINCT shard, config_hash, false FROM other_outcomes
), classified AS (
    SELECT shard, config_hash,
        count(*) FILTER (WHERE known AND outcome = 1) AS completed,
        count(*) FILTER (WHERE known AND outcome = 2) AS rejected,
        count(*) FILTER (WHERE known AND outcome = 3) AS failed,
        count(*) FILTER (WHERE NOT known AND outcome = 1) AS orphans
    FROM (
        SELECT o.*, EXISTS (SELECT 1 FROM prompts p WHERE p.shard = o.shard AND p.prompt_id = o.prompt_id) AS known
        FROM every_outcome o
    ) GROUP BY ALL
)
SELECT pr.judged, pr.shard, pr.config_hash,
    coalesce(pw.n, 0) + coalesce(sr.n, 0) AS prompts,
    coalesce(c.completed, 0),
    coalesce(c.rejected, 0) + coalesce(sr.n, 0),
    coalesce(c.failed, 0),
    coalesce(pw.n, 0) - coalesce(c.completed, 0) - coalesce(c.rejected, 0) - coalesce(c.failed, 0),
    coalesce(c.orphans, 0)
FROM pairs pr
LEFT JOIN prompt_rows pw ON pw.shard = pr.shard
LEFT JOIN source_rejects sr ON sr.shard = pr.shard
LEFT JOIN classified c ON c.shard = pr.shard AND c.config_hash IS NOT DISTINCT FROM pr.config_hash
ORDER BY pr.judged DESC, pr.shard, pr.config_hash NULLS FIRST
"""

# configs in the order they were first written (config_writes), the one that followed each
WRITE_ORDER = "SELECT config_hash FROM config_writes ORDER BY first_written, last_written, config_hash"

FIGURES = ("prompts", "completed", "rejected", "failed", "missing", "orphan_completions")


def accounting(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """prompts = completed + rejected + failed + missing, per (shard, config); fails on missing or orphans.

    A shard's prompts are its prompt rows plus its source-stage rejects (counted as rejected), the same for every
    config of the shard (the scope's, else every config with a row there; none: config "(none)", all missing). Each
    prompt counts once per config, in the first class that applies (rules.outcomes_sql). Orphan completions (keys with
    no prompt row in the shard) fail the check too. With a config scope, another config of its shards that does not
    add up is `superseded` (docs/quality-gate.md): reported, never failing the check.
    """
    everything = con.execute(PER_PAIR).fetchall()
    result = [row[1:] for row in everything if row[0]]
    superseded = superseded_configs([row[1:] for row in everything if not row[0]], con, quality)
    sums = dict.fromkeys(FIGURES, 0)
    per_config: dict[str, list[int]] = {}
    bad: list[str] = []
    for shard, cfg, *figures in result:
        for key, value in zip(FIGURES, figures):
            sums[key] += value
        totals = per_config.setdefault(str(cfg) if cfg is not None else "(none)", [0] * (len(FIGURES) + 1))
        totals[:-1] = [a + b for a, b in zip(totals, figures)]
        totals[-1] += 1
        prompts, completed, rejected, failed, missing, orphans = figures
        if share(missing, prompts) > quality.accounting_rate_max or orphans:
            where = f"shard `{shard}`, config `{cfg}`" if cfg is not None else f"shard `{shard}`, no config"
            line = (
                f"{where}: {num(prompts)} prompts = {num(completed)} completed + {num(rejected)} rejected + "
                f"{num(failed)} failed + **{num(missing)} missing** ({pct(share(missing, prompts))})"
            )
            if orphans:
                line += f"; {plural(orphans, 'completion')} without a prompt row"
            bad.append(line)
    lines = [
        f"Over {plural(len(result), '(shard, config) pair')}: {num(sums['prompts'])} prompts = "
        f"{num(sums['completed'])} completed + {num(sums['rejected'])} rejected + {num(sums['failed'])} failed + "
        f"**{num(sums['missing'])} missing**; {plural(sums['orphan_completions'], 'orphan completion')}."
    ]
    if per_config:
        lines.append(
            bullets(
                [
                    f"config `{cfg}` over {plural(n, 'shard')}: {num(p)} prompts, {num(c)} completed, "
                    f"{num(r)} rejected, {num(f)} failed, {num(m)} missing"
                    for cfg, (p, c, r, f, m, _o, n) in sorted(per_config.items())
                ]
            )
        )
    if bad:
        lines.append(
            f"{plural(len(bad), 'pair')} do not add up (missing over {pct(quality.accounting_rate_max)} or orphans):\n"
            + bullets(bad)
        )
    if superseded:
        lines.append(
            f"{plural(len(superseded), 'other config')} superseded (incomplete, not the one judged; blocks "
            "nothing):\n" + bullets([s.line() for s in superseded])
        )
    metadata: dict[str, MetadataValue] = {
        "pairs": len(result),
        **sums,
        "failing_pairs": len(bad),
        "superseded_configs": len(superseded),
        "superseded": ", ".join(s.config_hash for s in superseded),
        # each superseded config with its counts, for a reader that says them its own way (the terminal)
        SUPERSEDED_COUNTS: json.dumps([asdict(s) for s in superseded]),
    }
    return Finding(not bad, "\n\n".join(lines), metadata)


@dataclass(frozen=True)
class Superseded:
    """An incomplete config that is not the one judged: its counts over the scope's shards, and what followed it."""

    config_hash: str
    shards: int
    prompts: int
    completed: int
    rejected: int
    failed: int
    missing: int
    followed_by: str | None

    def line(self, quote: str = "`") -> str:
        """Its one line, the hashes in `quote` (Markdown's code; "" on a terminal)."""
        after = f"followed by config {quote}{self.followed_by}{quote}" if self.followed_by else "no config followed it"
        return (
            f"config {quote}{self.config_hash}{quote}, superseded ({after}): over {plural(self.shards, 'shard')} "
            f"{num(self.prompts)} prompts = {num(self.completed)} completed + {num(self.rejected)} rejected + "
            f"{num(self.failed)} failed + {num(self.missing)} missing"
        )


def superseded_configs(
    pairs: list[tuple], con: duckdb.DuckDBPyConnection, quality: QualitySettings
) -> list[Superseded]:
    """The other configs' (shard, config) pairs that do not add up, summed per config, in the order written."""
    order = [h for (h,) in con.execute(WRITE_ORDER).fetchall()]
    incomplete: dict[str, list[int]] = {}
    for _shard, cfg, *figures in pairs:
        prompts, completed, rejected, failed, missing, _orphans = figures
        if share(missing, prompts) > quality.accounting_rate_max:
            totals = incomplete.setdefault(cfg, [0] * 6)
            totals[:] = [a + b for a, b in zip(totals, [1, prompts, completed, rejected, failed, missing])]
    out = []
    for cfg in sorted(incomplete, key=lambda h: (order.index(h) if h in order else len(order), h)):
        later = order[order.index(cfg) + 1 :] if cfg in order else []
        shards, prompts, completed, rejected, failed, missing = incomplete[cfg]
        out.append(Superseded(cfg, shards, prompts, completed, rejected, failed, missing, later[0] if later else None))
    return out
