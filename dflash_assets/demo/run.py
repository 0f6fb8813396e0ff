"""`dflash demo` and `dflash backfill`: shards through the Dagster job on the instance in DAGSTER_HOME.

Both run a range of shards the way a backfill launched from the UI does: runs of up to
DFLASH_SHARDS_PER_RUN shards (`BackfillPolicy.multi_run`), each run streaming its shards' prompts
through one dispatcher, here executed in this process one run after the other (no daemon needed).
"""

from __future__ import annotations

import os
import sys

import dagster as dg
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash_assets.defs.partitions import SHARDS_PER_RUN, shard_partitions
from dflash_assets.defs.resources import PromptSource
from dflash_assets.defs.sensors import missing_shards
from dflash_assets.definitions import defs
from dflash_assets.settings import Deployment

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
COLUMNS = ("shard", "lines", "rejected", "prompts", "done", "new", "fail", "cut", "P50", "P90", "P99", "checks")


def console_for_output() -> Console:
    return Console(width=None if sys.stdout.isatty() else 120)  # piped output is not cut to 80 columns


def _meta(result: dg.ExecuteInProcessResult, asset: str) -> dict[str, dict]:
    """partition -> metadata of the asset's materialisations in a run."""
    return {m.partition: {k: v.value for k, v in m.metadata.items()}
            for m in result.asset_materializations_for_node(asset)}


def known_shards(instance: dg.DagsterInstance) -> list[str]:
    """Add a partition for every shard of the prompt source, and return all of them."""
    # the resources hold EnvVar placeholders until a run resolves them; read the same settings here
    source = PromptSource(path=Deployment.PROMPTS.value(), shard_size=int(Deployment.SHARD_SIZE.value()))
    new = missing_shards(instance, source)
    if new:
        instance.add_dynamic_partitions(shard_partitions.name, new)
    return instance.get_dynamic_partitions(shard_partitions.name)


def run_shards(instance: dg.DagsterInstance, shards: list[str], max_output_tokens: int, console: Console) -> list[str]:
    """Materialise `shards` in runs of SHARDS_PER_RUN; print a table; return the failed runs."""
    job = defs.resolve_job_def("shard_pipeline")
    run_config = {**QUIET, "ops": {"completions": {"config": {"max_output_tokens": max_output_tokens}}}}
    table = Table(title="completions by shard (cut: finish_reason = length; P: completion tokens)",
                  box=box.SIMPLE_HEAD)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "shard" else "right", no_wrap=True)
    failed_checks: dict[str, list[str]] = {}
    failed_runs: list[str] = []
    runs = [shards[i:i + SHARDS_PER_RUN] for i in range(0, len(shards), SHARDS_PER_RUN)]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"materialising shards in {len(runs)} run(s)", total=len(shards))
        for chunk in runs:
            result = job.execute_in_process(
                instance=instance, run_config=run_config, raise_on_error=False,
                tags={"dagster/asset_partition_range_start": chunk[0],
                      "dagster/asset_partition_range_end": chunk[-1]})
            source, comp = _meta(result, "prompt_shards"), _meta(result, "completions")
            report, checks = _meta(result, "length_quality_report"), result.get_asset_check_evaluations()
            for shard in chunk:
                s, c, r = source.get(shard, {}), comp.get(shard, {}), report.get(shard, {})
                failing = [e for e in checks if not e.passed and f"shard {shard}" in e.metadata["failing"].text]
                for e in failing:
                    failed_checks.setdefault(f"{e.check_name} ({e.severity.value})", []).append(shard)
                rejected = s.get("rejected", 0) + c.get("rejected_preflight", 0) + c.get("rejected_server", 0)
                table.add_row(
                    shard, str(s.get("lines", "-")), str(rejected), str(c.get("prompts", "-")),
                    str(c.get("completed", "-")), str(c["completed"] - c["already_done"]) if c else "-",
                    str(c.get("failed", "-")), str(r.get("truncation_rate", "-")),
                    *(str(r.get(k, "-")) for k in ("p50", "p90", "p99")),
                    f"{len(checks) - len(failing)}/{len(checks)}")
            if not result.success:
                failed_runs.append(f"shards {chunk[0]}..{chunk[-1]} (run {result.run_id})")
            progress.advance(task, len(chunk))
    console.print(table)
    for name, where in sorted(failed_checks.items()):
        console.print(f"  check {name} did not pass on shard(s) {', '.join(where)}")
    if failed_checks:
        console.print("  (a blocking check that fails with ERROR stops what comes after it; WARN asks you to look)")
    return failed_runs


def run_demo(max_output_tokens: int, console: Console | None = None) -> int:
    console = console or console_for_output()
    instance = dg.DagsterInstance.get()
    shards = known_shards(instance)
    console.print(f"dflash demo: {len(shards)} shards (cap {max_output_tokens} tokens), "
                  f"DAGSTER_HOME={os.environ['DAGSTER_HOME']}, data in {os.environ['DFLASH_DATA_DIR']}/")
    failed_runs = run_shards(instance, shards, max_output_tokens, console)
    export = defs.resolve_job_def("training_export").execute_in_process(instance=instance, run_config={
        **QUIET, "ops": {"drafter_training_set": {"config": {"config_hash": ""}}}}, raise_on_error=False)
    if export.success:
        meta = next(iter(_meta(export, "drafter_training_set").values()))
        console.print(f"drafter training set: {meta['dagster/row_count']} rows of config {meta['config_hash']} in "
                      f"{meta['jsonl']} (manifest beside it)")
    else:
        failed_runs.append(f"training export (run {export.run_id})")
    for run in failed_runs:
        console.print(f"[red]run failed[/]: {run}: see it in the UI")
    console.print("Open the UI:  DAGSTER_HOME=" + os.environ["DAGSTER_HOME"] +
                  " uv run dagster dev -w workspace.yaml   then http://127.0.0.1:3000")
    console.print("Re-running `dflash demo` resumes: committed completions are not generated again.")
    return 1 if failed_runs else 0


def run_backfill(first: str | None, last: str | None, max_output_tokens: int, console: Console | None = None) -> int:
    console = console or console_for_output()
    instance = dg.DagsterInstance.get()
    shards = known_shards(instance)
    first, last = first or shards[0], last or shards[-1]
    unknown = [k for k in (first, last) if k not in shards]
    if unknown:
        console.print(f"[red]dflash backfill:[/] no shard {', '.join(unknown)}; the shards are "
                      f"{shards[0]}..{shards[-1]}")
        return 2
    chosen = shards[shards.index(first):shards.index(last) + 1]
    console.print(f"dflash backfill: shards {first}..{last} ({len(chosen)}), cap {max_output_tokens}, "
                  f"up to {SHARDS_PER_RUN} shards per run, DAGSTER_HOME={os.environ['DAGSTER_HOME']}")
    failed_runs = run_shards(instance, chosen, max_output_tokens, console)
    for run in failed_runs:
        console.print(f"[red]run failed[/]: {run}: re-run the same range to resume where it stopped")
    return 1 if failed_runs else 0
