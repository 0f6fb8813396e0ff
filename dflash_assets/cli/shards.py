"""`dflash demo`, `dflash backfill` and `dflash continue`: every shard or a range of shards through the Dagster
jobs on the instance in DAGSTER_HOME, the per-shard table, and the export of the run's own config."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import dagster as dg
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash_assets.cli.console import RUN_DROP_FIRST, console_for_output, fit, say_with_command, verbatim
from dflash_assets.cli.environment import as_printed, ui_command
from dflash_assets.cli.export import export_run_config
from dflash_assets.cli.flags import (
    _completions_config,
    refuse_cap_beyond_context,
    repeated_flags,
    request_cap,
    trainer_flags,
)
from dflash_assets.cli.parser import build_parser
from dflash_assets.cli.render import (
    policy_text,
    print_cap_past_window,
    print_old_default,
    print_other_configs,
    print_stop,
    print_superseded,
    print_window_answer,
    regenerate_text,
)
from dflash_assets.cli.runner import (
    BAD_CONFIG,
    DONE,
    FAILED,
    Stops,
    Window,
    _committed_when_stopped,
    _listed,
    _meta,
    data_dir,
    execute,
    known_shards,
    quiet,
    record_failures,
    shard_range,
    source_refused,
)
from dflash_assets.defs.completions.assets import CompletionsConfig
from dflash_assets.defs.completions.jobs import shard_pipeline_job
from dflash_assets.defs.continuation.assets import ContinuationConfig
from dflash_assets.defs.continuation.jobs import continue_job
from dflash_assets.defs.metadata import CheckKeys, ContinuationKeys, PromptShardKeys, ReportKeys, ShardRunKeys
from dflash_assets.defs.partitions import SHARDS_PER_RUN
from dflash_assets.generation.plan import filling_window_note
from dflash_assets.quality.report.rejects import read_rejects
from dflash_assets.settings import TrainerSettings

COLUMNS = (
    "shard",
    "prompts",
    "rejected",
    "done",
    "new",
    "fail",
    "left",
    "cut",
    "inside",
    "P50",
    "P90",
    "P99",
    "checks",
)


FIRST_REJECTS = 3  # the rejects a run's closing lines name one by one (--full: every one)
PROGRESS_EVERY_S = 5.0  # a progress line this often when the output is not a terminal (a bar on one)


def progress_text() -> str | None:
    """The generation running in this process as a progress line (rows, tokens/s, cut, time left); None if none."""
    from dflash_assets.generation.send import RUNNING

    if not RUNNING:
        return None
    f = RUNNING[0].figures()
    cut = f"{f.cut:,} ({f.cut / f.answered:.1%})" if f.answered else "0"
    left = (f.total - f.answered) * f.elapsed_s / f.answered if f.answered else None
    eta = f", ETA {int(left) // 60}:{int(left) % 60:02d}" if left is not None else ""
    return f"rows {f.answered:,}/{f.total:,}, {f.tokens / f.elapsed_s:,.0f} tokens/s, cut {cut}{eta}"


def watcher(show: Callable[[str], None], terminal: bool) -> Callable[[], None]:
    """A run's progress: on a terminal `show` at every moment, elsewhere a line on stderr every PROGRESS_EVERY_S."""
    import sys
    import time

    last = time.monotonic()

    def watch() -> None:
        nonlocal last
        if (text := progress_text()) is None:
            return
        if terminal:
            show(text)
        elif time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            print(f"  {text}", file=sys.stderr, flush=True)

    return watch


@dataclass
class _Tally:
    """What run_shards learns from its runs besides the table's rows."""

    stops: Stops = field(default_factory=Stops)
    failed_checks: dict[str, list[str]] = field(default_factory=dict)
    judged: bool = False  # any check ran: a run that failed before its checks says nothing of them
    no_figures: list[str] = field(default_factory=list)
    recounted: list[str] = field(default_factory=list)  # their completions step stopped: done is the recount


