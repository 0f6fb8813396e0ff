"""Real Dagster processes for tests: `dagster-webserver` and `dagster-daemon` on a temporary DAGSTER_HOME.

Each process runs in its own session (process group) with SIGINT reset to SIG_DFL: Dagster maps SIGTERM to
its SIGINT handler, and a process started from a non-interactive shell inherits SIGINT as SIG_IGN, so without
the reset it would ignore both. Stopping = SIGTERM to the whole group (the webserver's and the daemon's code
servers, the run workers, their step processes), then SIGKILL after a grace period.

The temporary instance gets a copy of the project's dagster_home/dagster.yaml, so the run queue and the
`sglang_fleet` concurrency pool under test are the ones a person gets from `dagster dev`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml
from dagster_graphql import DagsterGraphQLClient

from dflash_assets.cli import PROJECT_DAGSTER_YAML  # the instance settings `dflash` writes into an empty home
from dflash_assets.emulator.process import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKSPACE = ROOT / "workspace.yaml"
ARTIFACTS = ROOT / "test-artifacts"
LOCATION = "dflash_assets"

LOCATION_STATUS = """{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus
  locationOrLoadError { __typename ... on PythonError { message } } } } } }"""


def project_pool_limit() -> int:
    """concurrency.pools.default_limit of the project's dagster.yaml: the limit of the `sglang_fleet` pool."""
    return int(yaml.safe_load(PROJECT_DAGSTER_YAML.read_text())["concurrency"]["pools"]["default_limit"])


def fresh_dir(path: Path) -> Path:
    """An empty directory at `path` (what a previous test session left there is removed)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def make_home(path: Path, dagster_yaml: Path = PROJECT_DAGSTER_YAML) -> Path:
    """A fresh DAGSTER_HOME with the project's dagster.yaml (run queue, concurrency pools, run monitoring), or
    another (deploy/dagster.yaml: Postgres, its DAGSTER_PG_* settings in this process's environment), its
    storages created here, so processes started side by side on it don't race to create the tables."""
    from dagster import DagsterInstance

    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(dagster_yaml, path / "dagster.yaml")
    with DagsterInstance.from_config(str(path)) as instance:
        instance.get_runs(limit=1)
        instance.get_dynamic_partitions("shards")
        instance.all_instigator_state()
        instance.event_log_storage.get_concurrency_keys()
    return path


def dflash_env(home: Path, **settings: str | int) -> dict[str, str]:
    """The environment of a Dagster process: this one's, less any DFLASH_* setting of the caller's shell, plus
    DAGSTER_HOME and the given settings (`data_dir="..."` -> DFLASH_DATA_DIR=...)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env["DAGSTER_HOME"] = str(home)
    env.update({f"DFLASH_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_group(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )  # noqa: PLW1509 - one signal() call in the child


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the process group, SIGKILL to it after `grace_s`; also reaps what was left in the group."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; make sure no child of the group (code server, run worker) outlives it
        deadline = time.monotonic() + wait_s
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _group_alive(proc.pid):
            break
    if proc.poll() is None:
        proc.wait(timeout=10)


def stop_groups(procs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    """stop_group for several process groups at once (a Celery worker's warm shutdown takes seconds: waited for
    together, not one after the other)."""
    with ThreadPoolExecutor(max(1, len(procs))) as pool:
        list(pool.map(lambda proc: stop_group(proc, grace_s), procs))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


@dataclass
class Webserver:
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client(self) -> DagsterGraphQLClient:
        return DagsterGraphQLClient("127.0.0.1", port_number=self.port, timeout=60)

    def gql(self, query: str, variables: dict | None = None) -> dict:
        return self.client._execute(query, variables)


@contextmanager
def webserver(
    home: Path, env: dict[str, str] | None = None, *, log_dir: Path | None = None, timeout_s: float = 120.0
) -> Iterator[Webserver]:
    """`dagster-webserver -w workspace.yaml` on a free loopback port, up once the code location is LOADED."""
    port = free_port()
    log_path = (log_dir or home) / "webserver.log"
    proc = start_group(
        [sys.executable, "-m", "dagster_webserver", "-w", str(WORKSPACE), "-h", "127.0.0.1", "-p", str(port)],
        env or dflash_env(home),
        log_path,
    )
    server = Webserver(port, proc, log_path)
    try:
        wait_loaded(server, "dagster-webserver", timeout_s)
        yield server
    finally:
        stop_group(proc)


def wait_loaded(server: Webserver, what: str, timeout_s: float) -> None:
    """Until the webserver answers and its code location is LOADED."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            entries = server.gql(LOCATION_STATUS)["workspaceOrError"]["locationEntries"]
            if entries and all(e["loadStatus"] == "LOADED" for e in entries):
                return
        except Exception:  # noqa: BLE001, S110 - not listening yet, or the location is still loading
            pass
        if server.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"{what} did not load {WORKSPACE.name} within {timeout_s:.0f}s "
                f"(exit {server.proc.poll()}):\n{log_tail(server.log_path)}"
            )
        time.sleep(0.5)


