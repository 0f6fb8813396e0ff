"""`dflash generate` and `dflash probe`: the same engine the `completions` and `length_probe` assets adapt, without
Dagster, on the servers of --urls."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from dflash_assets.cli.environment import launcher
from dflash_assets.cli.errors import BadInput
from dflash_assets.cli.flags import run_settings
from dflash_assets.cli.parser import ATTACHED
from dflash_assets.settings import Deployment, DispatchSettings, FleetSettings, GenerationSettings, ProbeSettings


def generate(args: argparse.Namespace) -> int:
    """One shard's completions without Dagster: the same engine the `completions` asset adapts."""
    from dflash_assets.fleet.fleet import run
    from dflash_assets.generation.engine import generate_shard

    _, generation, dispatch = run_settings(args)
    prompt_shards_of(args.data_dir, [args.shard])
    urls = args.urls

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    async def go(progress: Progress):
        task = progress.add_task(f"shard {args.shard}", total=None)
        async with connected_fleet(urls, args) as fleet:
            return await generate_shard(
                args.data_dir,
                args.shard,
                fleet,
                generation,
                dispatch,
                log=progress.console.print,
                on_answer=lambda done, total: progress.update(task, completed=done, total=total),
            )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        transient=True,
        disable=not sys.stdout.isatty(),
    ) as progress:
        shard = run(go(progress))
    print(
        f"shard {shard.shard} config {shard.config_hash}: {shard.prompts} prompts = {shard.completed} completed + "
        f"{shard.rejected} rejected + {shard.failed} failed ({shard.elapsed_s:.1f}s)"
    )
    return 0 if shard.failed == 0 else 1


def probe(args: argparse.Namespace) -> int:
    """The length probe without Dagster: the same code path (generation/probe.py) the `length_probe` asset adapts."""
    from functools import partial

    from dflash_assets.cli.probe_summary import probe_summary
    from dflash_assets.fleet.fleet import run
    from dflash_assets.generation.probe import run_length_probe
    from dflash_assets.quality.planning.planner import cut_rows_for_probe

    # the probe's cap is ProbeSettings.max_output_tokens (0: the largest the context allows), not the run's
    probe, dispatch = ProbeSettings.taken_from(args), DispatchSettings.taken_from(args)
    generation = GenerationSettings.taken_from(args, ("max_output_tokens",))
    shards = prompt_shards_of(args.data_dir, [s for s in (args.shards or "").split(",") if s])
    urls = args.urls

    async def go():
        async with connected_fleet(urls, args) as fleet:
            return await run_length_probe(
                args.data_dir,
                shards,
                fleet,
                generation,
                probe,
                dispatch,
                log=print,
                cut_rows=partial(cut_rows_for_probe, args.data_dir),
            )

    try:
        result = run(go())
    except FileNotFoundError as e:  # errors.py says a SettingsError or a refused preflight the same way
        raise BadInput(str(e)) from None
    print(probe_summary(result, args.data_dir, shards, ProbeNext(args)))
    return 0 if result.run.failed == 0 else 1


class ProbeNext:
    """The commands the probe's summary names next, on the probe's data dir, servers and flags."""

    GENERATE_REQUIRED = ("--shard", "00000", "--urls", "http://127.0.0.1:1")  # for generate's defaults only

    def __init__(self, args: argparse.Namespace):
        from dflash_assets.store.storage import is_uri

        self.args, self.urls = args, ",".join(args.urls)
        self.data_dir = args.data_dir if is_uri(args.data_dir) else str(Path(args.data_dir).resolve())

    def report(self) -> str:
        return f"{launcher()}dflash report --data-dir {shlex.quote(self.data_dir)}"

    def continue_to(self, cap: int) -> str:
        attached = {Deployment.FLEET_MODE.name: "attach", Deployment.FLEET_URLS.name: self.urls}
        home = {"DAGSTER_HOME": os.environ["DAGSTER_HOME"]} if "DAGSTER_HOME" in os.environ else {}
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (home | attached).items())
        return f"{prefix} {launcher()}dflash continue --to {cap} --data-dir {shlex.quote(self.data_dir)}"

    def generate(self, shard: str, cap: int) -> str:
        from dflash_assets.cli.flags import repeated_flags
        from dflash_assets.cli.parser import build_parser

        given, own = vars(self.args), ("subcommand", "shard", "urls", "data_dir", "verbose")
        flags = vars(build_parser().parse_args(["generate", *self.GENERATE_REQUIRED]))  # in the parser's order
        carried = repeated_flags(
            "generate", {k: given[k] for k in flags if k in given and k not in own}, self.GENERATE_REQUIRED
        )
        return (
            f"{launcher()}dflash generate --shard {shard} --urls {self.urls} --data-dir {shlex.quote(self.data_dir)} "
            f"--max-output-tokens {cap}{carried}"
        )


def prompt_shards_of(data_dir: str, asked: list[str]) -> list[str]:
    """The prompt shards of a data dir, or `asked` when each is one of them; else BadInput naming them."""
    from dflash_assets.generation.probe import prompt_shard_keys

    there = prompt_shard_keys(data_dir)
    build = "build them first: dflash backfill, or the prompt_shards asset"
    if not there:
        raise BadInput(f"no prompt shards under {data_dir}: {build} (or give --data-dir a data dir that has them)")
    if missing := [s for s in asked if s not in there]:
        listed = f"{there[0]}..{there[-1]}" if len(there) > 2 else ", ".join(there)
        raise BadInput(
            f"no shard {missing[0]} under {data_dir}: the shards there are {listed} ({len(there)}); give one "
            f"of them, or {build}"
        )
    return asked or there


def connected_fleet(urls: list[str], args: argparse.Namespace):
    """The fleet of --urls, its wait for /health said on stderr."""
    from dflash_assets.fleet.fleet import connected

    fleet = FleetSettings.taken_from(args, ATTACHED)
    return connected(
        urls,
        Deployment.API_KEY.value() or None,
        health_timeout_s=fleet.health_timeout_s,
        request_timeout_s=fleet.request_timeout_s,
        connect_refused_s=fleet.connect_refused_s,
        say=lambda text: print(text, file=sys.stderr, flush=True),
    )