def run_shards(
    instance: dg.DagsterInstance,
    shards: list[str],
    completions: dict,
    console: Console,
    verbose: bool = False,
    window: Window = Window(),
    full: bool = False,
) -> Stops:
    """Materialise `shards` with `completions` (its run config) and `window`; print a table; the stops."""
    typed = {"completions": CompletionsConfig(**completions)}  # refused here, as the asset would, if a flag is wrong
    run_config = dg.RunConfig(ops=typed, resources=window.resources(), **quiet(verbose))
    tally = _Tally()
    table = _shard_table(window)
    runs = [shards[i : i + SHARDS_PER_RUN] for i in range(0, len(shards), SHARDS_PER_RUN)]
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=16),  # the shards done; the description says the rows, the pace, the cut and the ETA
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,  # else rich redraws it 10 times a second for nobody, as long as the run
    ) as progress:
        what = f"materialising shards in {len(runs)} run(s)"
        task = progress.add_task(what, total=len(shards))
        watch = watcher(lambda text: progress.update(task, description=text), console.is_terminal)
        for chunk in runs:
            result = execute(shard_pipeline_job.name, instance, run_config, progress.console, chunk, watch)
            _add_rows(table, chunk, result, tally)
            if not result.success:
                record_failures(result, f"shards {chunk[0]}..{chunk[-1]}", tally.stops)
            progress.advance(task, len(chunk))
    if tally.stops.config_hash:
        table.title = str(table.title).replace("completions", f"completions of config {tally.stops.config_hash}", 1)
    console.print(fit(table, console.width, RUN_DROP_FIRST))
    _say_below_the_table(console, shards, tally, window, full)
    return tally.stops


def _shard_table(window: Window) -> Table:
    table = Table(
        title=f"completions by shard: prompts = rejected + done + fail + left (rejected: at the source, the "
        f"preflight or the server; new: done by this run); cut, inside: turn rows cut at the cap, cut inside the "
        f"trainer's window max_length {window.trainer_max_length}; P: completion tokens",
        box=box.SIMPLE_HEAD,
    )
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "shard" else "right", no_wrap=True)
    return table


def _add_rows(table: Table, chunk: list[str], result: dg.ExecuteInProcessResult, tally: _Tally) -> None:
    """One row a shard of a run's `chunk`, from its steps' metadata (or its failure's recount); the rest to `tally`."""
    source, comp = _meta(result, "prompt_shards"), _meta(result, "completions")
    report, checks = _meta(result, "length_quality_report"), result.get_asset_check_evaluations()
    tally.judged = tally.judged or bool(checks)
    stopped = {} if result.success else _committed_when_stopped(result)
    if not result.success:
        tally.no_figures += [shard for shard in chunk if shard not in comp and shard not in stopped]
        tally.recounted += [shard for shard in chunk if shard not in comp and shard in stopped]
    for shard in chunk:
        s, c, r = source.get(shard, {}), comp.get(shard, {}), report.get(shard, {})
        failing = [e for e in checks if not e.passed and shard in _listed(e.metadata[CheckKeys.FAILING_SHARDS])]
        for e in failing:
            tally.failed_checks.setdefault(f"{e.check_name} ({e.severity.value})", []).append(shard)
            if e.blocking and e.severity == dg.AssetCheckSeverity.ERROR:
                tally.stops.checks.setdefault(e.check_name, []).append(shard)
        if c.get(ShardRunKeys.CONFIG_HASH):
            tally.stops.config_hashes.add(c[ShardRunKeys.CONFIG_HASH])
        tally.stops.filling_window += c.get(ShardRunKeys.PROMPTS_FILLING_WINDOW, 0)
        rejected = (
            s.get(PromptShardKeys.REJECTED, 0)
            + c.get(ShardRunKeys.REJECTED_PREFLIGHT, 0)
            + c.get(ShardRunKeys.REJECTED_SERVER, 0)
        )
        lines, done = s.get(PromptShardKeys.LINES), c.get(ShardRunKeys.COMPLETED, stopped.get(shard))
        failed = c.get(ShardRunKeys.FAILED)
        known = None not in (lines, done, failed)
        table.add_row(
            shard,
            str(lines if lines is not None else "-"),
            str(rejected),
            str(done if done is not None else "-"),
            str(c[ShardRunKeys.COMPLETED] - c[ShardRunKeys.ALREADY_DONE]) if c else "-",
            str(failed if failed is not None else "-"),
            str(lines - rejected - done - failed) if known else "-",
            str(r.get(ReportKeys.TRUNCATION_RATE, "-")),
            str(r.get(ReportKeys.CUT_INSIDE_WINDOW_RATE, "-")),
            *(str(r.get(k, "-")) for k in (ReportKeys.P50, ReportKeys.P90, ReportKeys.P99)),
            f"{len(checks) - len(failing)}/{len(checks)}",
        )


