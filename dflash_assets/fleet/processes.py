"""Detached server processes: start one in its own session, tell whether a pid is still it, stop its group.

A pid alone proves nothing after a reboot or a long run: the kernel reuses pids. A process is "ours" only
if /proc/<pid>/stat shows the start time recorded at launch. A zombie counts as dead.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

PROC = Path("/proc")

# Handles of the servers this process started, kept so a server that dies is reaped (not left a zombie
# that looks alive) and so Popen does not warn about a child still running when it is collected.
_children: dict[int, subprocess.Popen] = {}


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and parens)."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rindex(")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    """The start time of a live process (clock ticks since boot); None if it is gone or a zombie."""
    if pid in _children:
        _children[pid].poll()  # reaps it if it has exited
    stat = _stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return None
    return int(stat[19])  # field 22 of stat(5), counted from state = field 3


def is_ours(pid: int, proc_start: int | None) -> bool:
    if not PROC.exists():  # no /proc (not Linux): existence is all we can check
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return False
    ticks = start_ticks(pid)
    return ticks is not None and ticks == proc_start


def group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process left in the group? sglang's scheduler children hold the GPU."""
    if not PROC.exists():
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat and int(stat[2]) == pgid and stat[0] not in ("Z", "X"):
                return True
    return False


def spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start `argv` detached: own session (survives the run, the client and a terminal hangup), no stdin,
    stdout and stderr appended to the log."""
    log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, close_fds=True)
    _children[proc.pid] = proc
    return proc


def exit_code(pid: int) -> int | None:
    proc = _children.get(pid)
    return proc.poll() if proc else None


def stop_group(pid: int, proc_start: int | None, timeout_s: float = 30.0) -> None:
    """SIGTERM the server's process group, wait for it to go, SIGKILL what is left after `timeout_s`.

    If a *different* process now holds the pid, our group is gone: a pid is not reused while a group of
    that id still has members, so there is nothing of ours to signal.
    """
    if start_ticks(pid) is not None and not is_ours(pid, proc_start):
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
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        start_ticks(pgid)  # reaps the leader if it is our child
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
