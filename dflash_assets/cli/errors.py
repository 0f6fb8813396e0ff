"""What stops a command, said in one line on stderr: exit 2 for bad input or settings (the one place a SettingsError,
a bad source or a refused preflight becomes exit 2), else 1."""

from __future__ import annotations

import argparse
import sys

from dflash_assets.settings import Deployment, SettingsError


class BadInput(Exception):
    """Input or settings that cannot work, found before any work: one line, exit 2."""


def failed(args: argparse.Namespace, error: Exception) -> int:
    """An error that stopped a command, in one line on stderr: exit 2 for bad input or settings, else 1."""
    import traceback

    from dflash_assets.fleet.attach import AttachError
    from dflash_assets.fleet.client import ServerError
    from dflash_assets.generation.preflight import PreflightError
    from dflash_assets.generation.prompts import SourceError
    from dflash_assets.generation.slots import FleetDown
    from dflash_assets.store.exhaustion import exhaustion

    command = " ".join(["dflash", args.subcommand, *([args.fleet_command] if args.subcommand == "fleet" else [])])
    if args.verbose:
        traceback.print_exception(error, file=sys.stderr)
    bad = isinstance(error, BadInput | SettingsError | SourceError | PreflightError | AttachError)
    down = isinstance(error, ServerError | FleetDown)
    text = (error.message if isinstance(error, ServerError) else str(error) or type(error).__name__).splitlines()[0]
    data_dir = getattr(args, "data_dir", None) or Deployment.DATA_DIR.value()
    if (ran_out := exhaustion(error, data_dir)) is not None:  # a full disk: where, what is left, what to do
        print(f"{command}: {ran_out.line(None)}", file=sys.stderr)
        return 1
    if not bad and not down:
        text = f"{type(error).__name__}: {text}"
    if down:
        text += "; run the same command again once the servers answer (committed completions are kept)"
    elif not bad and not args.verbose:
        text += f" (`{command} ... --verbose` prints the stack trace)"
    print(f"{command}: {text}", file=sys.stderr)
    return 2 if bad else 1