def _say_below_the_table(console: Console, shards: list[str], tally: _Tally, window: Window, full: bool) -> None:
    """The rejects, the shards without figures or recounted, and the checks that did not pass (each with --full)."""
    rejects = read_rejects(data_dir().resolved(), shards, first=None if full else FIRST_REJECTS)
    for line in rejects.lines(as_printed("dflash rejects", prompts=False)):
        say_with_command(console, f"  {line}")
    if full:
        print_other_configs(tally.stops.config_hash, window, console)
    for listed, said in (
        (tally.no_figures, "no figures (-): their run failed before completions committed any (the cause is below)"),
        (
            tally.recounted,
            "done is what their run committed before it stopped (recounted from the data dir; the cause is below)",
        ),
    ):
        if listed:
            console.print(f"  shard(s) {', '.join(listed)}: {said}", highlight=False)
    if tally.stops.filling_window and full:  # preflight counted them before any request (the answer counts them)
        verbatim(console, f"  {filling_window_note(tally.stops.filling_window, window.trainer_max_length)}")
    failed_checks = tally.failed_checks
    if full:
        for name, where in sorted(failed_checks.items()):
            console.print(f"  check {name} did not pass on shard(s) {', '.join(where)}", highlight=False)
    elif tally.judged:
        full_report = as_printed("dflash report --full", prompts=False)
        severities = [name.rsplit(" ", 1)[-1].strip("()") for name in failed_checks]
        said = ", ".join(f"{severities.count(s)} {s}" for s in dict.fromkeys(severities))
        say_with_command(
            console,
            f"  checks that did not pass on some shard: {len(failed_checks)} ({said}); they, the cap plan and every "
            f"shard: {full_report}"
            if failed_checks
            else f"  every check passed; the cap plan and every shard are in {full_report}",
        )
    if failed_checks and full:
        console.print("  (a blocking check that fails with ERROR stops the training set; WARN asks you to look)")


def print_quarantined(shards: list[str], stops: Stops, console: Console, retry: str) -> None:
    """The prompts quarantined in these shards, by id, and the command that sends them again."""
    from dflash_assets.generation.quarantine import QUARANTINED, quarantined

    found = quarantined(data_dir().resolved(), shards, stops.config_hash)
    if found:
        named = ", ".join(f"{r.prompt_id} (shard {r.shard})" for r in found[:5]) + (", ..." if len(found) > 5 else "")
        verbatim(
            console,
            f"Quarantined, {QUARANTINED} under it, not sent again: {named}. Once the cause is fixed, to send "
            f"{'it' if len(found) == 1 else 'them'} again: {retry}",
        )


@dataclass(frozen=True)
class Launch:
    """How a shard run was started, as its closing lines repeat it."""

    command: str
    again: Callable[[dict], str] = lambda overrides: ""
    ui: bool = False

    def printed(self, overrides: dict | None = None, tail: str = "") -> str:
        """The command with its flags, `overrides` in place, and `tail`, as printed (the data it is of)."""
        return as_printed(f"{self.command}{self.again(overrides or {})}{tail}")


