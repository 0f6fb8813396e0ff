"""The one renderer of a shard command's ending: what stopped it, the configs beside its own, and the next command."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console

from dflash_assets.cli.console import headline, say_with_command, verbatim
from dflash_assets.cli.environment import as_printed
from dflash_assets.cli.runner import ALL_SHARDS, Stops, Window, data_dir
from dflash_assets.quality.report.answer import CapAnswer
from dflash_assets.settings import Deployment


def policy_text(window: Window) -> str:
    policy = f"cap_policy window (+{window.overshoot} overshoot), " if window.cap_policy == "window" else ""
    return f"{policy}trainer's window max_length {window.trainer_max_length}"


def regenerate_text(regenerate: str) -> str | None:
    """What `regenerate` does to the source's multi-turn prompts; None without any, and for all_turns."""
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


def print_other_configs(run_config: str | None, window: Window, console: Console) -> None:
    """The data dir's other configs, one line each: beside the run's own figures, never pooled into them."""
    from dflash_assets.store.configs import list_configs

    others = [c for c in list_configs(data_dir().resolved(), window.trainer_max_length) if c.config_hash != run_config]
    if others:
        console.print("also in this data dir (not in the figures above; `dflash configs` compares them):")
        for c in others:
            console.print(f"  {c.line()}", highlight=False)


def print_old_default(window: Window, console: Console, continue_old: Callable[[int], str]) -> None:
    """One line before a window-policy run beside fixed-cap configs only; `continue_old(cap)` continues the latest."""
    from dflash_assets.store.configs import list_configs

    if window.cap_policy != "window":
        return
    configs = list_configs(data_dir().resolved(), window.trainer_max_length)
    if not configs or any(c.cap_policy == "window" for c in configs):
        return
    latest = configs[0]  # list_configs: the most recently written first
    verbatim(
        console,
        f"This data dir's {len(configs)} config(s) decode a fixed cap (cap_policy fixed, the default before the window "
        f"policy): this run starts a new config, cap_policy window at the trainer's window "
        f"{window.trainer_max_length:,}, beside them. To continue config {latest.config_hash} (cap "
        f"{latest.cap}) instead: {continue_old(latest.cap or 0)}",
    )


def print_cap_past_window(window: Window, cap: int, console: Console) -> None:
    """One line when the window policy's cap lies past the window: a larger cap buys no trained token."""
    if window.cap_policy == "window" and cap > window.trainer_max_length + window.overshoot:
        verbatim(
            console,
            f"Cap {cap:,} lies past the trainer's window {window.trainer_max_length:,} (+{window.overshoot}): every "
            f"request asks at most the window's rest, so a larger cap buys no trained token. To train on more, grow "
            f"the window: {as_printed(f'dflash continue --to-window {2 * window.trainer_max_length}')}",
        )


def print_superseded(stops: Stops, console: Console, window: Window) -> None:
    """One line per other config left incomplete beside the run's own: superseded, with its counts."""
    from dflash_assets.quality import run_checks
    from dflash_assets.quality.checks.accounting import SUPERSEDED_COUNTS, Superseded

    for config_hash in sorted(stops.config_hashes):
        (o,) = run_checks(
            data_dir().resolved(), config_hash=config_hash, quality=window.quality(), names=["accounting"]
        )
        for counts in json.loads(str(o.metadata.get(SUPERSEDED_COUNTS, "[]"))):
            console.print(f"  {Superseded(**counts).line(quote='')}; it blocks nothing", highlight=False)


def print_window_answer(stops: Stops, console: Console, window: Window, rerun: str) -> None:
    """When no check stopped the run: whether the cut rows matter to this trainer, and what decoding past it cost."""
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


def print_short_answer(answer: CapAnswer, console: Console, command: str, next_line: bool) -> None:
    """A run's answer in a few lines and, with `next_line`, what it exported and the next command."""
    for line in answer.headline() if next_line else answer.headline()[:-1]:  # stopped: no export, said above
        say_with_command(console, line)
    if not next_line:
        return
    nxt = answer.next_command(command)
    say_with_command(console, f"  {answer.recommendation}" + (":" if nxt else ""))
    if nxt:
        verbatim(console, f"    {nxt}")


@dataclass(frozen=True)
class Ending:
    """How a run's ending is said: the console, the run's command, `rerun(cap)`, and `short` or in full."""

    console: Console
    rerun: Callable[[int], str]
    command: str = "dflash backfill"
    short: bool = False

    def say(self, text: str = "") -> None:
        # figures, not syntax, to colour; a soft wrap: a path or a command in these lines is never broken in two
        self.console.print(text, highlight=False, soft_wrap=True)


