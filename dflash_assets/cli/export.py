"""`dflash export` and `dflash configs`: the configs of a data dir side by side, and the gated export of one."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import dagster as dg
from rich.console import Console

from dflash_assets.cli.console import console_for_output, verbatim
from dflash_assets.cli.environment import as_printed, data_dir_of
from dflash_assets.cli.render import print_stop
from dflash_assets.cli.runner import BAD_CONFIG, Stops, Window, _meta, data_dir, execute, quiet, record_failures
from dflash_assets.defs.metadata import TrainingSetKeys
from dflash_assets.defs.training.jobs import training_job
from dflash_assets.quality.training.export import kept_lines, left_out_lines, trained_words
from dflash_assets.quality.training.split import split_words
from dflash_assets.quality.training.trainer_settings import trainer_settings_line
from dflash_assets.settings import TRAINER_FLAGS, TrainerSettings


def export(
    instance: dg.DagsterInstance,
    config_hash: str,
    chosen_by: str,
    window: Window,
    console: Console,
    stops: Stops,
    verbose: bool = False,
    short: bool = False,
) -> bool:
    """The gated export of one config, as the UI runs it: its files, or what stopped it in `stops` (`short`: only that)."""
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
    if result.success and short:  # the run's answer says what the export holds, and where (its manifest)
        return True
    if result.success:
        meta = next(iter(_meta(result, "drafter_training_set").values()))
        t = TrainingSetKeys
        verbatim(
            console,
            f"drafter training set: {meta[t.ROW_COUNT]} rows of config {meta[t.CONFIG_HASH]} "
            f"(chosen by: {meta[t.CHOSEN_BY]}) in {meta[t.JSONL]} (manifest beside it)" + split_words(meta[t.MANIFEST]),
        )
        left_out, kept = left_out_lines(meta[t.MANIFEST]), kept_lines(meta[t.MANIFEST])
        for heading, lines in (("left out, by reason:", left_out), ("kept, with a note:", kept)):
            if lines:
                console.print(f"  {heading}", highlight=False)
            for line in lines:
                console.print(f"    {line}", highlight=False)
        if not left_out:
            console.print("  left out: nothing", highlight=False)
        console.print(f"  {trained_words(meta[t.MANIFEST])}", highlight=False)
        verbatim(console, trainer_settings_line(meta[t.MANIFEST], Path(meta[t.JSONL]).parent))
        return True
    if config_hash != "all":
        stops.config_hashes.add(config_hash)
    if stops.checks:  # the shard runs' checks already said which (and a short ending says it once, below)
        if not short:
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
    instance: dg.DagsterInstance,
    stops: Stops,
    window: Window,
    console: Console,
    verbose: bool = False,
    full: bool = False,
) -> None:
    """A shard command's last step: the export of the config it ran (never another one of the data dir)."""
    if stops.errors:  # the export could only say the consequence ("no completions to export"), never the cause
        console.print("drafter training set: not written: the shard runs failed (the cause is below)")
    elif not stops.preflight and stops.config_hash:
        export(instance, stops.config_hash, "run", window, console, stops, verbose, short=not full)


def run_export(config: str, console: Console | None = None, verbose: bool = False, window: Window = Window()) -> int:
    """`dflash export`: the gated export of one config (a hash, `latest` or `all`); exit 3 for a blocking check."""
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
    return print_stop(stops, console, lambda cap: as_printed(f"dflash backfill --max-output-tokens {cap}"), window)


def export_command(args: argparse.Namespace) -> int:
    trainer = TrainerSettings.taken_from(args, prefix=TRAINER_FLAGS)
    return run_export(args.config, verbose=args.verbose, window=Window(trainer=trainer))


def configs(args: argparse.Namespace) -> int:
    """The configs of a data dir side by side (store/configs.py), the latest first."""
    from dflash_assets.cli.console import configs_table, console_for_output, say_with_command
    from dflash_assets.store.configs import list_configs

    data_dir = data_dir_of(args)  # and so in the command it prints
    trainer = TrainerSettings.taken_from(args, prefix=TRAINER_FLAGS)
    configs = list_configs(data_dir, trainer.max_length)
    if not configs:
        print(f"dflash configs: no completions under {data_dir} (set --data-dir or DFLASH_DATA_DIR)", file=sys.stderr)
        return 2
    console = console_for_output()
    console.print(configs_table(configs))
    say_with_command(
        console,
        f"latest (the export's default when no run names its own): {configs[0].config_hash}. "
        f"Export one: {as_printed('dflash export --config HASH')}",
    )
    return 0