def run_and_answer(
    instance: dg.DagsterInstance,
    shards: list[str],
    completions: dict,
    console: Console,
    verbose: bool,
    window: Window,
    launch: Launch,
    full: bool = False,
) -> int:
    """`dflash demo` and `dflash backfill` after their first line: the shards through Dagster, then the closing
    lines (the run's answer and the next command); with `full`, everything at length."""
    print_old_default(
        window, console, lambda cap: launch.printed({"cap_policy": "fixed"}, f" --max-output-tokens {cap}")
    )
    cap = completions["max_output_tokens"]
    print_cap_past_window(window, cap, console)
    if said := regenerate_text(completions["regenerate"]):  # what regenerate does to the source, before the run
        console.print(said, highlight=False)
    stops = run_shards(instance, shards, completions, console, verbose, window, full)
    print_superseded(stops, console, window)
    export_run_config(instance, stops, window, console, verbose, full)  # the run's own config, never another
    if full and not stops.checks and not stops.errors and not stops.preflight:
        print_window_answer(
            stops, console, window, launch.printed({"cap_policy": "window"}, f" --max-output-tokens {cap}")
        )
    print_quarantined(shards, stops, console, launch.printed(tail=" --retry-quarantined"))
    if launch.ui:
        verbatim(console, f"The UI at http://127.0.0.1:3000: {ui_command()}")  # one line: the command ends it
    rerun = lambda cap: launch.printed(tail=f" --max-output-tokens {cap}")  # noqa: E731
    command = f"{launch.command}{launch.again({})}"
    return print_stop(stops, console, rerun, window, command, short=not full)


def run_shards_command(command: str, args: argparse.Namespace) -> int:
    """`dflash demo` (every shard) and `dflash backfill` (--from..--to): the run's first line, then run_and_answer."""
    config, trainer = _completions_config(command, args)
    refuse_cap_beyond_context(command, request_cap(config, trainer))
    flags = {**config, **trainer_flags(trainer)}
    console = console_for_output()
    if source_refused(command, console):
        return BAD_CONFIG
    instance = dg.DagsterInstance.get()
    shards = known_shards(instance)
    window = Window.of(config, trainer)
    cap, home = config["max_output_tokens"], f"DAGSTER_HOME={os.environ['DAGSTER_HOME']}"
    if command == "demo":
        chosen, typed = shards, "dflash demo"
        opening = f"{len(shards)} shards (cap {cap} tokens, {policy_text(window)}), {home}, data in "
        opening += f"{os.environ['DFLASH_DATA_DIR']}/"
    else:
        if (picked := shard_range(command, shards, args.first, args.last, console)) is None:
            return BAD_CONFIG
        chosen, typed = picked, f"dflash backfill --from {picked[0]} --to {picked[-1]}"
        opening = f"shards {picked[0]}..{picked[-1]} ({len(picked)}), cap {cap}, up to {SHARDS_PER_RUN} shards per "
        opening += f"run, {policy_text(window)}, {home}"
    console.print(f"dflash {command}: {opening}", highlight=False)
    launch = Launch(typed, lambda overrides: repeated_flags(command, {**flags, **overrides}), ui=command == "demo")
    return run_and_answer(instance, chosen, config, console, args.verbose, window, launch, full=args.full)


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
    console = console or console_for_output()
    instance = dg.DagsterInstance.get()
    if (chosen := shard_range("continue", known_shards(instance), first, last, console)) is None:
        return BAD_CONFIG
    target = f"the trainer's window {to_window}" if to_window else f"cap {new_cap}"
    console.print(
        f"dflash continue: shards {chosen[0]}..{chosen[-1]} ({len(chosen)}) to {target}, cut rows taken on from "
        f"where they stopped",
        highlight=False,
    )
    window = Window("window", trainer=TrainerSettings(max_length=to_window)) if to_window else Window()
    to = {"to_window": to_window} if to_window else {"new_max_output_tokens": new_cap}
    ops = {"continued_completions": ContinuationConfig.model_validate({"parent_config_hash": "latest", **to})}
    run_config = dg.RunConfig(ops=ops, resources=window.resources(), **quiet(verbose))
    continued = Continued()
    for chunk in [chosen[i : i + SHARDS_PER_RUN] for i in range(0, len(chosen), SHARDS_PER_RUN)]:
        result = execute(continue_job.name, instance, run_config, console, chunk)
        meta = _meta(result, "continued_completions")
        for shard in chunk:
            continued.add(shard, meta.get(shard))
        if not result.success:
            record_failures(result, f"shards {chunk[0]}..{chunk[-1]}", continued.stops)
    continued.say(console)
    return continue_ending(continued.stops, console, window)


