"""length_quality_report: what the completions of a shard look like, in figures and a picture."""

import base64

import dagster as dg

from dflash_assets.defs.completions.assets import completions
from dflash_assets.defs.partitions import shard_partitions
from dflash_assets.defs.resources import DataDir, QualityThresholds
from dflash_assets.quality import length_quality
from dflash_assets.quality.outcome import pct


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    fmt = lambda v: pct(v) if isinstance(v, float) else str(v)  # noqa: E731 - rates are the only floats here
    return head + "\n".join("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows)


def report_metadata(report: dict, png: bytes) -> dict:
    """The figures a person reads first, then the breakdowns, then the picture."""
    stats = ["rows", "truncated_rows", "truncation_rate", "p50", "p90", "p95", "p99", "max"]
    return {
        "dagster/row_count": report["rows"],
        "rows": report["rows"],
        "truncated_rows": report["truncated_rows"],
        "truncation_rate": pct(report["truncation_rate"]),
        **{k: report[k] for k in ("p50", "p90", "p95", "p99", "max") if report[k] is not None},
        **{k: v for k, v in report["overflow"].items()},
        "by_config": dg.MetadataValue.md(_table(report["by_config"], ["config_hash", "max_output_tokens", *stats])),
        "by_prompt_length": dg.MetadataValue.md(_table(report["by_prompt_length"], ["bucket", *stats])),
        "by_source": dg.MetadataValue.md(_table(report["by_source"], ["source", *stats])),
        "completion_lengths": dg.MetadataValue.md(
            f"![completion lengths](data:image/png;base64,{base64.b64encode(png).decode()})"),
        "percentiles": report["percentile_definition"],
    }


@dg.asset(
    deps=[completions],
    partitions_def=shard_partitions,
    group_name="quality",
    kinds={"duckdb", "parquet"},
    owners=["team:dflash"],
    description="Length quality of a shard's completions (DuckDB over its Parquet): rows, truncation rate "
                "(finish_reason = 'length'), P50/P90/P95/P99/max completion tokens by config, prompt length and "
                "source, context overflows, and a histogram of completion lengths with the cap marked.",
)
def length_quality_report(context: dg.AssetExecutionContext, data_dir: DataDir,
                          quality: QualityThresholds) -> dg.MaterializeResult:
    from dflash_assets.quality import completion_histogram_png

    shard = context.partition_key
    root = data_dir.resolved()
    report = length_quality(root, shard=shard, max_length=quality.training_max_length)
    png = completion_histogram_png(root, root / "reports" / f"shard={shard}" / "completion_lengths.png", shard=shard)
    return dg.MaterializeResult(metadata={**report_metadata(report, png.read_bytes()),
                                          "histogram_path": dg.MetadataValue.path(str(png))})
