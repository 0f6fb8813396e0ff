"""`dflash demo`: every shard of the bundled demo prompts (or --prompts) through Dagster on emulated SGLang servers,
the checks, the export and the next command."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import dagster as dg
from rich.console import Console

from dflash_assets.cli.console import console_for_output
from dflash_assets.cli.flags import (
    _completions_config,
    refuse_cap_beyond_context,
    repeated_flags,
    request_cap,
    trainer_flags,
)
from dflash_assets.cli.render import policy_text
from dflash_assets.cli.runner import BAD_CONFIG, Window, known_shards, source_refused
from dflash_assets.cli.shards import Launch, run_and_answer
from dflash_assets.settings import TrainerSettings


def run_demo(
    completions: dict,
    console: Console | None = None,
    verbose: bool = False,
    again: Callable[[dict], str] = lambda overrides: "",
    trainer: TrainerSettings = TrainerSettings(),
    full: bool = False,
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
    launch = Launch("dflash demo", again, ui=True)
    return run_and_answer(instance, shards, completions, console, verbose, window, launch, full=full)


def demo(args: argparse.Namespace) -> int:
    config, trainer = _completions_config("demo", args)
    refuse_cap_beyond_context("demo", request_cap(config, trainer))
    flags = {**config, **trainer_flags(trainer)}
    return run_demo(
        config,
        trainer=trainer,
        verbose=args.verbose,
        full=args.full,
        again=lambda overrides: repeated_flags("demo", {**flags, **overrides}),
    )
