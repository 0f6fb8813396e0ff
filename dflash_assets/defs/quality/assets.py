"""length_quality_report: what the completions of a shard look like, in figures and a picture."""

import dagster as dg

from dflash_assets.defs.completions.assets import completions
from dflash_assets.defs.partitions import shard_partitions
from dflash_assets.defs.resources import DataDir
from dflash_assets.quality import length_quality


@dg.asset(
    deps=[completions],
    partitions_def=shard_partitions,
    group_name="quality",
    kinds={"duckdb", "parquet"},
    owners=["team:dflash"],
    description="Length quality of a shard's completions (DuckDB over its Parquet): rows, truncation rate "
                "(finish_reason = 'length'), P50/P90/P99/max completion tokens and context overflows, by config.",
)
def length_quality_report(context: dg.AssetExecutionContext, data_dir: DataDir) -> dg.MaterializeResult:
    report = length_quality(data_dir.resolved(), shard=context.partition_key)
    return dg.MaterializeResult(metadata=report.metadata())
