"""`dflash demo` and `dflash backfill`: shards through the Dagster job on the instance in DAGSTER_HOME.

Both run a range of shards the way a backfill launched from the UI does: runs of up to
DFLASH_SHARDS_PER_RUN shards (`BackfillPolicy.multi_run`), each run streaming its shards' prompts
through one dispatcher, here executed in this process one run after the other (no daemon needed).

The terminal gets the per-shard table and, when something stops a run, one short block: what stopped it,
the cap plan and the next command. Dagster's event stream (and every stack trace) goes to the run's event
log in DAGSTER_HOME, which the UI shows; `--verbose` prints it here as well. The exit status says which:
0 done, 1 failed, 2 bad input or config (the preflight refused the run), 3 stopped by a blocking check.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
from rich import box
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash_assets.definitions import defs
from dflash_assets.defs import pools
from dflash_assets.defs.completions.jobs import shard_pipeline_job
from dflash_assets.defs.continuation.jobs import continue_job
from dflash_assets.defs.metadata import (
    CheckKeys,
    ContinuationKeys,
    PromptShardKeys,
    ReportKeys,
    ShardRunKeys,
    StepStopKeys,
    TrainingSetKeys,
)
from dflash_assets.defs.partitions import SHARDS, SHARDS_PER_RUN
from dflash_assets.defs.prompts.sensors import shard_changes
from dflash_assets.defs.resources import DataDirResource, PromptSourceResource
from dflash_assets.defs.training.jobs import training_job
from dflash_assets.generation.plan import filling_window_note
from dflash_assets.quality.console import console_for_output, verbatim
from dflash_assets.quality.export import kept_lines, left_out_lines
from dflash_assets.quality.rejects import read_rejects
from dflash_assets.quality.trainer_settings import trainer_settings_line
from dflash_assets.settings import Deployment, GenerationSettings, TrainerSettings

DONE, FAILED, BAD_CONFIG, STOPPED_BY_CHECK = 0, 1, 2, 3  # exit statuses, documented in the README
ALL_SHARDS = "all shards"  # where the export's gate judged a config


def quiet(verbose: bool) -> dict:
    """Run config for the console logger: silent unless --verbose; the event log keeps everything either way."""
    return {"loggers": {"console": {"config": {"log_level": "DEBUG" if verbose else "CRITICAL"}}}}


# What a failure that re-running can cure looks like: the fleet went away or was slow, not a setting or a bug.
PASSING = (
    "FleetDown",
    "ServerError",
    "TimeoutError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ConnectionError",
    "ConnectionResetError",
)


@dataclass(frozen=True)
class Failure:
    """A failed run or step, said in a line or two: where, the first line of its cause, and the server's own words
    when a fleet did not start."""

    where: str
    message: str
    run_id: str
    detail: tuple[str, ...] = ()  # e.g. the last lines an emulator or sglang server wrote before it exited
    passing: bool = False  # re-running may cure it (a server down, a timeout), so say so
    says_next: bool = False  # the message ends with the next command itself (a full disk: free space, then...)


@dataclass(frozen=True)
class Window:
    """demo/backfill's --cap-policy and --overshoot (how requests are sized) and the trainer's settings
    (--trainer-max-length, --trainer-format, ...): the one window the requests are sized to and the checks, the
    answer and the export judge by, set in the quality resource alone. Defaults: the settings'."""

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

    @property
    def config_hash(self) -> str | None:
        """The run's own config (a command generates one): what its table, its checks and its export are of."""
        return min(self.config_hashes) if self.config_hashes else None

    def exit_status(self) -> int:
        return FAILED if self.errors else BAD_CONFIG if self.preflight else STOPPED_BY_CHECK if self.checks else DONE


def execute(
    job: str, instance: dg.DagsterInstance, run_config: dict, console: Console, shards: list[str] | None = None
) -> dg.ExecuteInProcessResult:
    """One run of `job` in this process, which is its worker: first the runs that died are failed and their pool
    slots freed (defs/pools.py), then this process is recorded in the run's tags (so a kill -9 of it is seen by the
    next run), and what a step waiting for a pool says is printed here (who holds it, alive or not, what frees it).
    """
    handler = RichHandler(console=console, show_time=False, show_level=False, show_path=False, markup=False)
    pools.log.addHandler(handler)
    pools.log.setLevel(logging.INFO)
    try:
        pools.reap_dead_runs(instance)
        tags = pools.worker_tags()
        if shards:
            tags |= {"dagster/asset_partition_range_start": shards[0], "dagster/asset_partition_range_end": shards[-1]}
        return defs.resolve_job_def(job).execute_in_process(
            instance=instance, run_config=run_config, raise_on_error=False, tags=tags
        )
    finally:
        pools.log.removeHandler(handler)


