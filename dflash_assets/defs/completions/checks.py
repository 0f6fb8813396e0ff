"""The quality gate on completions: every check of `quality.CHECKS` from one DuckDB pass.

In a shard's run the checks look at that shard; in a checks-only run (the schedule) at every shard.
The ones marked blocking stop what is downstream (the training set) while they fail with ERROR.
"""

import dagster as dg

from dflash_assets.defs.completions.assets import completions
from dflash_assets.defs.resources import DataDir, QualityThresholds
from dflash_assets.quality import CHECKS, run_checks


@dg.multi_asset_check(
    specs=[dg.AssetCheckSpec(spec.name, asset=completions, blocking=spec.blocking, description=spec.description)
           for spec in CHECKS],
    description="The length-quality and data-contract checks on completions, computed in one DuckDB scan.",
    can_subset=True,
)
def completions_quality_checks(context: dg.AssetCheckExecutionContext, data_dir: DataDir,
                               quality: QualityThresholds):
    shard = context.partition_key if context.has_partition_key else None
    selected = {key.name for key in context.selected_asset_check_keys}
    scope = f"shard {shard}" if shard else "all shards"
    for outcome in run_checks(data_dir.resolved(), shard=shard, thresholds=quality.thresholds()):
        if outcome.name not in selected:
            continue
        yield dg.AssetCheckResult(
            check_name=outcome.name,
            asset_key=completions.key,
            passed=outcome.passed,
            severity=dg.AssetCheckSeverity(outcome.severity),
            description=f"{scope}: " + outcome.summary_md.split("\n", 1)[0],
            metadata={"scope": scope, "summary": dg.MetadataValue.md(outcome.summary_md), **outcome.metadata},
        )
