"""The one place that executes Dagster jobs in this process, and reads their results as data.

A range of shards runs as a UI backfill does (`BackfillPolicy.multi_run`, DFLASH_SHARDS_PER_RUN shards a run), the
runs one after the other in this process. Events go to the run's event log (`--verbose` prints them). Exit status:
0 done, 1 failed, 2 bad input or config, 3 stopped by a blocking check.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import dagster as dg
from dagster._core.errors import DagsterExecutionStepExecutionError, DagsterResourceFunctionError  # not public
from dagster._core.execution.plan.objects import ErrorSource  # a step failure's source: not public in 1.13
from dagster._core.execution.plan.utils import RetryRequestedFromPolicy  # not public in 1.13
from rich.console import Console
from rich.logging import RichHandler

from dflash_assets.defs import pools
from dflash_assets.defs.faults import in_process_instance
from dflash_assets.defs.metadata import StepStopKeys
from dflash_assets.defs.partitions import SHARDS
from dflash_assets.defs.prompts.sensors import shard_changes
from dflash_assets.defs.resources import DataDirResource, PromptSourceResource
from dflash_assets.generation.stopping import STOP
from dflash_assets.settings import Deployment, GenerationSettings, TrainerSettings
from dflash_assets.store.in_use import remember_data_dir

T = TypeVar("T")

DONE, FAILED, BAD_CONFIG, STOPPED_BY_CHECK = 0, 1, 2, 3  # exit statuses, documented in the README


ALL_SHARDS = "all shards"  # where the export's gate judged a config


def quiet(verbose: bool) -> dict:
    """Run config for the console logger: silent unless --verbose; the event log keeps everything either way."""
    return {"loggers": {"console": {"config": {"log_level": "DEBUG" if verbose else "CRITICAL"}}}}


@dataclass(frozen=True)
class Failure:
    """A failed run or step in a line or two: where, its cause's first line, a fleet's own words."""

    where: str
    message: str
    run_id: str
    detail: tuple[str, ...] = ()  # e.g. the last lines an emulator or sglang server wrote before it exited
    passing: bool = False  # re-running may cure it (a server down, a timeout), so say so
    says_next: bool = False  # the message ends with the next command itself (a full disk: free space, then...)


@dataclass(frozen=True)
class Window:
    """demo/backfill's --cap-policy, --overshoot and the trainer's settings: the one window the requests are sized
    to and everything after judges by, set in the quality resource alone."""

    cap_policy: str = GenerationSettings().cap_policy
    overshoot: int = GenerationSettings().overshoot
    trainer: TrainerSettings = TrainerSettings()

    @classmethod
    def of(cls, completions: dict, trainer: TrainerSettings = TrainerSettings()) -> Window:
        """The window of a completions run config (the CLI's flags) and the trainer's settings."""
        return cls(completions["cap_policy"], completions["overshoot"], trainer)

    @property
    def trainer_max_length(self) -> int:
        return self.trainer.max_length

    def resources(self) -> dict:
        return {"quality": {"config": {"trainer": self.trainer.model_dump()}}}

    def quality(self):
        from dflash_assets.settings import QualitySettings

        return QualitySettings(trainer=self.trainer)


@dataclass
class Stops:
    """What stopped the runs of a command, sorted by kind: blocking checks, the preflight, anything else."""

    checks: dict[str, list[str]] = field(default_factory=dict)  # blocking check -> shards it failed on
    preflight: list[str] = field(default_factory=list)  # the preflight's or the config's refusals (with numbers)
    errors: list[Failure] = field(default_factory=list)  # in the order they happened: the first is the cause
    config_hashes: set[str] = field(default_factory=set)
    filling_window: int = 0  # cap_policy fixed: prompts sent although they fill the trainer's window
    context_length_needed: int = 0  # the preflight's: the servers' context length that fits every prompt (0: none)

    @property
    def config_hash(self) -> str | None:
        """The run's own config (a command generates one): what its table, its checks and its export are of."""
        return min(self.config_hashes) if self.config_hashes else None

    def exit_status(self) -> int:
        return FAILED if self.errors else BAD_CONFIG if self.preflight else STOPPED_BY_CHECK if self.checks else DONE


def execute(
    job: str,
    instance: dg.DagsterInstance,
    run_config: dict | dg.RunConfig,
    console: Console,
    shards: list[str] | None = None,
    watch: Callable[[], None] | None = None,
) -> dg.ExecuteInProcessResult:
    """One run of `job` in this process, its worker: dead runs are failed and their pool slots freed first
    (defs/pools.py), this process is recorded in the run's tags (a kill -9 is seen by the next run), and a step
    waiting for a pool is said here. `watch()` is called while it runs (a progress line)."""
    from dflash_assets.definitions import defs  # loaded here: it reads the environment the command has set

    handler = RichHandler(console=console, show_time=False, show_level=False, show_path=False, markup=False)
    pools.log.addHandler(handler)
    pools.log.setLevel(logging.INFO)
    try:
        pools.reap_dead_runs(instance)
        tags = pools.worker_tags()
        if shards:
            tags |= {"dagster/asset_partition_range_start": shards[0], "dagster/asset_partition_range_end": shards[-1]}
        home = os.environ.get("DAGSTER_HOME")  # where DagsterInstance.get() found `instance`
        runner = in_process_instance(home) if home else instance
        STOP.check()  # stopped before this run: it does not start
        result = beside_the_signals(
            lambda: defs.resolve_job_def(job).execute_in_process(
                instance=runner, run_config=run_config, raise_on_error=False, tags=tags
            ),
            watch,
        )
        if result.get_asset_materialization_events():  # it wrote there: the instance's data dir (store/in_use.py)
            remember_data_dir(Path(os.environ["DAGSTER_HOME"]), Deployment.DATA_DIR.value())
        STOP.check()  # a polite stop: the run was canceled, no next run starts
        return result
    finally:
        pools.log.removeHandler(handler)


def beside_the_signals(run: Callable[[], T], watch: Callable[[], None] | None = None) -> T:
    """`run()` in a thread of its own while the main thread hears SIGINT and SIGTERM (generation/stopping.py):
    Dagster swaps the main thread's SIGINT handler around its steps (capture_interrupts: an interrupt fails the step,
    which is retried), so here a signal at any moment is the one polite stop. `watch()`: called between waits."""
    import threading

    done: dict[str, Any] = {}

    def body() -> None:
        try:
            done["result"] = run()
        except BaseException as e:  # raised again in the main thread
            done["error"] = e

    worker = threading.Thread(target=body, name="dagster-run", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)  # the main thread runs the signal handlers between waits
        if watch is not None:
            watch()
    if "error" in done:
        raise done["error"]
    return done["result"]


def record_failures(result: dg.ExecuteInProcessResult, where: str, stops: Stops) -> None:
    """Sort a run's failures by their StepStopKeys: a blocking check, a refusal or an error (its cause's first line)."""
    failed_steps = False
    checks_failed = any(
        not e.passed and e.blocking and e.severity == dg.AssetCheckSeverity.ERROR
        for e in result.get_asset_check_evaluations()
    )
    for event in result.all_events:
        if event.is_step_failure:
            failed_steps = True
            data = event.step_failure_data
            error, user = data.error, data.user_failure_data
            if error is None or (checks_failed and data.error_source == ErrorSource.FRAMEWORK_ERROR):
                continue  # Dagster stopped the step for its failed blocking checks: the evaluations say which
            meta = {key: value.value for key, value in user.metadata.items()} if user else {}
            cause = meta.get(StepStopKeys.CAUSE)
            if cause == "check":
                failing = meta[StepStopKeys.FAILING_CHECKS]  # the export's gate, over all shards
                for name in failing if isinstance(failing, list) else []:
                    stops.checks.setdefault(str(name), []).append(ALL_SHARDS)
                continue
            if user and cause in ("preflight", "config"):
                stops.preflight.append(str(meta.get(StepStopKeys.REFUSAL, user.description)).strip())
                needed = meta.get(StepStopKeys.CONTEXT_LENGTH_NEEDED)
                stops.context_length_needed = max(stops.context_length_needed, needed if isinstance(needed, int) else 0)
                continue
            attempts = 1 + sum(e.is_step_up_for_retry and e.step_key == event.step_key for e in result.all_events)
            message = user.description if user and user.description else _line(_own_error(error, attempts))
            stops.errors.append(
                Failure(
                    f"{where}, step {event.step_key}",
                    message.strip().splitlines()[0],
                    result.run_id,
                    passing=meta.get(StepStopKeys.RERUN_CURES) is True,
                    says_next=cause == "exhausted",
                )
            )
        elif event.is_run_failure and not failed_steps and event.job_failure_data.error is not None:
            error = _own_error(event.job_failure_data.error)
            lines = [line.strip() for line in error.message.splitlines() if line.strip()]
            stops.errors.append(
                Failure(
                    f"{where}: the run could not start",
                    _line(error).splitlines()[0],
                    result.run_id,
                    detail=tuple(line[:600] for line in lines[1:][-3:]),
                )
            )


# Dagster's wrappers around user code's own error, by name (a run's events carry errors serialized), read off the
# classes so a class Dagster renames fails here at import
WRAPPERS = tuple(
    c.__name__ for c in (DagsterExecutionStepExecutionError, DagsterResourceFunctionError, RetryRequestedFromPolicy)
)


def _own_error(error, attempts: int = 1):
    """The user code's own error under Dagster's wrappers (a retried step's last, "after N attempts")."""
    while error.cause and error.cls_name in WRAPPERS:
        error = error.cause
    if attempts > 1:
        error = error._replace(message=f"{_line(error).split(': ', 1)[-1].splitlines()[0]}, after {attempts} attempts")
    return error


def _line(error) -> str:
    text = error.message.split(": ", 1)[-1] if error.cls_name in error.message.split(":")[0] else error.message
    return f"{error.cls_name}: {text}"


def _listed(value: dg.MetadataValue) -> list:
    """A JSON list metadata value (CheckKeys.FAILING_SHARDS), as a list."""
    listed = value.value
    return listed if isinstance(listed, list) else []


def _meta(result: dg.ExecuteInProcessResult, asset: str) -> dict[str, dict]:
    """partition -> metadata of the asset's materialisations in a run."""
    return {
        str(m.partition): {k: v.value for k, v in m.metadata.items()}
        for m in result.asset_materializations_for_node(asset)
    }


def _committed_when_stopped(result: dg.ExecuteInProcessResult) -> dict[str, int]:
    """shard -> rows its failed completions step had committed (the recount in the failure's metadata)."""
    counts: dict[str, int] = {}
    for event in result.all_events:
        if event.is_step_failure and event.step_key == "completions":
            user = event.step_failure_data.user_failure_data
            if user and StepStopKeys.COMMITTED_BY_SHARD in user.metadata:
                by_shard = user.metadata[StepStopKeys.COMMITTED_BY_SHARD].value
                if isinstance(by_shard, dict):  # a JSON value: defs/faults.py writes the recount's dict
                    counts |= by_shard
    return counts


# the resources hold EnvVar placeholders until a run resolves them: these two read the same settings
def prompt_source() -> PromptSourceResource:
    return PromptSourceResource(path=Deployment.PROMPTS.value(), shard_size=int(Deployment.SHARD_SIZE.value()))


def data_dir() -> DataDirResource:
    return DataDirResource(path=Deployment.DATA_DIR.value(), local_path=Deployment.LOCAL_DIR.value())


def known_shards(instance: dg.DagsterInstance) -> list[str]:
    """The shards of the prompt source: the instance's partitions made to follow it (defs/prompts/sensors.py)."""
    keys, new, past_end = shard_changes(instance, prompt_source(), data_dir())
    if new:
        instance.add_dynamic_partitions(SHARDS, new)
    for key in past_end:
        instance.delete_dynamic_partition(SHARDS, key)
    return keys


def source_refused(command: str, console: Console) -> bool:
    """Say (one line, exit 2) why the prompt source may not write into the data dir, before anything is written."""
    from dflash_assets.defs.resources import refusal

    if refused := refusal(prompt_source(), data_dir()):
        console.print(f"[red]dflash {command}:[/] {refused}", highlight=False, soft_wrap=True)
        return True
    return False


def shard_range(command: str, shards: list[str], first: str | None, last: str | None, console: Console) -> list | None:
    """The shards from `first` to `last` (default: all), or None when one is not a shard (said in one line)."""
    first, last = first or shards[0], last or shards[-1]
    if unknown := [k for k in (first, last) if k not in shards]:
        console.print(
            f"[red]dflash {command}:[/] no shard {', '.join(unknown)}; the shards are {shards[0]}..{shards[-1]}"
        )
        return None
    return shards[shards.index(first) : shards.index(last) + 1]