def record_failures(result: dg.ExecuteInProcessResult, where: str, stops: Stops) -> None:
    """Sort a run's failures: a blocking check, the preflight, or an error (its cause's first line, no stack
    trace). A run that failed before any step (the fleet resource did not start) is an error of the run itself."""
    failed_steps = False
    for event in result.all_events:
        if event.is_step_failure:
            failed_steps = True
            error, user = event.step_failure_data.error, event.step_failure_data.user_failure_data
            if error is None or error.cls_name == "DagsterAssetCheckFailedError":
                continue  # the evaluations say which checks and where
            error = _own_error(error)
            message = (user.description if user and user.description else _line(error)).strip()
            cause = user.metadata[StepStopKeys.CAUSE].value if user and StepStopKeys.CAUSE in user.metadata else None
            if user and cause == "check":
                failing = user.metadata[StepStopKeys.FAILING_CHECKS].value  # the export's gate, over all shards
                for name in failing if isinstance(failing, list) else []:
                    stops.checks.setdefault(str(name), []).append(ALL_SHARDS)
                continue
            if message.startswith("preflight: ") or cause == "config":
                stops.preflight.append(message.removeprefix("preflight: "))
            else:
                stops.errors.append(
                    Failure(
                        f"{where}, step {event.step_key}",
                        message.splitlines()[0],
                        result.run_id,
                        passing=cause != "exhausted" and _cause_of(error).cls_name in PASSING,
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


WRAPPERS = ("DagsterExecutionStepExecutionError", "DagsterResourceFunctionError")
RETRIES_RAN_OUT = "RetryRequestedFromPolicy"  # "Exceeded max_retries of N"; its cause is the last attempt's error


def _own_error(error):
    """Dagster's wrappers (step execution, resource init, retries run out) off: the user code's own error says what
    went wrong; when retries ran out, the last attempt's, "after N attempts"."""
    attempts = None
    while error.cause and error.cls_name in (*WRAPPERS, RETRIES_RAN_OUT):
        if error.cls_name == RETRIES_RAN_OUT and (ran_out := re.search(r"max_retries of (\d+)", error.message)):
            attempts = int(ran_out.group(1)) + 1
        error = error.cause
    if attempts is not None:
        error = error._replace(message=f"{_line(error).split(': ', 1)[-1].splitlines()[0]}, after {attempts} attempts")
    return error


def _cause_of(error):
    """A Failure raised for a step's last attempt (defs/faults.py) names its cause's class: judge by that."""
    return error.cause if error.cls_name == "Failure" and error.cause else error


def _line(error) -> str:
    text = error.message.split(": ", 1)[-1] if error.cls_name in error.message.split(":")[0] else error.message
    return f"{error.cls_name}: {text}"


COLUMNS = (
    "shard",
    "lines",
    "rejected",
    "prompts",
    "done",
    "new",
    "fail",
    "cut",
    "inside",
    "P50",
    "P90",
    "P99",
    "checks",
)


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


def prompt_source() -> PromptSourceResource:
    # the resources hold EnvVar placeholders until a run resolves them; read the same settings here
    return PromptSourceResource(path=Deployment.PROMPTS.value(), shard_size=int(Deployment.SHARD_SIZE.value()))


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
    from dflash_assets.generation.prompts import SourceError
    from dflash_assets.generation.shards import source_refusal

    source = prompt_source()
    try:
        refusal = source_refusal(source.resolved(), source.shard_size, data_dir().resolved())
    except (SourceError, ValueError) as e:  # no source, an empty one, a bad shard size
        refusal = str(e)
    if refusal:
        console.print(f"[red]dflash {command}:[/] {refusal}", highlight=False, soft_wrap=True)
    return refusal is not None


def run_shards(
    instance: dg.DagsterInstance,
    shards: list[str],
    completions: dict,
    console: Console,
    verbose: bool = False,
    window: Window = Window(),
) -> Stops:
    """Materialise `shards` in runs of SHARDS_PER_RUN with `completions` as that asset's run config (the CLI's
    flags) and `window`'s trainer as the quality resource's (the checks' window, and the requests'); print a table;
    return what stopped runs."""
    run_config = {**quiet(verbose), "resources": window.resources(), "ops": {"completions": {"config": completions}}}
    stops = Stops()
    table = Table(
        title=f"completions by shard (cut: finish_reason = length; inside: cut inside the trainer's window "
        f"max_length {window.trainer_max_length}; P: completion tokens)",
        box=box.SIMPLE_HEAD,
    )
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "shard" else "right", no_wrap=True)
    failed_checks: dict[str, list[str]] = {}
    no_figures: list[str] = []
    recounted: list[str] = []  # their completions step stopped: done is the recount its failure recorded
    runs = [shards[i : i + SHARDS_PER_RUN] for i in range(0, len(shards), SHARDS_PER_RUN)]
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(f"materialising shards in {len(runs)} run(s)", total=len(shards))
        for chunk in runs:
            result = execute(shard_pipeline_job.name, instance, run_config, progress.console, chunk)
            source, comp = _meta(result, "prompt_shards"), _meta(result, "completions")
            report, checks = _meta(result, "length_quality_report"), result.get_asset_check_evaluations()
            stopped = {} if result.success else _committed_when_stopped(result)
            if not result.success:
                no_figures += [shard for shard in chunk if shard not in comp and shard not in stopped]
                recounted += [shard for shard in chunk if shard not in comp and shard in stopped]
            for shard in chunk:
                s, c, r = source.get(shard, {}), comp.get(shard, {}), report.get(shard, {})
                failing = [e for e in checks if not e.passed and shard in _listed(e.metadata[CheckKeys.FAILING_SHARDS])]
                for e in failing:
                    failed_checks.setdefault(f"{e.check_name} ({e.severity.value})", []).append(shard)
                    if e.blocking and e.severity == dg.AssetCheckSeverity.ERROR:
                        stops.checks.setdefault(e.check_name, []).append(shard)
                if c.get(ShardRunKeys.CONFIG_HASH):
                    stops.config_hashes.add(c[ShardRunKeys.CONFIG_HASH])
                stops.filling_window += c.get(ShardRunKeys.PROMPTS_FILLING_WINDOW, 0)
                rejected = (
                    s.get(PromptShardKeys.REJECTED, 0)
                    + c.get(ShardRunKeys.REJECTED_PREFLIGHT, 0)
                    + c.get(ShardRunKeys.REJECTED_SERVER, 0)
                )
                table.add_row(
                    shard,
                    str(s.get(PromptShardKeys.LINES, "-")),
                    str(rejected),
                    str(c.get(ShardRunKeys.PROMPTS, "-")),
                    str(c.get(ShardRunKeys.COMPLETED, stopped.get(shard, "-"))),
                    str(c[ShardRunKeys.COMPLETED] - c[ShardRunKeys.ALREADY_DONE]) if c else "-",
                    str(c.get(ShardRunKeys.FAILED, "-")),
                    str(r.get(ReportKeys.TRUNCATION_RATE, "-")),
                    str(r.get(ReportKeys.CUT_INSIDE_WINDOW_RATE, "-")),
                    *(str(r.get(k, "-")) for k in (ReportKeys.P50, ReportKeys.P90, ReportKeys.P99)),
                    f"{len(checks) - len(failing)}/{len(checks)}",
                )
            if not result.success:
                record_failures(result, f"shards {chunk[0]}..{chunk[-1]}", stops)
            progress.advance(task, len(chunk))
    table.title = (
        f"completions of config {stops.config_hash} by shard " if stops.config_hash else "completions by shard "
    ) + str(table.title).removeprefix("completions by shard ")
    console.print(table)
    rejects = read_rejects(data_dir().resolved(), shards)
    for line in rejects.lines(f"{data_dir().resolved()}/rejects/ (dflash report counts them by stage and reason)"):
        console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)  # a path is copied whole
    print_other_configs(stops.config_hash, window, console)
    if no_figures:
        console.print(
            f"  shard(s) {', '.join(no_figures)}: no figures (-): their run failed before completions "
            f"committed any (the cause is below)",
            highlight=False,
        )
    if recounted:
        console.print(
            f"  shard(s) {', '.join(recounted)}: done is what their run committed before it stopped (recounted from "
            f"the data dir; the cause is below)",
            highlight=False,
        )
    if stops.filling_window:  # preflight counted them before any request
        verbatim(console, f"  {filling_window_note(stops.filling_window, window.trainer_max_length)}")
    for name, where in sorted(failed_checks.items()):
        console.print(f"  check {name} did not pass on shard(s) {', '.join(where)}", highlight=False)
    if failed_checks:
        console.print("  (a blocking check that fails with ERROR stops the training set; WARN asks you to look)")
    return stops


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


