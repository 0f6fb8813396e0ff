"""The `dflash` command run as a person types it, in a child process; free loopback ports for what it launches.

The child is forked warm (tests/support/forks.py): `dflash`'s own `main` with the command's arguments, environment,
working directory, output files and exit status, without the 4-5 s of CPU an interpreter spends importing Dagster
and the rest. `start` runs one in the background, in a session of its own, for the kill -9 tests;
scripts/kill_demo.py kills fresh `dflash demo` processes, started as a user starts them.
"""

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_assets.fleet import processes
from tests.support.dagster_procs import PROJECT_DAGSTER_YAML
from tests.support.forks import Forked


class Command(Forked):
    """A `dflash` command forked warm (tests/support/forks.py) with this process's environment plus `env` (a None
    there unsets the variable), as a `dflash` on PATH runs: not under `uv run` (which sets UV_RUN_RECURSION_DEPTH,
    so the commands it prints start `uv run`) unless `env` says so."""

    def __init__(
        self, args: tuple[str, ...], env: dict | None, cwd, out: Path, err: Path, session: bool, tty: str | None = None
    ):
        launched = {"UV_RUN_RECURSION_DEPTH": None}  # pytest itself runs under `uv run`
        environment = {k: v for k, v in {**os.environ, **launched, **(env or {})}.items() if v is not None}
        for path in {out, err}:
            path.write_text("")
        super().__init__("dflash_assets.cli:main", args, environment, cwd, out, err, session, tty)
        self.args = ["dflash", *args]


def start(*args: str, out: Path, env: dict | None = None, cwd=None, tty: str | None = None) -> Command:
    """`dflash *args` started in the background with this process's environment plus `env` (a None there unsets
    the variable), its stdout and stderr both to `out`, or with `tty` (a pseudo-terminal's end) on a terminal."""
    return Command(args, env, cwd, out, out, session=True, tty=tty)


def dflash(*args: str, env: dict | None = None, timeout: float = 300, cwd=None) -> subprocess.CompletedProcess:
    """`dflash *args` with this process's environment plus `env` (a None there unsets the variable); its exit code
    and output."""
    with tempfile.TemporaryDirectory(prefix="dflash-cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        command = Command(args, env, cwd, out, err, session=False)
        try:
            status = command.wait(timeout)
        except subprocess.TimeoutExpired:
            command.kill()
            raise subprocess.TimeoutExpired(command.args, timeout, out.read_text(), err.read_text()) from None
        return subprocess.CompletedProcess(command.args, status, out.read_text(), err.read_text())


def home(tmp_path: Path, name: str) -> dict:
    """A fresh instance (the project's dagster.yaml) and data dir, as the environment of a `dflash` run; CWD is
    where to run it."""
    (tmp_path / name).mkdir()
    shutil.copy(PROJECT_DAGSTER_YAML, tmp_path / name / "dagster.yaml")
    return {
        "DAGSTER_HOME": str(tmp_path / name),
        "DFLASH_DATA_DIR": str(tmp_path / f"{name}-data"),
        "CWD": str(tmp_path),
    }


def demo_slice(tmp_path: Path, lines: int) -> Path:
    """The first `lines` lines of the bundled demo prompts, as a --prompts file: the demo's own length families for
    a test that needs a few shards of them, not all 400 prompts."""
    from dflash_assets.settings import DEMO_PROMPTS

    path = tmp_path / f"demo-{lines}.jsonl"
    path.write_text("".join(DEMO_PROMPTS.read_text().splitlines(keepends=True)[:lines]))
    return path


def free_base_port(n: int = 2) -> int:
    """A base port with `n` free ports from it (servers listen on base_port + GPU id)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and not any(processes.port_in_use("127.0.0.1", base + i) for i in range(n)):
            return base
    raise RuntimeError("no free ports")


def loading_after(starts: int, marker: Path, for_s: float = 3600) -> tuple[str, ...]:
    """A `sglang serve` command (the emulator) whose starts after the first `starts` load for `for_s` seconds before
    they bind their port (a real SGLang loading its model; by default longer than any test waits). Each start is a
    line of `marker`."""
    code = (
        "import os, sys, time; m = sys.argv.pop(1); n = len(open(m).readlines()) if os.path.exists(m) else 0; "
        f"open(m, 'a').write('start\\n'); n >= {starts} and time.sleep({for_s}); "
        "os.execv(sys.executable, [sys.executable, '-m', 'dflash_assets.emulator', *sys.argv[1:]])"
    )
    return (sys.executable, "-c", code, str(marker))


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


def clean_shell(env_words: list[str]) -> dict:
    """A clean shell's environment (no DAGSTER_HOME, no DFLASH_*) with a printed command's own `NAME=value`s, as
    `dflash(env=...)` takes it (None unsets)."""
    unset = {k: None for k in os.environ if k.startswith("DFLASH_") or k == "DAGSTER_HOME"}
    return unset | dict(w.split("=", 1) for w in env_words)


def split_command(command: str) -> tuple[list[str], list[str]]:
    """A printed command's leading `NAME=value`s and the rest, as a shell splits them."""
    words = shlex.split(command)
    n = next(i for i, w in enumerate(words) if not re.fullmatch(r"[A-Z_]+=.*", w))
    return words[:n], words[n:]


def run_as_printed(command: str, cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """A `[NAME=value ...] dflash ...` command the tool printed, run as printed in a clean shell."""
    words, argv = split_command(command)
    assert argv[0] == "dflash", command
    return dflash(*argv[1:], env=clean_shell(words), cwd=cwd, timeout=timeout)
