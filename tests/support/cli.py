"""The `dflash` command run as a person types it, in a child process; free loopback ports for what it launches."""

import os
import socket
import subprocess
import sys


def dflash(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_assets.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def free_base_port() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two free adjacent ports")


def cli_commands(parser=None, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command of `dflash` as a person types it, read from the parser: (), ("demo",), ("fleet", "up"), ..."""
    import argparse

    from dflash_assets.cli import build_parser

    parser = parser or build_parser()
    found = [path]
    for action in parser._actions:  # argparse keeps its subcommands only in this action
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += cli_commands(sub, (*path, name))
    return found