def print_other_configs(run_config: str | None, window: Window, console: Console) -> None:
    """The data dir's other configs, one line each: beside the run's own figures, never pooled into them."""
    from dflash_assets.store.configs import list_configs

    others = [c for c in list_configs(data_dir().resolved(), window.trainer_max_length) if c.config_hash != run_config]
    if others:
        console.print("also in this data dir (not in the figures above; `dflash configs` compares them):")
        for c in others:
            console.print(f"  {c.line()}", highlight=False)


def export(
    instance: dg.DagsterInstance,
    config_hash: str,
    chosen_by: str,
    window: Window,
    console: Console,
    stops: Stops,
    verbose: bool = False,
) -> bool:
    """The gated export of one config (the drafter_training_set asset and its checks, with the summary of the same
    config, as the UI runs them): the files' place on success, else what stopped it, in `stops`."""
    choice = {"config": {"config_hash": config_hash, "chosen_by": chosen_by}}
    result = execute(
        training_job.name,
        instance,
        {
            **quiet(verbose),
            "resources": window.resources(),
            "ops": {"drafter_training_set": choice, "length_quality_summary": choice},
        },
        console,
    )
    if result.success:
        meta = next(iter(_meta(result, "drafter_training_set").values()))
        t = TrainingSetKeys
        verbatim(
            console,
            f"drafter training set: {meta[t.ROW_COUNT]} rows of config {meta[t.CONFIG_HASH]} "
            f"(chosen by: {meta[t.CHOSEN_BY]}) in {meta[t.JSONL]} (manifest beside it)",
        )
        left_out, kept = left_out_lines(meta[t.MANIFEST]), kept_lines(meta[t.MANIFEST])
        for heading, lines in (("left out, by reason:", left_out), ("kept, with a note:", kept)):
            if lines:
                console.print(f"  {heading}", highlight=False)
            for line in lines:
                console.print(f"    {line}", highlight=False)
        if not left_out:
            console.print("  left out: nothing", highlight=False)
        verbatim(console, trainer_settings_line(meta[t.MANIFEST], Path(meta[t.JSONL]).parent))
        return True
    if config_hash != "all":
        stops.config_hashes.add(config_hash)
    if stops.checks:  # the shard runs' checks already said which
        console.print(f"drafter training set: not written while a blocking check fails on config {config_hash}")
        return False
    record_failures(result, "training export", stops)
    if stops.checks and config_hash == "all":  # said per config: each one a blocking check fails on, by its own rows
        stops.config_hashes |= failing_configs(stops, window)
        failing = ", ".join(f"config {h}" for h in sorted(stops.config_hashes)) or "the configs together"
        console.print(f"drafter training set (--config all): not written: a blocking check fails on {failing}")
    elif stops.checks:
        console.print(f"drafter training set: not written: a blocking check fails on config {config_hash}")
    return False


