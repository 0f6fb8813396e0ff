"""How `dg dev` stops with a materialisation running: one SIGINT to `dg dev` alone (what `kill -INT`, a process
manager or a launcher that signals one pid sends), then SIGINT to its whole process group (what Ctrl-C in its terminal
sends). Prints the seconds each took, the processes left in `dg dev`'s session, the rows committed meanwhile and how
the run ended. Not a test: it takes minutes (the UI loads, the run starts); every process it starts is in one session
of its own, ended by pid at the end.

    uv run python benchmarks/bench_dg_dev_stop.py [--observe-s 60]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.backfill import LAUNCH, SHARD_ASSETS  # noqa: E402
from tests.support.cli import free_base_port  # noqa: E402


def session(leader: subprocess.Popen) -> list[psutil.Process]:
    """The living processes of `leader`'s session (dg dev, the webserver, the daemon, the code server, the run)."""
    leader.poll()  # dg dev itself, reaped once it exits
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == leader.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except OSError:
            continue
    return found


def rows(data: Path) -> int:
    """Committed completion rows (their parts' row counts)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in data.glob("completions/**/*.parquet"))


def gql(port: int, query: str, variables: dict) -> dict:
    body = json.dumps({"query": query, "variables": variables}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())["data"]


def wait(what: str, ready, limit_s: float) -> float:
    start = time.monotonic()
    while not ready():
        if time.monotonic() - start > limit_s:
            raise SystemExit(f"{what}: not within {limit_s:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - start


def answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2)
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--observe-s", type=float, default=60.0, help="seconds to watch after the SIGINT to dg dev")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dg-dev-stop-"))
    home, data, port = tmp / "home", tmp / "data", free_base_port(1)
    home.mkdir()
    shutil.copy(ROOT / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "DFLASH_DATA_DIR": str(data),
        # slow decoding: the shard's run lasts minutes, so it is running when the signals come
        "DFLASH_EMULATOR_ARGS": "--reasoning-parser qwen3 --tool-call-parser qwen25 --decode-tokens-per-s 5",
    }
    dev = subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "dg"), "dev", "-p", str(port), "-h", "127.0.0.1"],
        cwd=ROOT,
        env=env,
        start_new_session=True,  # its own session and group: the signals below reach only it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a terminal's default, even under `&`
        stdout=(tmp / "dg-dev.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        up = wait("the UI", lambda: answers(port), 300)
        params = {
            "title": "dg dev stop",
            "partitionsByAssets": [
                {"assetKey": {"path": [a]}, "partitions": {"range": {"start": "00000", "end": "00000"}}}
                for a in SHARD_ASSETS
            ],
        }
        assert gql(port, LAUNCH, {"params": params})["launchPartitionBackfill"]["__typename"] == "LaunchBackfillSuccess"
        wait("a committed row", lambda: rows(data) > 0, 600)
        print(f"UI up in {up:.0f} s; a run is generating ({rows(data)} rows committed)")
        before, start = rows(data), time.monotonic()
        os.kill(dev.pid, signal.SIGINT)  # dg dev alone
        wait("dg dev's exit", lambda: dev.poll() is not None, 300)
        exited = time.monotonic() - start
        time.sleep(max(0.0, args.observe_s - exited))
        left = session(dev)
        print(
            f"one SIGINT to dg dev: it exited in {exited:.1f} s (status {dev.returncode}); {args.observe_s:.0f} s "
            f"later {len(left)} processes of its session still run ({', '.join(sorted({p.name() for p in left}))}) "
            f"and the run committed {rows(data) - before} more rows"
        )
        start = time.monotonic()
        for p in left:  # Ctrl-C in a terminal: SIGINT to every process of the foreground group
            p.send_signal(signal.SIGINT)
        gone = wait("the session's end", lambda: not session(dev), 300)
        from dagster import DagsterInstance

        with DagsterInstance.from_config(str(home)) as instance:
            statuses = [r.status.value for r in instance.get_runs()]
        print(f"then SIGINT to the group: every process gone in {gone:.1f} s; runs: {statuses}; rows {rows(data)}")
    finally:
        for p in session(dev):
            p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
