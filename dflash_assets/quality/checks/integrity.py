"""Checks on the shape of the data set: one config per scope, one row per (prompt_id, config_hash)."""

from collections import defaultdict

import duckdb

from dflash_assets.quality.checks.rates import GroupCount, rate_finding
from dflash_assets.quality.outcome import Finding, MetadataValue, bullets, config_label, plural
from dflash_assets.settings import QualitySettings


def config_consistency(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Fails when the scope holds more than one config (config_hash, max_output_tokens), naming the shards
    that mix configs inside themselves and the row counts of each config: old 4096 rows beside new 8192 rows.
    """
    result = con.execute(
        "SELECT shard, config_hash, config_cap, count(*) FROM completions "
        "GROUP BY ALL ORDER BY shard, config_hash, config_cap"
    ).fetchall()
    per_shard: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    per_config: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])  # rows, shards
    for shard, config_hash, cap, rows in result:
        per_shard[shard].append((config_hash, cap, rows))
        per_config[(config_hash, cap)][0] += rows
        per_config[(config_hash, cap)][1] += 1
    mixed = {s: cs for s, cs in per_shard.items() if len(cs) > 1}
    configs = sorted(per_config.items(), key=lambda kv: (str(kv[0][0]), kv[0][1] or 0))
    spread = [(h, cap, f"{plural(rows, 'row')} in {plural(shards, 'shard')}") for (h, cap), (rows, shards) in configs]
    mix = "; ".join(f"{h}/{cap}: {where}" for h, cap, where in spread)
    config_lines = [f"{config_label(h, cap)}: {where}" for h, cap, where in spread]
    if len(configs) <= 1:
        lines = [f"One config in scope: {config_lines[0]}." if configs else "No completion rows in scope."]
    else:
        verb = "mixes" if len(mixed) == 1 else "mix"
        inside = f"; {plural(len(mixed), 'shard')} {verb} configs inside" if mixed else ""
        lines = [
            f"The data mixes **{len(configs)} configs** across {plural(len(per_shard), 'shard')}{inside}.",
            bullets(config_lines),
        ]
    if mixed:
        shard_lines = [
            f"shard `{s}`: "
            + ", ".join(f"`{h}` (max_output_tokens {cap}) {plural(rows, 'row')}" for h, cap, rows in cs)
            for s, cs in mixed.items()
        ]
        lines.append("Shards mixing configs:\n" + bullets(shard_lines))
    metadata: dict[str, MetadataValue] = {
        "configs": len(configs),
        "shards": len(per_shard),
        "mixed_shards": len(mixed),
        "config_mix": mix,
    }
    return Finding(len(configs) <= 1, "\n\n".join(lines), metadata)


def duplicates(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Extra rows on (prompt_id, turn, config_hash): rows beyond the first per key, as a share of rows, per
    config_hash (turn is null for one row per prompt; all_turns has a row per turn). A committed part is the only
    ledger, so a duplicate means a part was committed twice or a resume re-ran it.
    """
    result = con.execute(
        "SELECT config_hash, sum(n)::BIGINT, (sum(n) - count(*))::BIGINT, count(*) FILTER (WHERE n > 1), "
        "list(prompt_id || coalesce(' turn ' || turn, '') || ' x' || n ORDER BY n DESC, prompt_id) "
        "FILTER (WHERE n > 1)[:5] "
        "FROM (SELECT config_hash, prompt_id, turn, count(*) AS n FROM completions GROUP BY ALL) "
        "GROUP BY ALL ORDER BY config_hash"
    ).fetchall()
    groups = [GroupCount(f"config `{h}`", str(h), rows, extra) for h, rows, extra, _, _ in result]
    keys = sum(k for *_, k, _ in result)
    examples = [f"{e} ({h})" for h, *_, ex in result for e in ex or []][:5]
    finding = rate_finding(
        "duplicate",
        "are extra copies of a (prompt_id, config_hash) already present",
        groups,
        quality.duplicates_rate_max,
        why="A part was committed twice or a resume regenerated done prompts; the export keeps the first copy.",
    )
    summary = finding.summary_md
    if keys:
        summary += f"\n\n{plural(keys, 'key')} duplicated, e.g. " + ", ".join(f"`{e}`" for e in examples) + "."
    return Finding(finding.passed, summary, finding.metadata | {"duplicated_keys": keys})
