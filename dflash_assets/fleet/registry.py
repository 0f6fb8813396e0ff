"""The launched fleet on disk, `<dagster_home>/fleet/registry.json`: the only memory of which processes are ours,
written atomically under an exclusive lock on `registry.lock`. It names the API key's variable, never the key.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# 2 recorded proc_start since the epoch, 3 since boot; processes.is_ours reads both
REGISTRY_VERSION = 3


@dataclass
class ServerRecord:
    name: str  # gpu0, gpu1, ... (gpu0-1 with tp_size 2)
    pid: int  # also the process group id: the server runs in its own session
    proc_start: float | None  # processes.start_time (s since boot): tells our process from a reused pid
    host: str
    port: int
    gpus: list[int]
    args_hash: str
    args: dict  # ServerCommand.canonical(): no key
    command: list[str]  # the argv as launched, without the key
    api_key_env: str | None  # the variable the key was read from, if a key was set
    started_at: str  # ISO 8601, UTC
    log: str

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


def registry_path(fleet_dir: Path) -> Path:
    return Path(fleet_dir) / "registry.json"


def load(fleet_dir: Path) -> dict[str, ServerRecord]:
    path = registry_path(fleet_dir)
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if data.get("version") not in (1, 2, REGISTRY_VERSION):
        raise ValueError(f"{path}: registry version {data.get('version')!r}, this code reads {REGISTRY_VERSION}")
    records = {name: ServerRecord(**rec) for name, rec in data["servers"].items()}
    if data["version"] == 1:  # warm servers launched by earlier versions stay ours: their start in clock ticks
        ticks = os.sysconf("SC_CLK_TCK")  # seconds since boot, as psutil computes them on Linux
        records = {
            n: r if r.proc_start is None else replace(r, proc_start=r.proc_start / ticks) for n, r in records.items()
        }
    return records


def save(fleet_dir: Path, servers: dict[str, ServerRecord]) -> None:
    path = registry_path(fleet_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps(
        {"version": REGISTRY_VERSION, "servers": {n: asdict(r) for n, r in sorted(servers.items())}}, indent=2
    )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".registry.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # The rename itself is durable only once the directory entry is on disk.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextmanager
def locked(fleet_dir: Path):
    """Hold the fleet lock for a whole read-decide-launch-write cycle (blocks while another holds it)."""
    fleet_dir = Path(fleet_dir)
    fleet_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(fleet_dir / "registry.lock", "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