def failing_configs(stops: Stops, window: Window) -> set[str]:
    """The data dir's configs that a check in `stops.checks` fails on, each judged by its own rows."""
    from dflash_assets.quality import run_checks
    from dflash_assets.store.configs import list_configs

    root, quality = data_dir().resolved(), window.quality()
    return {
        c.config_hash
        for c in list_configs(root, window.trainer_max_length)
        if any(not o.passed for o in run_checks(root, config_hash=c.config_hash, quality=quality, names=stops.checks))
    }


def export_run_config(
    instance: dg.DagsterInstance, stops: Stops, window: Window, console: Console, verbose: bool = False
) -> None:
    """A shard command's last step: the export of the config it ran (never another one of the data dir)."""
    if stops.errors:  # the export could only say the consequence ("no completions to export"), never the cause
        console.print("drafter training set: not written: the shard runs failed (the cause is below)")
    elif not stops.preflight and stops.config_hash:
        export(instance, stops.config_hash, "run", window, console, stops, verbose)


def data_dir() -> DataDirResource:
    # the resources hold EnvVar placeholders until a run resolves them; read the same settings here
    return DataDirResource(path=Deployment.DATA_DIR.value(), local_path=Deployment.LOCAL_DIR.value())


def print_stop(stops: Stops, console: Console, rerun: Callable[[int], str], window: Window = Window()) -> int:
    """One short block: what stopped the run, the cap plan, and the exact next command. Returns the exit status."""
    from dflash_assets.quality import run_checks
    from dflash_assets.quality.answer import cap_answers
    from dflash_assets.quality.console import print_answer

    # figures, not syntax, to colour; a soft wrap: a path or a command in these lines is never broken in two
    say = lambda text="": console.print(text, highlight=False, soft_wrap=True)  # noqa: E731
    if stops.errors:  # the first cause first; the same cause again is counted, not repeated
        first = stops.errors[0]
        say(f"[red]Failed[/]: {first.where}: {first.message}")
        for line in first.detail:
            say(f"  {line}")
        same = sum(e.message == first.message for e in stops.errors[1:])
        others = [e for e in stops.errors[1:] if e.message != first.message]
        if same:
            say(f"  (and {same} more run(s) with the same cause)")
        for error in others:
            say(f"Also failed: {error.where}: {error.message}")
        say(f"The stack trace is in the event log of run {first.run_id} (the UI shows it).")
        if first.says_next:  # its line ends with the next command (a full disk: free space, then ...)
            pass
        elif first.passing:
            say(
                "Next: the cause can pass (a server down, a timeout): run the same command again; committed "
                "completions are kept, only the rest runs."
            )
        else:
            say("Next: fix the cause above, then run the same command again (committed completions are kept).")
    if stops.preflight:
        say("[red]Stopped before any request was sent[/]: the preflight refused the run.")
        for message in dict.fromkeys(stops.preflight):
            say(f"  {message}")
        needed = max(int(n) for m in stops.preflight for n in re.findall(r"--context-length (\d+)", m) or [0])
        if needed:
            say(f"Next: restart the servers with --context-length {needed} (or lower --max-output-tokens).")
        return stops.exit_status()
    if not stops.checks or stops.errors:
        return stops.exit_status()
    root = data_dir().resolved()
    quality = window.quality()
    for config_hash in sorted(stops.config_hashes):
        outcomes = [
            o for o in run_checks(root, config_hash=config_hash, quality=quality, names=stops.checks) if not o.passed
        ]
        for o in outcomes:
            headline = re.sub(r"[*`]", "", o.summary_md.split("\n\n")[0])
            shards = stops.checks[o.name]
            where = ALL_SHARDS if ALL_SHARDS in shards else f"shards {', '.join(shards)}"
            say(f"[red]Stopped by the blocking check {o.name}[/] ({where}): {headline}")
        answers = cap_answers(root, quality, config_hash)
        if not answers or "truncation_rate" not in stops.checks:
            say(
                "Next: read the check's rows in the UI (asset length_quality_report, its checks tab); the training "
                "set stays unwritten until every blocking check passes."
            )
            continue
        answer = answers[0]
        print_answer(answer, console)
        best = answer.recommended
        if best is None:
            continue
        before = ""
        if best.fits_context is False:
            before = f"restart the servers with --context-length {best.context_needed_max}, then "
        if answer.plan is not None and answer.plan.by_turn:  # all_turns: a cut turn ended its conversation
            say(f"Next: {before}generate every conversation again at the new cap (the turns after a cut one were never")
            verbatim(console, f"  generated, so cut turns are not continued): {rerun(best.cap)}")
            continue
        say(f"Next: {before}continue the {answer.truncated} cut rows from where they stopped (the others are kept):")
        verbatim(console, f"  dflash continue --to {best.cap}")
        verbatim(console, f"  or generate every prompt again at the new cap: {rerun(best.cap)}")
    return stops.exit_status()