# The backfill daemon sleeps DEFAULT_DAEMON_INTERVAL_SECONDS (30 s) between iterations, and a backfill needs two
# of them (submit, then see it finished). Tests shorten that sleep so a backfill takes seconds, not minutes;
# everything else is the stock `dagster-daemon run`. This private patch is kept because no public setting exists
# in 1.13: dagster.yaml's `backfills:` takes only use_threads / num_workers / num_submit_workers, and
# `dagster._daemon.backfill.execute_backfill_iteration_loop` reads the module constant directly. The run queue's
# daemon, which launches the runs a backfill submits, takes the same interval (5 s by default, so a submitted run
# waited 2.5 s on average, each backfill of the engine tests): patched in the daemon too, rather than set in the
# instance's `run_queue: dequeue_interval_seconds`, so the dagster.yaml under test is the project's, unchanged.
_DAEMON_MAIN = """
import sys
import dagster._daemon.controller as controller
from dagster._core.run_coordinator.queued_run_coordinator import QueuedRunCoordinator
controller.DEFAULT_DAEMON_INTERVAL_SECONDS = float(sys.argv.pop(1))
QueuedRunCoordinator.dequeue_interval_seconds = property(lambda _: controller.DEFAULT_DAEMON_INTERVAL_SECONDS)
from dagster._daemon.cli import main
sys.argv[0] = "dagster-daemon"
main()
"""


@contextmanager
def daemon(
    home: Path,
    env: dict[str, str] | None = None,
    *,
    log_dir: Path | None = None,
    backfill_interval_s: float | None = 2.0,
) -> Iterator[subprocess.Popen]:
    """`dagster-daemon run -w workspace.yaml` on `home` (schedules, sensors, run queue, backfills, monitoring)."""
    args = ["run", "-w", str(WORKSPACE)]
    if backfill_interval_s is None:
        cmd = [sys.executable, "-m", "dagster._daemon", *args]
    else:
        cmd = [sys.executable, "-c", _DAEMON_MAIN, str(backfill_interval_s), *args]
    log_path = (log_dir or home) / "daemon.log"
    proc = start_group(cmd, env or dflash_env(home), log_path)
    try:
        yield proc
    finally:
        stop_group(proc)


DAEMON_HEALTH = """{ instance { daemonHealth { allDaemonStatuses { daemonType healthy required } } } }"""


