"""Processes forked warm: a `dflash` command, an emulator server or a test's own process (a kill -9 test's client)
started from a multiprocessing fork server that has imported what they import (tests/support/fork_preload.py:
Dagster and its instance storage, the other libraries, the emulator and the layers below the definitions; never the
definitions, which read the settings from the environment at import). Each child skips the 4-5 s of CPU a `dflash`
interpreter spends on imports, 0.6 s for an emulator; from there it runs the real entry point
(`dflash_assets.cli:main`, `dflash_assets.emulator:main`) with its own arguments, environment, working directory,
output files and exit status.

`Forked` has the calls of subprocess.Popen the tests and `EmulatorProcess` use. The production paths keep their
fresh interpreters: tests/emulator/test_process.py starts `python -m dflash_assets.emulator`, and
scripts/kill_demo.py kills `dflash demo` processes started as a user starts them.
"""

import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_assets.emulator import process

_forks = multiprocessing.get_context("forkserver")
# what the children import that reads no setting, and this module (a child unpickles `_child` from it)
_forks.set_forkserver_preload(["tests.support.fork_preload", "tests.support.forks"])


def _child(
    main: str, args: list[str], env: dict, cwd: str | None, out: str, err: str, session: bool, tty: str | None = None
) -> None:
    """In the forked child: the environment, directory and output files (and a session of its own, when asked; with
    `tty`, a pseudo-terminal's end, that terminal as its controlling one, on stdin, stdout and stderr), then `main`
    ("module:function") with the arguments; its return value is the exit status."""
    if session or tty:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read TMPDIR again
    if cwd:
        os.chdir(cwd)
    if tty:
        import fcntl
        import termios

        terminal = os.open(tty, os.O_RDWR)
        fcntl.ioctl(terminal, termios.TIOCSCTTY, 0)  # Ctrl-C on it signals this session's foreground group
        for fd in (0, 1, 2):
            os.dup2(terminal, fd)
        os.close(terminal)
    for path, fd in () if tty else ((out, 1), (err, 2)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    module, function = main.split(":")
    sys.exit(getattr(importlib.import_module(module), function)(list(args)))


class Forked:
    """A child forked warm, with subprocess.Popen's calls: pid, poll, wait, send_signal, kill and returncode. With
    `session`, in a session of its own, so `os.killpg(pid, SIGKILL)` takes the whole of it, as `kill -9 -PGID` from a
    terminal."""

    def __init__(self, main: str, args, env: dict, cwd, out: Path, err: Path, session: bool, tty: str | None = None):
        self.args = [main, *args]
        self._child = _forks.Process(
            target=_child,
            args=(main, list(args), env, None if cwd is None else str(cwd), str(out), str(err), session, tty),
        )
        self._child.start()
        self.pid = self._child.pid

    @property
    def returncode(self) -> int | None:
        return self._child.exitcode

    def poll(self) -> int | None:
        return self._child.exitcode

    def send_signal(self, sig: int) -> None:
        if self._child.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
        self._child.join()

    def wait(self, timeout: float | None = None) -> int:
        self._child.join(timeout)
        if self._child.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._child.exitcode


def spawn_emulator(args: list[str], env: dict, log_path: Path) -> Forked:
    """`start_emulator`'s spawn: the server forked warm in a session of its own, its output appended to the log. Its
    parent is the fork server; it stops when the test process that asked for it is gone (EXIT_WITH_PARENT)."""
    return Forked("dflash_assets.emulator:main", args, env, None, log_path, log_path, session=True)


def start_emulator(args=(), **options) -> process.EmulatorProcess:
    """dflash_assets.emulator.process.start_emulator with the server forked warm: the same flags, port, health
    wait, log and exit with the test process that started it."""
    return process.start_emulator(args, spawn=spawn_emulator, **options)
