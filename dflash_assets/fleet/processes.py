"""Detached server processes: start one in its own session, tell whether a pid is still it, stop its group.

Pids are reused, so a process is "ours" only if its start time is the one recorded at launch (a zombie is dead):
the kernel's, in seconds since boot (psutil's `Process._ident`), which a wall-clock step does not move.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

# Handles of the servers this process started, so a dead one is reaped (not a zombie that looks alive)
_children: dict[int, subprocess.Popen] = {}
_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


# a start time is a whole number of clock ticks: two within half a tick are the same
_SAME_S = 0.5 / os.sysconf("SC_CLK_TCK")
# a start time recorded as seconds since the epoch (registry version 2): 31 years of uptime otherwise
_EPOCH_S = 1e9


def start_time(pid: int) -> float | None:
    """When a live process started, in seconds since boot; None if gone, a zombie, or not ours to read."""
    if pid in _children:
        _children[pid].poll()  # reaps it if it has exited
    try:
        proc = psutil.Process(pid)
        if proc.status() in _GONE:
            return None
    except psutil.Error:  # NoSuchProcess, AccessDenied
        return None
    return proc._ident[1]  # psutil's own identity: (pid, start since boot) where the platform has one


def since_boot(recorded: float) -> float:
    """A start time as start_time() gives it, from one that an earlier version recorded since the epoch."""
    return recorded - psutil.boot_time() if recorded > _EPOCH_S else recorded


def is_ours(pid: int, proc_start: float | None) -> bool:
    started = start_time(pid)
    return started is not None and proc_start is not None and abs(started - since_boot(proc_start)) < _SAME_S


def group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process left in the group? sglang's scheduler children hold the GPU."""
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] not in _GONE and os.getpgid(proc.pid) == pgid:
                return True
        except ProcessLookupError:
            continue
    return False


def spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start `argv` detached (own session), no stdin, stdout and stderr appended to the log."""
    log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    _children[proc.pid] = proc
    return proc


def exit_code(pid: int) -> int | None:
    proc = _children.get(pid)
    return proc.poll() if proc else None


def stop_group(pid: int, proc_start: float | None, timeout_s: float = 30.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after `timeout_s`; a reused pid means it is gone."""
    if start_time(pid) is not None and not is_ours(pid, proc_start):
        return
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        if _wait_group_gone(pid, wait_s):
            break
    proc = _children.pop(pid, None)
    if proc:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        start_time(pgid)  # reaps the leader if it is our child
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    return False


def port_in_use(host: str, port: int) -> bool:
    """Would a server fail to bind host:port? (SO_REUSEADDR as uvicorn does, so TIME_WAIT is no obstacle.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def tail(path: Path, lines: int = 30, secrets: tuple[str, ...] = ()) -> str:
    """The end of a log, with any secret masked (sglang itself logs its resolved args, key included)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return "\n".join(text.splitlines()[-lines:])
