"""`dflash fleet up|status|down`: SGLang servers launched detached, inspected and stopped."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_assets.settings import Deployment, LaunchSettings


def fleet(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dflash_assets.fleet import launcher, status
    from dflash_assets.fleet.launcher import build_spec

    fleet_dir = Path(args.fleet_dir) if args.fleet_dir else launcher.default_fleet_dir()
    console = Console(width=None if sys.stdout.isatty() else 160)  # piped output is not cut to 80 columns
    try:
        if args.fleet_command == "up":
            spec = build_spec(LaunchSettings.taken_from(args))
            with console.status(f"bringing up {len(spec.servers())} server(s); waiting for /health"):
                records = launcher.up(spec, fleet_dir, replace=args.replace, on_event=console.print)
            console.print("fleet up: " + ",".join(r.url for r in records))
            console.print(f"attach with DFLASH_FLEET_MODE=attach DFLASH_FLEET_URLS={','.join(r.url for r in records)}")
        elif args.fleet_command == "status":
            statuses = status.fleet_status(fleet_dir, args.urls or (), api_key_env=Deployment.API_KEY.name)
            if not statuses:
                console.print(f"no servers: nothing in {fleet_dir / 'registry.json'} and no --urls")
                return 1
            console.print(status.status_table(statuses))
            if args.watch:
                console.print(tuning(statuses, args.watch, console))
            return 0 if all(s.healthy for s in statuses) else 1
        else:
            stopped = launcher.down(fleet_dir, args.names or None, on_event=console.print)
            console.print(f"fleet down: {len(stopped)} server(s) stopped")
    except (launcher.FleetError, ValueError) as e:
        console.print(f"[red]dflash fleet {args.fleet_command}:[/] {e}")
        return 2
    return 0


def tuning(statuses, seconds: float, console):
    """Sample every server's /v1/loads for `seconds` and turn what it shows into advice."""
    import asyncio
    import time

    from rich.progress import Progress

    from dflash_assets.fleet.client import ServerClient
    from dflash_assets.fleet.fleet import open_session
    from dflash_assets.fleet.tuning import LoadSampler, advise, summarize, tuning_table
    from dflash_assets.generation.stopping import STOP

    async def sample():
        async with open_session() as session:
            clients = [
                ServerClient(session, s.url, Deployment.API_KEY.value() or None) for s in statuses if s.workers is None
            ]  # a gateway has no loads of its own: its workers' rows are sampled
            sampler = await LoadSampler(clients, interval_s=1.0).start()
            with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
                task = progress.add_task(f"sampling /v1/loads for {seconds:.0f}s", total=seconds)
                start = time.monotonic()
                while (elapsed := time.monotonic() - start) < seconds:
                    progress.update(task, completed=elapsed)
                    await asyncio.sleep(0.5)
                    STOP.check()  # Ctrl-C, SIGTERM: stop watching
            infos = [await c.info() for c in clients]
            return await sampler.stop(), infos

    samples, infos = asyncio.run(sample())
    return tuning_table(summarize(samples, infos), advise(samples, infos))
