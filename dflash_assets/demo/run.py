"""`dflash demo`: every shard through the Dagster job, on the instance in DAGSTER_HOME, then a summary."""

from __future__ import annotations

import os

import dagster as dg
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash_assets.defs.sensors import missing_shards
from dflash_assets.definitions import defs
from dflash_assets.defs.partitions import shard_partitions


def _meta(result: dg.ExecuteInProcessResult, asset: str) -> dict:
    mats = result.asset_materializations_for_node(asset)
    return {k: v.value for k, v in mats[-1].metadata.items()} if mats else {}


def run_demo(max_output_tokens: int, console: Console | None = None) -> int:
    console = console or Console()
    instance = dg.DagsterInstance.get()
    source = defs.resources["prompt_source"]
    new = missing_shards(instance, source)
    if new:
        instance.add_dynamic_partitions(shard_partitions.name, new)
    shards = instance.get_dynamic_partitions(shard_partitions.name)
    job = defs.resolve_job_def("shard_pipeline")
    run_config = {"ops": {"completions": {"config": {"max_output_tokens": max_output_tokens}}}}
    console.print(f"dflash demo: {len(shards)} shards of {source.path} (cap {max_output_tokens} tokens), "
                  f"DAGSTER_HOME={os.environ['DAGSTER_HOME']}, data in {os.environ['DFLASH_DATA_DIR']}/")

    table = Table(title="dflash demo")
    for col in ("shard", "prompts", "completed", "rejected", "failed", "truncated", "P50", "P90", "P99",
                "checks", "run"):
        table.add_column(col, justify="right" if col not in ("checks", "run") else "left")
    failures = 0
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("materialising shards", total=len(shards))
        for shard in shards:
            result = job.execute_in_process(partition_key=shard, instance=instance, run_config=run_config,
                                            raise_on_error=False)
            comp, report = _meta(result, "completions"), _meta(result, "length_quality_report")
            checks = result.get_asset_check_evaluations()
            failed_checks = [c.check_name for c in checks if not c.passed]
            failures += (not result.success)
            table.add_row(
                shard, str(comp.get("prompts", "-")), str(comp.get("completed", "-")),
                str(comp.get("rejected_preflight", 0) + comp.get("rejected_server", 0)) if comp else "-",
                str(comp.get("failed", "-")), report.get("truncation_rate", "-"),
                *(str(report.get(k, "-")) for k in ("p50", "p90", "p99")),
                f"{len(checks) - len(failed_checks)}/{len(checks)} passed"
                + (f" (failed: {', '.join(failed_checks)})" if failed_checks else ""),
                "[green]success[/]" if result.success else f"[red]failed[/] {result.run_id[:8]}",
            )
            progress.advance(task)
    console.print(table)
    console.print("Open the UI:  DAGSTER_HOME=" + os.environ["DAGSTER_HOME"] +
                  " uv run dagster dev -w workspace.yaml   then http://127.0.0.1:3000")
    console.print("Re-running `dflash demo` resumes: committed completions are not generated again.")
    return 1 if failures else 0
