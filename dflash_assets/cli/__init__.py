"""`dflash`: the demo, the emulator, the quality report, the configs and their export, the length probe and the
fleet, from a terminal. A module per command group, imported when its command runs (only those running Dagster
load it).
"""

from __future__ import annotations

import importlib
import sys
from contextlib import nullcontext

from dflash_assets.cli.environment import PROJECT_DAGSTER_YAML, instance_environment
from dflash_assets.cli.errors import failed
from dflash_assets.cli.flags import _completions_config, repeated_flags, trainer_flags
from dflash_assets.cli.parser import SHARD_RUN_DEFAULTS, build_parser
from dflash_assets.settings import Deployment

__all__ = [
    "PROJECT_DAGSTER_YAML",
    "SHARD_RUN_DEFAULTS",
    "_completions_config",
    "build_parser",
    "main",
    "repeated_flags",
    "trainer_flags",
]

# command -> (its module under cli/, the function that runs it on the parsed flags)
COMMANDS = {
    "demo": ("shards", "demo"),
    "backfill": ("shards", "backfill"),
    "continue": ("shards", "continue_shards"),
    "generate": ("generate", "generate"),
    "configs": ("export", "configs"),
    "export": ("export", "export_command"),
    "probe": ("generate", "probe"),
    "fleet": ("fleet", "fleet"),
    "report": ("report", "report"),
    "rejects": ("report", "rejects"),
}


LONG_COMMANDS = ("demo", "backfill", "continue", "generate", "probe", "fleet")
# the commands that run Dagster on the instance and data dir they set up first, before it is imported
ON_AN_INSTANCE = ("demo", "backfill", "continue", "export")


def rows_under(args) -> str | None:
    """Where a command commits its completion rows (the probe: its own tree), or None: `fleet` generates nothing."""
    if args.subcommand == "fleet":
        return None
    data_dir = getattr(args, "data_dir", None) or Deployment.DATA_DIR.value()
    if args.subcommand == "probe":
        from dflash_assets.generation.probe import probe_root

        return str(probe_root(data_dir))
    return data_dir


def resume_command(args, argv: list[str]) -> str:
    """The command that resumes a stopped one, as printed (a shard command on its data: as_printed)."""
    import shlex

    from dflash_assets.cli.environment import as_printed, launcher

    command = shlex.join(["dflash", *argv])
    return as_printed(command) if args.subcommand in ("demo", "backfill", "continue") else launcher() + command


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["emulator"]:
        from dflash_assets.emulator import main as emulator

        return emulator(argv[1:])
    from dflash_assets.generation.stopping import STOP, Stopped, stop_line, stopping

    with stopping() if argv[:1] and argv[0] in LONG_COMMANDS else nullcontext():  # a polite stop from the start
        args = build_parser().parse_args(argv)
        module, function = COMMANDS[args.subcommand]
        try:
            if args.subcommand in ON_AN_INSTANCE:
                instance_environment(args)
            command = getattr(importlib.import_module(f"{__name__}.{module}"), function)  # heard while it imports
            status = command(args)
            STOP.check()
            return status
        except Stopped as e:  # one line: what stopped, the rows kept, the command that resumes
            name = " ".join(argv[:2] if args.subcommand == "fleet" else argv[:1])
            fresh = "\n" if sys.stdout.isatty() else ""  # a terminal echoed ^C where its cursor was: a line of its own
            print(fresh + stop_line(e, name, resume_command(args, argv), rows_under(args)))
            return e.exit_status
        except Exception as e:  # the first cause in one line; its stack trace with --verbose (or in the run's log)
            return failed(args, e)
