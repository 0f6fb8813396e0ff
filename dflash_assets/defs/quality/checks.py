"""The quality gate, as asset checks on length_quality_report: every check of `quality.CHECKS` from one DuckDB pass.

A shard's run judges the config it wrote, a checks-only run each config apart; a config's failure is its own. On
the report, not on completions: a blocking check stops only what is downstream, so the report always materialises.
"""

import dagster as dg

from dflash_assets.defs.completions.assets import configs_written_by_run
from dflash_assets.defs.metadata import CheckKeys
from dflash_assets.defs.quality.assets import length_quality_report
from dflash_assets.defs.resources import DataDirResource, QualityResource
from dflash_assets.quality import CHECKS, CheckOutcome, ConfigVerdict, judge_each_config, run_checks
from dflash_assets.quality.outcome import shown
from dflash_assets.settings import QualitySettings


@dg.multi_asset_check(
    specs=[
        dg.AssetCheckSpec(spec.name, asset=length_quality_report, blocking=spec.blocking, description=spec.description)
        for spec in CHECKS
    ],
    description="The length-quality and data-contract checks on completions, computed in one DuckDB scan.",
    compute_kind="duckdb",
    can_subset=True,
)
def completions_quality_checks(
    context: dg.AssetCheckExecutionContext, data_dir: DataDirResource, quality: QualityResource
):
    # a shard's run checks that shard, a backfill's range run each of its shards, a checks-only run all shards
    if context.has_partition_key or context.has_partition_key_range:
        scopes = list(context.partition_keys)
    else:
        scopes = [None]
    selected = {key.name for key in context.selected_asset_check_keys}
    quality_settings, root = QualitySettings.taken_from(quality), data_dir.resolved()
    written = configs_written_by_run(context) if scopes != [None] else {}
    verdicts: list[tuple[str | None, ConfigVerdict]] = []
    for shard in scopes:
        if shard in written:  # the run's own config; every other incomplete one is superseded
            verdicts.append(
                (
                    shard,
                    ConfigVerdict(written[shard], run_checks(root, shard, written[shard], quality_settings, selected)),
                )
            )
        else:  # no config of its own here: every config, each judged apart
            verdicts += [(shard, v) for v in judge_each_config(root, shard, quality_settings, selected)]
    by_name: dict[str, list[tuple[str | None, ConfigVerdict, CheckOutcome]]] = {}
    for shard, verdict in verdicts:
        for outcome in verdict.outcomes:
            by_name.setdefault(outcome.name, []).append((shard, verdict, outcome))
    shard_text = lambda shard: f"shard {shard}" if shard else "all shards"  # noqa: E731 - for people, never parsed
    where = lambda shard, v: shard_text(shard) + (f", config {v.config_hash}" if v.config_hash else "")  # noqa: E731
    configs = ", ".join(dict.fromkeys(v.config_hash or "(none)" for _, v in verdicts))
    for name, results in by_name.items():
        failing = [(s, v, o) for s, v, o in results if not o.passed and not v.superseded]
        first, verdict, worst = failing[0] if failing else results[-1]
        shards = list(dict.fromkeys(s for s, _, _ in results))
        label = ", ".join(shard_text(s) for s in shards) if len(shards) <= 3 else f"{len(shards)} shards"
        yield dg.AssetCheckResult(
            check_name=name,
            asset_key=length_quality_report.key,
            passed=not failing,
            severity=dg.AssetCheckSeverity(worst.severity),
            description=f"{where(first, verdict)}: " + worst.summary_md.split("\n", 1)[0],
            metadata={
                # the worst judgement's own figures, shares as percentages; the run's keys below never give way to them
                **{key: shown(value) for key, value in worst.metadata.items()},
                CheckKeys.SCOPE: label,
                CheckKeys.JUDGED: configs,
                CheckKeys.FAILING: ", ".join(where(s, v) for s, v, _ in failing) or "none",
                CheckKeys.FAILING_SHARDS: dg.MetadataValue.json(list(dict.fromkeys(s for s, _, _ in failing if s))),
                CheckKeys.VERDICTS: dg.MetadataValue.json(
                    [
                        {"shard": s, "config_hash": v.config_hash, "passed": o.passed, "superseded": v.superseded}
                        for s, v, o in results
                    ]
                ),
                CheckKeys.SUMMARY: dg.MetadataValue.md(
                    "\n\n".join(
                        f"**{where(s, v)}**"
                        + (" (superseded: reported apart, blocks nothing)" if v.superseded else "")
                        + f": {o.summary_md}"
                        for s, v, o in results
                    )
                ),
            },
        )
