"""The quality gate, as asset checks on length_quality_report: every check of `quality.CHECKS` from one DuckDB pass.

In a shard's run the checks look at that shard; in a checks-only run (the schedule) at every shard.
They sit on length_quality_report, the shard's measured figures they judge, not on completions: a blocking
check stops only the assets downstream of the asset it checks (Dagster wires the failed check step in front
of them), so on completions it stopped the report itself, on exactly the shards whose figures a person needs.
Placed here the report always materialises, the check fails beside it, and the ones marked blocking stop
the training set, which is downstream of the report.
"""

import dagster as dg

from dflash_assets.defs.metadata import CheckKeys
from dflash_assets.defs.quality.assets import length_quality_report
from dflash_assets.defs.resources import DataDirResource, QualityResource
from dflash_assets.quality import CHECKS, CheckOutcome, run_checks
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
    by_name: dict[str, list[tuple[str | None, CheckOutcome]]] = {}  # check -> (shard, or None for all shards, outcome)
    quality_settings = QualitySettings.taken_from(quality)
    for shard in scopes:
        for outcome in run_checks(data_dir.resolved(), shard=shard, quality=quality_settings, names=selected):
            by_name.setdefault(outcome.name, []).append((shard, outcome))
    where = lambda shard: f"shard {shard}" if shard else "all shards"  # noqa: E731 - for people, never parsed
    for name, results in by_name.items():
        failing = [(shard, o) for shard, o in results if not o.passed]
        first, worst = failing[0] if failing else results[0]
        label = ", ".join(where(s) for s, _ in results) if len(results) <= 3 else f"{len(results)} shards"
        yield dg.AssetCheckResult(
            check_name=name,
            asset_key=length_quality_report.key,
            passed=not failing,
            severity=dg.AssetCheckSeverity(worst.severity),
            description=f"{where(first)}: " + worst.summary_md.split("\n", 1)[0],
            metadata={
                CheckKeys.SCOPE: label,
                CheckKeys.FAILING: ", ".join(where(s) for s, _ in failing) or "none",
                CheckKeys.FAILING_SHARDS: dg.MetadataValue.json([s for s, _ in failing if s]),
                CheckKeys.SUMMARY: dg.MetadataValue.md(
                    "\n\n".join(f"**{where(s)}**: {o.summary_md}" for s, o in results)
                ),
                **worst.metadata,
            },
        )
