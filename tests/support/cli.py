"""The `dflash` command run as a person types it, in a child process; free loopback ports for what it launches.

The child is forked from a multiprocessing fork server that has imported Dagster, the other libraries the command
uses, Dagster's instance storage and the layers below the definitions (tests/support/cli_preload.py; never the
definitions, which read the settings from the environment at import), so each command skips the 4-5 s of CPU an
interpreter spends importing them; from there it is `dflash`'s own `main` with the command's arguments, environment,
working directory, output files and exit status. The kill -9 tests start real
`python -m dflash_assets.cli` processes of their own.
"""

import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_assets.fleet import processes
from tests.support.dagster_procs import PROJECT_DAGSTER_YAML

_forks = multiprocessing.get_context("forkserver")
# what `dflash` imports that reads no setting, and this module (the child unpickles `_command` from it)
_forks.set_forkserver_preload(["tests.support.cli_preload", "tests.support.cli"])


def _command(args: tuple[str, ...], env: dict, cwd: str | None, out: str, err: str) -> None:
    """In the forked child: the command's environment, directory and output files, then `dflash`'s main."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read TMPDIR again
    if cwd:
        os.chdir(cwd)
    for path, fd in ((out, 1), (err, 2)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    from dflash_assets.cli import main

    sys.exit(main(list(args)))


def dflash(*args: str, env: dict | None = None, timeout: float = 300, cwd=None) -> subprocess.CompletedProcess:
    """`dflash *args` with this process's environment plus `env` (a None there unsets the variable); its exit code
    and output."""
    environment = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    with tempfile.TemporaryDirectory(prefix="dflash-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = _forks.Process(target=_command, args=(args, environment,
                                                      None if cwd is None else str(cwd), out, err))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["dflash", *args], timeout, Path(out).read_text(), Path(err).read_text())
        return subprocess.CompletedProcess(["dflash", *args], child.exitcode, Path(out).read_text(),
                                           Path(err).read_text())


def home(tmp_path: Path, name: str) -> dict:
    """A fresh instance (the project's dagster.yaml) and data dir, as the environment of a `dflash` run; CWD is
    where to run it."""
    (tmp_path / name).mkdir()
    shutil.copy(PROJECT_DAGSTER_YAML, tmp_path / name / "dagster.yaml")
    return {"DAGSTER_HOME": str(tmp_path / name), "DFLASH_DATA_DIR": str(tmp_path / f"{name}-data"),
            "CWD": str(tmp_path)}


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