@dataclass
class Continued:
    """What `dflash continue` continued: its table, the tokens reused of the new config's, the run's stops."""

    stops: Stops = field(default_factory=Stops)
    table: Table = field(
        default_factory=lambda: Table(
            box=box.SIMPLE_HEAD,
            title="continued by shard (tokens reused: taken over from the smaller cap, not generated again)",
        )
    )
    reused: int = 0
    total: int = 0

    def __post_init__(self) -> None:
        for col in CONTINUE_COLUMNS:
            self.table.add_column(col, justify="left" if col == "shard" else "right", no_wrap=True)

    def add(self, shard: str, m: dict | None) -> None:
        """A shard's row from its continued_completions metadata (none: the shard's run did not say)."""
        from dflash_assets.quality.outcome import num, pct

        if not m:
            self.table.add_row(shard, *"------")
            return
        k = ContinuationKeys
        self.stops.config_hashes.add(m[k.CONFIG_HASH])
        self.reused += m[k.TOKENS_REUSED]
        self.total += m[k.TOKENS_REUSED] + m[k.TOKENS_GENERATED]
        counts = (k.ROWS_CONTINUED, k.ROWS_COPIED, k.STILL_TRUNCATED, k.TOKENS_REUSED, k.TOKENS_GENERATED)
        self.table.add_row(shard, *(num(m[key]) for key in counts), pct(m[k.SAVED_SHARE]))

    def say(self, console: Console) -> None:
        from dflash_assets.quality.outcome import num, pct

        console.print(self.table)
        if self.total:
            console.print(
                f"tokens reused: {num(self.reused)} of {num(self.total)} ({pct(self.reused / self.total)}) of the "
                f"new config's completion tokens were not generated again",
                highlight=False,
            )


def continue_ending(stops: Stops, console: Console, window: Window) -> int:
    """The answer of each continued config, then what stopped the run or the next commands; the exit status."""
    from dflash_assets.cli.console import print_answer
    from dflash_assets.quality.report.answer import cap_answers

    for config_hash in sorted(stops.config_hashes):
        for answer in cap_answers(data_dir().resolved(), window.quality(), config_hash):
            export_command = as_printed(f"dflash export --config {answer.config_hash}")
            print_answer(answer, console, as_printed("dflash backfill"), export_command)
    if stops.preflight:
        console.print("[red]Stopped[/]: " + " ".join(dict.fromkeys(stops.preflight)), highlight=False)
        return BAD_CONFIG if not stops.errors else FAILED
    if stops.errors:
        return print_stop(stops, console, lambda cap: as_printed(f"dflash continue --to {cap}"), window)
    for said, command in (
        ("Next: the checks over the new config:", as_printed("dflash report", prompts=False)),
        ("  then its export (the latest config, the one just continued):", as_printed("dflash export")),
        ("  every config side by side:", as_printed("dflash configs", prompts=False)),
    ):
        say_with_command(console, f"{said} {command}")
    return DONE


def demo(args: argparse.Namespace) -> int:
    return run_shards_command("demo", args)


def backfill(args: argparse.Namespace) -> int:
    return run_shards_command("backfill", args)


def continue_shards(args: argparse.Namespace) -> int:
    if (args.to_cap is None) == (args.to_window is None):
        build_parser().error(
            "dflash continue: give one of --to (a larger cap) and --to-window (a larger trainer's window)"
        )
    if args.to_cap is not None:
        refuse_cap_beyond_context("continue", args.to_cap)
    return run_continue(args.to_cap, args.first, args.last, verbose=args.verbose, to_window=args.to_window)