def regenerate_text(regenerate: str) -> str | None:
    """What `regenerate` does to the source's multi-turn prompts, said before anything runs; None for a source without
    any (auto is last_turn there: the same config as ever) and for all_turns."""
    from dflash_assets.generation.prompts import SourceError, source_turns

    try:
        turns = source_turns(Deployment.PROMPTS.value())
    except SourceError:
        return None  # the run says what is wrong with the source
    if not turns.with_history or regenerate == "all_turns":
        return None
    share = f"{turns.with_history:,} of {turns.prompts:,} prompts carry earlier assistant turns"
    if regenerate == "auto":
        return (
            f"regenerate auto: all_turns, since {share}: every assistant turn is regenerated, in order, so the "
            f"trainer learns only the target model's answers (the default was last_turn, which kept the source's "
            f"answers in the history, and SpecForge trains on every assistant turn: docs/multi-turn.md)"
        )
    return (
        f"regenerate last_turn: {share}, whose earlier answers are the source's own text. SpecForge puts loss on "
        f"every assistant turn: set its data.train_only_last_turn: true, or it learns them (off-policy); the "
        f"manifest counts these rows. --regenerate auto regenerates every turn"
    )


def policy_text(window: Window) -> str:
    policy = f"cap_policy window (+{window.overshoot} overshoot), " if window.cap_policy == "window" else ""
    return f"{policy}trainer's window max_length {window.trainer_max_length}"


