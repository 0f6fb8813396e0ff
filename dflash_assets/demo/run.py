"""`dflash demo`: every shard through the Dagster job, on the instance in DAGSTER_HOME, then a summary."""

from __future__ import annotations

import os
import sys

import dagster as dg
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash_assets.defs.resources import DEMO_PROMPTS, PromptSource
from dflash_assets.defs.sensors import missing_shards
from dflash_assets.definitions import defs
from dflash_assets.defs.partitions import shard_partitions


def _meta(result: dg.ExecuteInProcessResult, asset: str) -> dict:
    mats = result.asset_materializations_for_node(asset)
    return {k: v.value for k, v in mats[-1].metadata.items()} if mats else {}


def run_demo(max_output_tokens: int, console: Console | None = None) -> int:
    # piped output (CI, logs) would otherwise be cut to 80 columns
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    instance = dg.DagsterInstance.get()
    # the resources hold EnvVar placeholders until a run resolves them; read the same settings here
    source = PromptSource(path=os.environ.get("DFLASH_PROMPTS", str(DEMO_PROMPTS)),
                          shard_size=int(os.environ.get("DFLASH_SHARD_SIZE", "100")))
    new = missing_shards(instance, source)
    if new:
        instance.add_dynamic_partitions(shard_partitions.name, new)
    shards = instance.get_dynamic_partitions(shard_partitions.name)
    job = defs.resolve_job_def("shard_pipeline")
    run_config = {"ops": {"completions": {"config": {"max_output_tokens": max_output_tokens}}}}
    console.print(f"dflash demo: {len(shards)} shards of {source.path} (cap {max_output_tokens} tokens), "
                  f"DAGSTER_HOME={os.environ['DAGSTER_HOME']}, data in {os.environ['DFLASH_DATA_DIR']}/")

    table = Table(title="completions by shard (cut: finish_reason = length; P: completion tokens)", box=box.SIMPLE_HEAD)
    for col in ("shard", "lines", "rejected", "prompts", "done", "new", "fail", "cut", "P50", "P90", "P99", "checks"):
        table.add_column(col, justify="left" if col in ("shard", "run") else "right", no_wrap=True)
    failed_checks: dict[str, list[str]] = {}
    failed_runs: list[str] = []
    quiet = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("materialising shards", total=len(shards))
        for shard in shards:
            result = job.execute_in_process(partition_key=shard, instance=instance,
                                            run_config={**run_config, **quiet}, raise_on_error=False)
            source = _meta(result, "prompt_shards")
            comp, report = _meta(result, "completions"), _meta(result, "length_quality_report")
            rejected = source.get("rejected", 0) + comp.get("rejected_preflight", 0) + comp.get("rejected_server", 0)
            checks = result.get_asset_check_evaluations()
            for c in checks:
                if not c.passed:
                    failed_checks.setdefault(f"{c.check_name} ({c.severity.value})", []).append(shard)
            table.add_row(
                shard, str(source.get("lines", "-")), str(rejected),
                *(str(comp.get(k, "-")) for k in ("prompts", "completed")),
                str(comp["completed"] - comp["already_done"]) if comp else "-", str(comp.get("failed", "-")), str(report.get("truncation_rate", "-")),
                *(str(report.get(k, "-")) for k in ("p50", "p90", "p99")),
                f"{sum(c.passed for c in checks)}/{len(checks)}",
            )
            if not result.success:
                failed_runs.append(f"{shard} (run {result.run_id})")
            progress.advance(task)
    console.print(table)
    export = defs.resolve_job_def("training_export").execute_in_process(instance=instance, run_config={
        **quiet, "ops": {"drafter_training_set": {"config": {"config_hash": ""}}}}, raise_on_error=False)
    if export.success:
        meta = _meta(export, "drafter_training_set")
        console.print(f"drafter training set: {meta['dagster/row_count']} rows of config {meta['config_hash']} in "
                      f"{meta['jsonl']} (manifest beside it)")
    else:
        failed_runs.append(f"training export (run {export.run_id})")
    for name, where in sorted(failed_checks.items()):
        console.print(f"  check {name} did not pass on shard(s) {', '.join(where)}")
    console.print("  (a blocking check that fails with ERROR stops its shard's run; WARN asks you to look)")
    for run in failed_runs:
        console.print(f"[red]run failed[/] for shard {run}: see it in the UI")
    console.print("Open the UI:  DAGSTER_HOME=" + os.environ["DAGSTER_HOME"] +
                  " uv run dagster dev -w workspace.yaml   then http://127.0.0.1:3000")
    console.print("Re-running `dflash demo` resumes: committed completions are not generated again.")
    return 1 if failed_runs else 0
