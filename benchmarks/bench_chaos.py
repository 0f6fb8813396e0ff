"""Chaos: a long run's faults together, on a seeded schedule; what is lost, duplicated, failed, and what each costs.

    uv run python benchmarks/bench_chaos.py [--prompts 100000] [--workers 3] [--seed 58] [--json out.json]

`dflash backfill` (the real command, in its own process) on emulated SGLang 0.5.23 servers behind the real smg
gateway (deploy/sglang-router.sh), its data dir on a tmpfs of its own (root: mounts it). One prompt of the source
kills any server it reaches (the emulator's crash_on fault). The faults come at fixed shares of the run's progress
(committed rows), each share moved by a seeded jitter, so the same schedule runs at any size:

    5xx burst      a worker answers its next requests 503
    kill worker    a worker is killed -9 (a supervisor relaunches a dead worker at its port after 2 s: `fleet up`)
    kill -9        the orchestrator is killed -9 (twice), then the same command started again
    stall          a worker holds its next requests past the stall timeout
    add worker     a fourth worker is registered with smg (POST /workers)
    disk full      the data dir's tmpfs is shrunk to what it holds; once the run stops, grown back, the command again
    SIGTERM        the orchestrator is stopped politely, then the same command again
    remove worker  a first worker is removed from smg (DELETE /workers/{id})

Then the same command runs until it ends. Printed: rows lost (prompts neither committed nor failed), duplicated
(rows beyond one per prompt), failed (and which), each fault's time to the next committed row, the wall time, and the
orchestrator's peak memory (RSS of its process tree, sampled every 0.25 s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository, for tests.support
from tests.support.http import call  # noqa: E402  (shared with the tests)

MARKER = "POISON-chaos-58"
FLAGS = ["--reasoning-parser", "qwen3", "--length-median", "40", "--length-sigma", "0.3", "--length-max", "200"]
FLAGS += ["--decode-tokens-per-s", "4000", "--max-running-requests", "32", "--fault-crash-on", MARKER]
# (share of the run's rows committed, fault): the schedule; each share moved by up to +-0.02, seeded
SCHEDULE = [
    (0.05, "5xx burst"),
    (0.10, "kill -9"),
    (0.15, "kill worker"),
    (0.22, "stall"),
    (0.30, "add worker"),
    (0.38, "disk full"),
    (0.48, "kill -9"),
    (0.58, "remove worker"),
    (0.68, "SIGTERM"),
]


def free_port() -> int:
    from dflash_assets.emulator.process import free_port as port

    return port()


def committed(data: Path) -> int:
    """Rows in committed completion parts (their Parquet footers: cheap at any size)."""
    total = 0
    for part in data.glob("completions/*/*.parquet"):
        try:
            total += pq.ParquetFile(part).metadata.num_rows
        except (OSError, ValueError):  # compacted away meanwhile
            continue
    return total


def rows(data: Path, table: str) -> list[dict]:
    import duckdb

    if not list(data.glob(f"{table}/**/*.parquet")):
        return []
    cols = ["prompt_id"] if table == "completions" else ["prompt_id", "error"]
    found = duckdb.sql(f"select {', '.join(cols)} from read_parquet('{data}/{table}/**/*.parquet')").fetchall()
    return [dict(zip(cols, r)) for r in found]


@dataclass
class Fleet:
    """The workers behind smg: started, killed, relaunched at their ports, added and removed."""

    logs: Path
    workers: dict[int, object] = field(default_factory=dict)  # port -> EmulatorProcess
    dead_since: dict[int, float] = field(default_factory=dict)
    removed: set[int] = field(default_factory=set)
    gateway: str = ""
    smg: subprocess.Popen | None = None

    def start(self, port: int | None = None):
        from dflash_assets.emulator.process import start_emulator

        worker = start_emulator(FLAGS, port=port, log_path=self.logs / f"worker-{port or 'new'}-{time.time():.0f}.log")
        self.workers[worker.port] = worker
        return worker

    def start_smg(self, n: int) -> None:
        urls = [self.start().url for _ in range(n)]
        port = free_port()
        env = {**os.environ, "SMG_PORT": str(port), "SMG_METRICS_PORT": str(free_port()), "SMG_HEALTH_INTERVAL_S": "1"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        with open(self.logs / "smg.log", "ab") as log:
            self.smg = subprocess.Popen(
                ["bash", str(ROOT / "deploy" / "sglang-router.sh"), *urls],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.gateway = f"http://127.0.0.1:{port}"
        self.wait_healthy(n)

    def healthy(self) -> int:
        try:
            return sum(w["is_healthy"] for w in call("GET", f"{self.gateway}/workers")["workers"])
        except OSError:
            return 0

    def wait_healthy(self, n: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.healthy() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"smg at {self.gateway} lists fewer than {n} healthy workers")
            time.sleep(0.2)

    def relaunch_dead(self, now: float) -> int:
        """Relaunch, at its port, a worker dead for 2 s (what `dflash fleet up` does); returns deaths seen now."""
        new = 0
        for port, worker in list(self.workers.items()):
            if port in self.removed or worker.alive():
                continue
            if port not in self.dead_since:
                self.dead_since[port], new = now, new + 1
            elif now - self.dead_since[port] >= 2.0:
                del self.dead_since[port]
                self.start(port)
        return new

    def stop(self) -> None:
        if self.smg is not None:
            os.killpg(self.smg.pid, signal.SIGKILL)
            self.smg.wait()
        for worker in self.workers.values():
            worker.stop()


@dataclass
class Orchestrator:
    """`dflash backfill`, in a session of its own: started, killed, started again; its exits and peak memory."""

    env: dict
    args: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    exits: list[int] = field(default_factory=list)
    peak_rss: int = 0

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dflash_assets.cli", "backfill", *self.args],
                env=self.env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def ended(self) -> int | None:
        """Its exit status once it has ended (its group reaped), else None; samples its tree's memory."""
        assert self.proc is not None
        if (status := self.proc.poll()) is None:
            try:
                tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
                self.peak_rss = max(self.peak_rss, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            return None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what the kill left of its group
        except ProcessLookupError:
            pass
        self.exits.append(status)
        return status


def source(path: Path, n: int, rng: random.Random) -> str:
    """n prompts, one of them poisoned at a seeded place in the middle of the source; its id."""
    poisoned = rng.randrange(n * 2 // 5, n * 3 // 5)
    with open(path, "w") as f:
        for i in range(n):
            text = f"Chaos prompt {i}: explain item {i % 89}." + (f" {MARKER}" if i == poisoned else "")
            f.write(json.dumps({"id": f"c{i:07d}", "prompt": text}) + "\n")
    return f"c{poisoned:07d}"


@dataclass
class Fault:
    name: str
    share: float  # of the run's rows committed when it comes
    at: float | None = None  # monotonic time it came
    rows: int = 0  # committed rows when it came
    recovered_s: float | None = None  # from it to the next committed row


def fill(data: Path) -> None:
    """Take what is free on the data dir's filesystem (again as the run frees some: compaction deletes parts)."""
    with open(data / "ballast", "ab") as f:
        try:
            while True:
                f.write(b"\0" * 2**16)
                f.flush()
        except OSError:
            pass


def inject(fault: Fault, fleet: Fleet, orch: Orchestrator, data: Path, rng: random.Random) -> None:
    alive = sorted(p for p, w in fleet.workers.items() if w.alive() and p not in fleet.removed)
    port = rng.choice(alive)
    url = f"http://127.0.0.1:{port}"
    if fault.name == "5xx burst":
        call("POST", f"{url}/_emulator/faults", {"fail_next": 40})
    elif fault.name == "stall":
        call("POST", f"{url}/_emulator/faults", {"stall_seconds": 20, "stall_next": 8})
    elif fault.name == "kill worker":
        os.kill(fleet.workers[port].pid, signal.SIGKILL)
    elif fault.name == "add worker":
        call("POST", f"{fleet.gateway}/workers", {"url": fleet.start().url})
    elif fault.name == "remove worker":
        listed = {
            int(w["url"].rsplit(":", 1)[1].rstrip("/")): w for w in call("GET", f"{fleet.gateway}/workers")["workers"]
        }
        port = rng.choice(sorted(set(listed) & set(alive)))
        call("DELETE", f"{fleet.gateway}/workers/{listed[port]['id']}")
        fleet.removed.add(port)
    elif fault.name == "disk full":  # shrunk to what it holds and a MiB, that MiB taken: the next write fails
        st = os.statvfs(data)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        subprocess.run(["mount", "-o", f"remount,size={used + 2**20}", str(data)], check=True)
        fill(data)
    else:
        orch.signal(signal.SIGKILL if fault.name == "kill -9" else signal.SIGTERM)


def chaos(args: argparse.Namespace, tmp: Path) -> dict:
    rng = random.Random(args.seed)
    data, home, logs = tmp / "data", tmp / "home", tmp / "logs"
    for d in (home, logs):
        d.mkdir()
    data.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8g", "tmpfs", str(data)], check=True)
    src = tmp / "prompts.jsonl"
    poisoned = source(src, args.prompts, rng)
    schedule = sorted(
        (Fault(name, share + rng.uniform(-0.02, 0.02)) for share, name in SCHEDULE), key=lambda f: f.share
    )
    fleet = Fleet(logs)
    try:
        fleet.start_smg(args.workers)
        env = {**os.environ, "DAGSTER_HOME": str(home), "DFLASH_DATA_DIR": str(data), "DFLASH_PROMPTS": str(src)}
        env |= {"DFLASH_FLEET_MODE": "attach", "DFLASH_FLEET_URLS": fleet.gateway, "DFLASH_RETRY_DELAY_S": "1"}
        env |= {"DFLASH_SHARD_SIZE": str(max(100, args.prompts // 10))}
        flags = ["--max-output-tokens", "512", "--stall-timeout-s", "5", "--no-server-timeout-s", "60"]
        flags += ["--commit-rows", str(max(20, args.prompts // 400)), "--commit-seconds", "1"]
        orch = Orchestrator(env, flags, logs / "backfill.log")
        figures = run_schedule(fleet, orch, data, schedule, rng, args.prompts)
        done = [r["prompt_id"] for r in rows(data, "completions")]
        failed = rows(data, "failures")
    finally:
        fleet.stop()
        subprocess.run(["umount", "-l", str(data)], check=False)
    lost = set(f"c{i:07d}" for i in range(args.prompts)) - set(done) - {r["prompt_id"] for r in failed}
    return figures | {
        "prompts": args.prompts,
        "poisoned": poisoned,
        "committed": len(set(done)),
        "lost": len(lost),
        "duplicated": len(done) - len(set(done)),
        "failed": sorted((r["prompt_id"], r["error"][:60]) for r in failed),
        "faults": [(f.name, f.rows, f.recovered_s) for f in schedule],
    }


def run_schedule(
    fleet: Fleet, orch: Orchestrator, data: Path, schedule: list[Fault], rng: random.Random, total: int
) -> dict:
    """The command, the faults as the committed rows reach them (each once the run committed a row after the last
    one), the command again after every stop, until it ends done (0, or 3: stopped by a blocking check, every row
    committed) with every fault come."""
    start, deaths, disk_full = time.monotonic(), 0, False
    pending = list(schedule)
    orch.start()
    while True:
        now, n = time.monotonic(), committed(data)
        deaths += fleet.relaunch_dead(now)
        if disk_full:
            fill(data)
        for f in schedule:
            if f.at is not None and f.recovered_s is None and n > f.rows:
                f.recovered_s = now - f.at
        status = orch.ended()
        if status is not None:
            if disk_full:  # the run stopped on it: room again, then the same command
                (data / "ballast").unlink()
                subprocess.run(["mount", "-o", "remount,size=8g", str(data)], check=True)
                disk_full = False
            if status in (0, 3) and not pending:
                break
            if len(orch.exits) > 40:
                raise RuntimeError(f"the command did not finish after 40 starts: exits {orch.exits}")
            orch.start()
        elif pending and n >= pending[0].share * total and all(f.recovered_s is not None for f in schedule if f.at):
            fault = pending.pop(0)
            fault.at, fault.rows = now, n
            disk_full = disk_full or fault.name == "disk full"
            inject(fault, fleet, orch, data, rng)
        time.sleep(0.25)
    return {
        "wall_s": round(time.monotonic() - start, 1),
        "exits": orch.exits,
        "worker_deaths": deaths,
        "peak_rss_mb": round(orch.peak_rss / 2**20),
    }


def report(figures: dict) -> None:
    print(f"\nchaos: {figures['prompts']:,} prompts, poisoned {figures['poisoned']}, wall {figures['wall_s']} s")
    print("| fault | committed rows when it came | to the next committed row |\n|---|---|---|")
    for name, at, recovered in figures["faults"]:
        print(f"| {name} | {at:,} | {'-' if recovered is None else f'{recovered:.1f} s'} |")
    print(f"\n| figure | value |\n|---|---|\n| rows committed | {figures['committed']:,} |")
    print(f"| rows lost | {figures['lost']} |\n| rows duplicated | {figures['duplicated']} |")
    print(f"| failed | {len(figures['failed'])}: {figures['failed']} |")
    print(f"| worker deaths | {figures['worker_deaths']} |\n| command exits | {figures['exits']} |")
    print(f"| peak RSS of the orchestrator's process tree | {figures['peak_rss_mb']} MB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=58)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "dflash-chaos-logs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dflash-chaos-") as tmp:
        try:
            figures = chaos(args, Path(tmp))
        finally:  # the logs of the command, smg and the workers outlive the run
            shutil.rmtree(args.logs, ignore_errors=True)
            shutil.copytree(Path(tmp) / "logs", args.logs)
    report(figures)
    if args.json:
        args.json.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