def print_superseded(stops: Stops, console: Console, window: Window) -> None:
    """One line per other config left incomplete beside the run's own: superseded, with its counts, blocking nothing
    (accounting's judgement of the run's config over every shard, quality/accounting.py)."""
    from dflash_assets.quality import run_checks

    for config_hash in sorted(stops.config_hashes):
        (o,) = run_checks(
            data_dir().resolved(), config_hash=config_hash, quality=window.quality(), names=["accounting"]
        )
        for line in o.summary_md.splitlines():
            if ", superseded (" in line:
                console.print(f"  {re.sub(r'[*`]', '', line.removeprefix('- '))}; it blocks nothing", highlight=False)


def print_window_answer(stops: Stops, console: Console, window: Window, rerun: str) -> None:
    """When no check stopped the run: whether the cut rows matter to this trainer, and what decoding past the
    window cost (the window policy's command when it cost anything)."""
    from dflash_assets.quality import run_checks
    from dflash_assets.quality.outcome import num, pct

    for config_hash in sorted(stops.config_hashes):
        (o,) = run_checks(
            data_dir().resolved(), config_hash=config_hash, quality=window.quality(), names=["decoded_past_window"]
        )
        m: dict = o.metadata
        if not m["window_complete_rows"] and not m["decoded_past_window_tokens"]:
            continue
        console.print(
            f"config {config_hash}: {num(m['window_complete_rows'])} rows "
            f"({pct(m['window_complete_rate'])}) were cut at or past the trainer's window max_length "
            f"{num(window.trainer_max_length)}: window-complete, the trainer reads each as it reads the "
            f"complete answer, so they are exported. {num(m['decoded_past_window_tokens'])} of "
            f"{num(m['decoded_tokens'])} decoded tokens ({pct(m['past_window_rate'])}) lie past the window.",
            highlight=False,
        )
        if not o.passed:
            verbatim(console, f"Next time, decode only what the trainer reads: {rerun}")


def generate_and_export(
    instance: dg.DagsterInstance, shards: list[str], completions: dict, console: Console, verbose: bool, window: Window
) -> Stops:
    """What demo and backfill share: what regenerate does to the source, the shards through Dagster, the configs the
    run superseded, and the export of the run's own config."""
    if said := regenerate_text(completions["regenerate"]):
        console.print(said, highlight=False)
    stops = run_shards(instance, shards, completions, console, verbose, window)
    print_superseded(stops, console, window)
    export_run_config(instance, stops, window, console, verbose)
    return stops


