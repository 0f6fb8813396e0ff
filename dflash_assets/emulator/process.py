"""Starting emulators as subprocesses, as the fleet runs them (the tests' in-process ones:
tests/support/emulator_thread.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Self

from .config import EXIT_WITH_PARENT


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _healthy(url: str, timeout: float = 10.0) -> bool:
    # /health answers at least 1 s later (SGLang's asyncio.sleep(1), emulator/info.py)
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class EmulatorProcess:
    """A running emulator subprocess in its own session. Stop it with .stop() or a `with` block."""

    def __init__(self, popen: subprocess.Popen, host: str, port: int, log_path: Path, own_log: bool = False):
        self.popen = popen
        self.host = host
        self.port = port
        self.log_path = log_path
        self._own_log = own_log  # a temp file we made: removed once the server serves (forget_log_path), read on stop
        self._log_file: BinaryIO | None = None  # that file, still open, after its name is gone
        self._log_text: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        """The server's stdout and stderr so far (still available after stop)."""
        if self._log_text is not None:
            return self._log_text
        if self._log_file is not None:
            self._log_file.seek(0)
            return self._log_file.read().decode(errors="replace")
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def forget_log_path(self) -> None:
        """A temp log of ours: keep it open and remove its name, so nothing is left if this process is killed."""
        if self._own_log and self._log_file is None:
            self._log_file = open(self.log_path, "rb")
            self.log_path.unlink(missing_ok=True)

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        if self._own_log and self._log_text is None:
            self._log_text = self.log()
            self.log_path.unlink(missing_ok=True)
            if self._log_file is not None:
                self._log_file.close()
        return self.popen.returncode

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_argv(args: list[str] | tuple[str, ...]) -> list[str]:
    """An emulator's server flags as it is started: --model-path defaults to emulated/qwen3-27b."""
    args = list(args)
    if not any(a == "--model-path" or a.startswith("--model-path=") or a == "--model" for a in args):
        args = ["--model-path", "emulated/qwen3-27b", *args]
    return args


def start_emulator(
    args: list[str] | tuple[str, ...] = (),
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    env: dict | None = None,
    startup_timeout: float = 30.0,
    log_path: str | os.PathLike | None = None,
    spawn: Spawn | None = None,
) -> EmulatorProcess:
    """Start `python -m dflash_assets.emulator` with server flags `args` and wait for /health 200. Without `port`,
    a free loopback port (picked again if taken before the bind); without `log_path`, a temp file that .stop()
    reads into .log(). `spawn` starts the process (`popen`; tests/support/forks.py forks)."""
    args = server_argv(args)
    for attempt in range(3 if port is None else 1):
        proc = _spawn(args, host, port or free_port(host), env, log_path, spawn or popen)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                proc.stop()
                if "address already in use" in proc.log().lower() and attempt < 2 and port is None:
                    break  # lost the race for the port: try another
                raise RuntimeError(
                    f"emulator exited with {proc.popen.returncode} before it was healthy:\n{proc.log()[-2000:]}"
                )
            if _healthy(proc.url):
                proc.forget_log_path()  # the server has its log open by now
                return proc
            time.sleep(0.05)
        else:
            proc.stop()
            raise TimeoutError(f"emulator not healthy within {startup_timeout}s:\n{proc.log()[-2000:]}")
    raise RuntimeError("emulator: no free port after 3 attempts")


# starts the emulator with (argv, environment, log file) in a session of its own; a Popen or alike
Spawn = Callable[[list[str], dict, Path], subprocess.Popen]


def popen(args: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "dflash_assets.emulator", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


def _spawn(args: list[str], host: str, port: int, env: dict | None, log_path, spawn: Spawn) -> EmulatorProcess:
    own_log = log_path is None
    if own_log:
        fd, log_path = tempfile.mkstemp(prefix=f"emulator-{port}-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    environment = {**os.environ, EXIT_WITH_PARENT: str(os.getpid()), **(env or {})}
    proc = spawn([*args, "--host", host, "--port", str(port)], environment, log_path)
    return EmulatorProcess(proc, host, port, log_path, own_log)