def wait_daemon_healthy(
    server: Webserver,
    daemon_proc: subprocess.Popen,
    timeout_s: float = 120.0,
    needed=("BACKFILL", "QUEUED_RUN_COORDINATOR", "SENSOR"),
) -> None:
    """Until the daemon's heartbeats say the backfill, run-queue and sensor daemons are up."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = server.gql(DAEMON_HEALTH)["instance"]["daemonHealth"]["allDaemonStatuses"]
        healthy = {s["daemonType"] for s in statuses if s["healthy"]}
        if set(needed) <= healthy:
            return
        if daemon_proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"dagster-daemon not healthy within {timeout_s:.0f}s (exit {daemon_proc.poll()}; "
                f"healthy: {sorted(healthy)})"
            )
        time.sleep(0.5)


def add_shard_partitions(server: Webserver, keys: list[str]) -> None:
    """Add dynamic `shards` partitions the way the UI's "add partition" does (GraphQL addDynamicPartition)."""
    mutation = """mutation($selector: RepositorySelector!, $key: String!) {
      addDynamicPartition(repositorySelector: $selector, partitionsDefName: "shards", partitionKey: $key) {
        __typename ... on PythonError { message } ... on DuplicateDynamicPartitionError { partitionName } } }"""
    for key in keys:
        result = server.gql(
            mutation, {"selector": {"repositoryLocationName": LOCATION, "repositoryName": "__repository__"}, "key": key}
        )
        kind = result["addDynamicPartition"]["__typename"]
        # added meanwhile by the prompt shards' sensor (dagster dev runs it): the insert loses the race
        raced = kind == "PythonError" and "UNIQUE constraint failed" in result["addDynamicPartition"]["message"]
        assert kind in ("AddDynamicPartitionSuccess", "DuplicateDynamicPartitionError") or raced, result


def materialize_shards(
    env: dict[str, str], plan: dict[str, int | None], log_path: Path, timeout_s: float = 240.0
) -> dict[str, dict]:
    """Add the shard partitions of `plan` and run shard_pipeline for each shard whose value (the cap,
    max_output_tokens) is not None, the way `dflash demo` does, in a child process with `env` (the definitions read
    the DFLASH_* settings when they are imported: tests/support/shard_seed.py), forked warm (tests/support/forks.py:
    Dagster, matplotlib and the layers below the definitions already imported). Returns {shard: {success, run_id,
    checks}}."""
    import json

    from tests.support.forks import Forked

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dflash-seed-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        child = Forked("tests.support.shard_seed:main", [json.dumps(plan)], env, ROOT, out, err, session=False)
        try:
            status = child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            raise
        stdout, stderr = out.read_text(), err.read_text()
    log_path.write_text(stdout + stderr)
    if status != 0:
        raise RuntimeError(f"materialising {plan} failed (exit {status}):\n{stderr[-3000:]}")
    results = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {r["shard"]: r for r in results}


# `dagster dev` starts its daemon itself, as `python -m dagster._daemon run`, so the daemon's intervals are shortened
# there by a sitecustomize on that process's PYTHONPATH, which applies the same patch as _DAEMON_MAIN to the daemon
# only (every other process of the group starts as it always does).
_DEV_SITECUSTOMIZE = """
import os, sys
if sys.orig_argv[1:3] == ["-m", "dagster._daemon"] and os.environ.get("DFLASH_TEST_DAEMON_INTERVAL_S"):
    import dagster._daemon.controller as controller
    from dagster._core.run_coordinator.queued_run_coordinator import QueuedRunCoordinator
    controller.DEFAULT_DAEMON_INTERVAL_SECONDS = float(os.environ["DFLASH_TEST_DAEMON_INTERVAL_S"])
    QueuedRunCoordinator.dequeue_interval_seconds = property(lambda _: controller.DEFAULT_DAEMON_INTERVAL_SECONDS)
"""


@contextmanager
def dagster_dev(
    home: Path, env: dict[str, str], *, log_dir: Path, port: int | None = None, backfill_interval_s: float = 2.0
) -> Iterator[tuple[Webserver, subprocess.Popen]]:
    """`dagster dev -w workspace.yaml` (webserver, daemon, code server, and the runs they launch: one process group)
    on `home`, up once the code location is loaded and the daemon healthy; (its webserver, the group's leader)."""
    site = log_dir / "dev-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_DEV_SITECUSTOMIZE)
    env = env | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")])),
        "DFLASH_TEST_DAEMON_INTERVAL_S": str(backfill_interval_s),
    }
    port = port or free_port()
    log_path = log_dir / "dagster-dev.log"
    proc = start_group(
        [sys.executable, "-m", "dagster", "dev", "-w", str(WORKSPACE), "-h", "127.0.0.1", "-p", str(port)],
        env,
        log_path,
    )
    server = Webserver(port, proc, log_path)
    try:
        wait_loaded(server, "dagster dev", 180.0)
        wait_daemon_healthy(server, proc, timeout_s=180.0)
        yield server, proc
    finally:
        stop_group(proc)