def run_demo(
    completions: dict,
    console: Console | None = None,
    verbose: bool = False,
    again: Callable[[dict], str] = lambda overrides: "",
    trainer: TrainerSettings = TrainerSettings(),
) -> int:
    """The whole pipeline over every shard for `trainer`; `again(overrides)`: the flags that repeat `completions`
    and the trainer's, changed by `overrides`, in the next command."""
    console = console or console_for_output()
    if source_refused("demo", console):
        return BAD_CONFIG
    instance = dg.DagsterInstance.get()
    shards = known_shards(instance)
    window = Window.of(completions, trainer)
    console.print(
        f"dflash demo: {len(shards)} shards (cap {completions['max_output_tokens']} tokens, "
        f"{policy_text(window)}), DAGSTER_HOME={os.environ['DAGSTER_HOME']}, "
        f"data in {os.environ['DFLASH_DATA_DIR']}/",
        highlight=False,
    )
    stops = generate_and_export(instance, shards, completions, console, verbose, window)
    if not stops.checks and not stops.errors and not stops.preflight:
        print_window_answer(
            stops,
            console,
            window,
            f"dflash demo{again({'cap_policy': 'window'})} --max-output-tokens {completions['max_output_tokens']}",
        )
    verbatim(
        console,
        "The UI (event log, reports, checks):  DAGSTER_HOME="
        + os.environ["DAGSTER_HOME"]
        + " uv run dg dev   then http://127.0.0.1:3000",
    )
    return print_stop(stops, console, lambda cap: f"dflash demo{again({})} --max-output-tokens {cap}", window)


def run_backfill(
    first: str | None,
    last: str | None,
    completions: dict,
    console: Console | None = None,
    verbose: bool = False,
    again: Callable[[dict], str] = lambda overrides: "",
    trainer: TrainerSettings = TrainerSettings(),
) -> int:
    console = console or console_for_output()
    if source_refused("backfill", console):
        return BAD_CONFIG
    instance = dg.DagsterInstance.get()
    shards = known_shards(instance)
    first, last = first or shards[0], last or shards[-1]
    unknown = [k for k in (first, last) if k not in shards]
    if unknown:
        console.print(
            f"[red]dflash backfill:[/] no shard {', '.join(unknown)}; the shards are {shards[0]}..{shards[-1]}"
        )
        return BAD_CONFIG
    chosen = shards[shards.index(first) : shards.index(last) + 1]
    window = Window.of(completions, trainer)
    console.print(
        f"dflash backfill: shards {first}..{last} ({len(chosen)}), cap {completions['max_output_tokens']}, "
        f"up to {SHARDS_PER_RUN} shards per run, {policy_text(window)}, "
        f"DAGSTER_HOME={os.environ['DAGSTER_HOME']}",
        highlight=False,
    )
    stops = generate_and_export(instance, chosen, completions, console, verbose, window)
    command = f"dflash backfill --from {first} --to {last}"
    if not stops.checks and not stops.errors and not stops.preflight:
        print_window_answer(
            stops,
            console,
            window,
            f"{command}{again({'cap_policy': 'window'})} --max-output-tokens {completions['max_output_tokens']}",
        )
    return print_stop(stops, console, lambda cap: f"{command}{again({})} --max-output-tokens {cap}", window)


CONTINUE_COLUMNS = ("shard", "continued", "copied", "still cut", "tokens reused", "generated", "saved")