def print_stop(
    stops: Stops,
    console: Console,
    rerun: Callable[[int], str],
    window: Window = Window(),
    command: str = "dflash backfill",
    short: bool = False,
) -> int:
    """What stopped the run, the cap plan and the exact next command; `short` (a run's closing lines): the answer
    even when nothing stopped it, and the cap plan left to `dflash report --full`. Returns the exit status."""
    ending = Ending(console, rerun, command, short)
    say_errors(stops, ending.say)
    if stops.preflight:
        ending.say("[red]Stopped before any request was sent[/]: the preflight refused the run.")
        for message in dict.fromkeys(stops.preflight):
            ending.say(f"  {message}")
        if stops.context_length_needed:
            ending.say(
                f"Next: restart the servers with --context-length {stops.context_length_needed} (or lower "
                f"--max-output-tokens)."
            )
        return stops.exit_status()
    if stops.errors or not (stops.checks or short):
        return stops.exit_status()
    for config_hash in sorted(stops.config_hashes):
        say_config_ending(ending, stops, window, config_hash)
    return stops.exit_status()


def say_errors(stops: Stops, say: Callable[[str], None]) -> None:
    """The first cause first; the same cause again is counted, not repeated; then the next step."""
    if not stops.errors:
        return
    first = stops.errors[0]
    say(f"[red]Failed[/]: {first.where}: {first.message}")
    for line in first.detail:
        say(f"  {line}")
    same = sum(e.message == first.message for e in stops.errors[1:])
    if same:
        say(f"  (and {same} more run(s) with the same cause)")
    for error in (e for e in stops.errors[1:] if e.message != first.message):
        say(f"Also failed: {error.where}: {error.message}")
    say(f"The stack trace is in the event log of run {first.run_id} (the UI shows it).")
    if first.passing:
        say(
            "Next: the cause can pass (a server down, a timeout): run the same command again; committed "
            "completions are kept, only the rest runs."
        )
    elif not first.says_next:  # a line that says its next command (a full disk: free space, then ...) is enough
        say("Next: fix the cause above, then run the same command again (committed completions are kept).")


def say_config_ending(ending: Ending, stops: Stops, window: Window, config_hash: str) -> None:
    """One config's blocking checks that did not pass, its answer, and the command that continues its cut rows."""
    from dflash_assets.cli.console import print_answer
    from dflash_assets.quality import run_checks
    from dflash_assets.quality.report.answer import cap_answers

    root, quality = data_dir().resolved(), window.quality()
    outcomes = [
        o for o in run_checks(root, config_hash=config_hash, quality=quality, names=stops.checks) if not o.passed
    ]
    for o in outcomes:
        shards = stops.checks[o.name]
        if ending.short:
            where = ALL_SHARDS if ALL_SHARDS in shards else f"{len(shards)} shard{'s' if len(shards) > 1 else ''}"
            ending.say(f"[red]Stopped by the blocking check {o.name}[/] ({where}): the training set is not written")
        else:
            where = ALL_SHARDS if ALL_SHARDS in shards else f"shards {', '.join(shards)}"
            ending.say(f"[red]Stopped by the blocking check {o.name}[/] ({where}): {headline(o.summary_md)}")
    answers = cap_answers(root, quality, config_hash)
    if ending.short and not outcomes:  # nothing stopped it: the answer and its next command
        for answer in answers[:1]:
            print_short_answer(answer, ending.console, as_printed(ending.command), next_line=True)
        return
    if not answers or "truncation_rate" not in stops.checks:
        ending.say(
            "Next: read the check's rows in the UI (asset length_quality_report, its checks tab); the training "
            "set stays unwritten until every blocking check passes."
        )
        return
    answer = answers[0]
    export_command = as_printed(f"dflash export --config {answer.config_hash}")
    if ending.short:
        print_short_answer(answer, ending.console, export_command, next_line=False)
    else:
        print_answer(answer, ending.console, as_printed(ending.command), export_command)
    say_continue(ending, answer)


def say_continue(ending: Ending, answer: CapAnswer) -> None:
    """The command that continues the answer's cut rows to its next cap, and the one that generates again at it."""
    from dflash_assets.quality.outcome import num

    best, cap = answer.recommended, answer.next_cap
    if (cap is None or best is None) and ending.short:
        say_with_command(ending.console, f"  {answer.recommendation}")
    if cap is None:
        return
    before = ""
    if best is not None and best.fits_context is False:
        before = f"restart the servers with --context-length {best.context_needed_max}, then "
    to = f" to {'the recommended ' if best else ''}cap {num(cap)}" if ending.short else ""
    said = f"Next: {before}continue the {answer.truncated} cut rows{to} from where they stopped:"
    say_with_command(ending.console, said) if ending.short else ending.say(said)
    verbatim(ending.console, f"  {as_printed(f'dflash continue --to {cap}')}")
    say_with_command(ending.console, f"  or generate every prompt again at the new cap: {ending.rerun(cap)}")