def run_continue(
    new_cap: int | None,
    first: str | None,
    last: str | None,
    console: Console | None = None,
    verbose: bool = False,
    to_window: int | None = None,
) -> int:
    """Continue every shard's cut rows to `new_cap` from where they stopped (or, with `to_window`, a window-policy
    config's window-complete rows to the larger window); print the reuse and the new answer."""
    from dflash_assets.quality.answer import cap_answers
    from dflash_assets.quality.console import print_answer
    from dflash_assets.quality.outcome import num, pct

    console = console or console_for_output()
    instance = dg.DagsterInstance.get()
    shards = known_shards(instance)
    first, last = first or shards[0], last or shards[-1]
    if unknown := [k for k in (first, last) if k not in shards]:
        console.print(
            f"[red]dflash continue:[/] no shard {', '.join(unknown)}; the shards are {shards[0]}..{shards[-1]}"
        )
        return BAD_CONFIG
    chosen = shards[shards.index(first) : shards.index(last) + 1]
    target = f"the trainer's window {to_window}" if to_window else f"cap {new_cap}"
    console.print(
        f"dflash continue: shards {first}..{last} ({len(chosen)}) to {target}, cut rows taken on from "
        f"where they stopped",
        highlight=False,
    )
    window = Window("window", trainer=TrainerSettings(max_length=to_window)) if to_window else Window()
    run_config = {
        **quiet(verbose),
        "resources": window.resources(),
        "ops": {
            "continued_completions": {
                "config": {
                    "parent_config_hash": "latest",
                    "to_window": to_window or 0,
                    **({} if to_window else {"new_max_output_tokens": new_cap}),
                }
            }
        },
    }
    stops, table = (
        Stops(),
        Table(
            box=box.SIMPLE_HEAD,
            title="continued by shard (tokens reused: taken over from the smaller cap, not generated again)",
        ),
    )
    for col in CONTINUE_COLUMNS:
        table.add_column(col, justify="left" if col == "shard" else "right", no_wrap=True)
    reused = total = 0
    for chunk in [chosen[i : i + SHARDS_PER_RUN] for i in range(0, len(chosen), SHARDS_PER_RUN)]:
        result = execute(continue_job.name, instance, run_config, console, chunk)
        meta = _meta(result, "continued_completions")
        for shard in chunk:
            m = meta.get(shard)
            if not m:
                table.add_row(shard, *"------")
                continue
            k = ContinuationKeys
            stops.config_hashes.add(m[k.CONFIG_HASH])
            reused += m[k.TOKENS_REUSED]
            total += m[k.TOKENS_REUSED] + m[k.TOKENS_GENERATED]
            table.add_row(
                shard,
                num(m[k.ROWS_CONTINUED]),
                num(m[k.ROWS_COPIED]),
                num(m[k.STILL_TRUNCATED]),
                num(m[k.TOKENS_REUSED]),
                num(m[k.TOKENS_GENERATED]),
                pct(m[k.SAVED_SHARE]),
            )
        if not result.success:
            record_failures(result, f"shards {chunk[0]}..{chunk[-1]}", stops)
    console.print(table)
    if total:
        console.print(
            f"tokens reused: {num(reused)} of {num(total)} ({pct(reused / total)}) of the new config's "
            f"completion tokens were not generated again",
            highlight=False,
        )
    for config_hash in sorted(stops.config_hashes):
        for answer in cap_answers(data_dir().resolved(), window.quality(), config_hash):
            print_answer(answer, console)
    if stops.preflight:
        console.print("[red]Stopped[/]: " + " ".join(dict.fromkeys(stops.preflight)), highlight=False)
        return BAD_CONFIG if not stops.errors else FAILED
    if stops.errors:
        return print_stop(stops, console, lambda cap: f"dflash continue --to {cap}", window)
    console.print(
        "Next: `dflash report` for the checks over the new config, then `dflash export` (the latest config, the "
        "one just continued; `dflash configs` lists them all).",
        highlight=False,
    )
    return DONE


def run_export(config: str, console: Console | None = None, verbose: bool = False, window: Window = Window()) -> int:
    """`dflash export`: the gated export of one config (a hash, `latest` or `all`) through the same asset and
    checks as the UI; where the files are, or what stopped it (exit 3 for a blocking check)."""
    from dflash_assets.store.configs import list_configs

    console = console or console_for_output()
    root = data_dir().resolved()
    configs = list_configs(root, window.trainer_max_length)
    if not configs:
        console.print(f"[red]dflash export:[/] no completions under {root}: run dflash demo or dflash backfill first")
        return BAD_CONFIG
    hashes = [c.config_hash for c in configs]
    if config not in ("latest", "all", *hashes):
        console.print(
            f"[red]dflash export:[/] no config {config} under {root}; give one of {', '.join(hashes)} "
            f"(`dflash configs` compares them), latest or all",
            highlight=False,
        )
        return BAD_CONFIG
    chosen = hashes[0] if config == "latest" else config
    console.print(
        f"dflash export: config {chosen}" + (" (latest: the most recently written)" if config == "latest" else ""),
        highlight=False,
    )
    stops = Stops()
    export(dg.DagsterInstance.get(), chosen, "latest" if config == "latest" else "explicit", window, console, stops)
    return print_stop(stops, console, lambda cap: f"dflash backfill --max-output-tokens {cap}", window)
