"""Chaos: a long run's faults together, on a seeded schedule; what is lost, duplicated, failed, and what each costs.

    uv run python benchmarks/bench_chaos.py [--prompts 100000] [--workers 3] [--seed 58] [--json out.json]
    uv run python benchmarks/bench_chaos.py --poison-runs 20 [--health-intervals 1,5]

`dflash backfill` (the real command, in its own process) on emulated SGLang 0.5.23 servers behind the real smg
gateway (deploy/sglang-router.sh), its data dir on a tmpfs of its own (root: mounts it). One prompt of the source
kills any server it reaches (the emulator's crash_on fault). The faults come at fixed shares of the run's progress
(the requests the workers answered, which the committed rows follow by the commit's delay), each share moved by a
seeded jitter, so the same schedule runs at any size. Each fault comes with the fleet held (the emulator's hold
fault), then the fleet is released; a stop comes only once no worker died for 2 s. Between two looks each worker
answers a bounded number of requests (hold_after), far fewer than the schedule's tail, so every fault comes before
the run can end, whatever the run's speed or the machine's load:

    5xx burst      a worker answers its next requests 503
    kill worker    a worker is killed -9 (a supervisor relaunches a dead worker at its port after 2 s: `fleet up`)
    kill -9        the orchestrator is killed -9 (twice), then the same command started again
    stall          a worker holds its next requests past the stall timeout
    add worker     a fourth worker is registered with smg (POST /workers)
    disk full      the data dir's tmpfs is shrunk to what it holds; once the run stops, grown back, the command again
    SIGTERM        the orchestrator is stopped politely, then the same command again
    remove worker  a first worker is removed from smg (DELETE /workers/{id})

Then the same command runs until it ends; a full disk that does not stop the command within 120 s is an error.
`--warm` forks the command and the workers from a process that imported them already (tests/support/forks.py), as
the test suite does (tests/engines/test_chaos.py). Printed: rows lost (prompts neither committed nor failed),
duplicated (rows beyond one per prompt), failed (and which), each fault's time to the next committed row, the worker
deaths, the wall time, and the orchestrator's peak memory (RSS of its process tree, sampled every 0.25 s).
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
from dflash_assets.store.parts import COVERS_KEY  # noqa: E402
from tests.support.forks import Forked, spawn_emulator  # noqa: E402
from tests.support.http import call  # noqa: E402  (shared with the tests)

MARKER = "POISON-chaos-58"
FLAGS = ["--reasoning-parser", "qwen3", "--length-median", "40", "--length-sigma", "0.3", "--length-max", "200"]
FLAGS += ["--decode-tokens-per-s", "4000", "--max-running-requests", "8", "--fault-crash-on", MARKER]
STOPS = ("kill -9", "SIGTERM", "disk full")  # the faults that stop the command
GENERATION_ROUTES = ("/v1/chat/completions", "/generate")  # what a worker answers the run on
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
    """Rows in committed completion parts, read from their Parquet footers (cheap at any size): a part that a compacted
    file covers is not counted twice, and a listing that a compaction changed meanwhile is read again."""
    while True:
        found: dict[Path, int] = {}
        covered: set[Path] = set()
        try:
            for part in data.glob("completions/*/*.parquet"):
                meta = pq.ParquetFile(part).metadata
                found[part] = meta.num_rows
                covers = (meta.metadata or {}).get(COVERS_KEY)
                covered |= {part.parent / name for name in json.loads(covers)} if covers else set()
        except (OSError, ValueError):  # compacted away since the listing: list again
            continue
        return sum(n for part, n in found.items() if part not in covered)


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
    warm: bool = False  # forked warm (tests/support/forks.py), as the test suite starts its servers
    flags: list[str] = field(default_factory=lambda: FLAGS)
    workers: dict[int, object] = field(default_factory=dict)  # port -> EmulatorProcess
    dead_since: dict[int, float] = field(default_factory=dict)
    removed: set[int] = field(default_factory=set)
    gateway: str = ""
    smg: subprocess.Popen | None = None
    budget: int | None = None  # requests a worker serves from its gate on; it holds the rest until the next gate
    gated: dict[int, int] = field(default_factory=dict)  # port -> requests it held when it was gated
    answers: dict[int, int] = field(default_factory=dict)  # id of each worker started -> its requests answered
    deaths: list[int] = field(default_factory=lambda: [0, 0])  # workers seen dead: while the disk had room, while full
    last_death: float = float("-inf")  # monotonic time the last one was seen

    def start(self, port: int | None = None):
        from dflash_assets.emulator.process import start_emulator

        log = self.logs / f"worker-{port or 'new'}-{time.time():.0f}.log"
        worker = start_emulator(self.flags, port=port, log_path=log, spawn=spawn_emulator if self.warm else None)
        self.workers[worker.port] = worker
        self.gate([worker.port])
        return worker

    def live(self) -> list[int]:
        return sorted(p for p, w in self.workers.items() if w.alive() and p not in self.removed)

    def faults(self, port: int, settings: dict | None = None) -> dict | None:
        """A worker's fault state (after `settings`); None when it has just died."""
        try:
            url = f"http://127.0.0.1:{port}/_emulator/faults"
            return call("GET", url) if settings is None else call("POST", url, settings)
        except OSError:
            return None

    def hold(self) -> None:
        """Every live worker holds its next requests (those decoding go on): the run stands still at a fault."""
        for port in self.live():
            self.faults(port, {"hold": True})

    def gate(self, ports: list[int] | None = None) -> None:
        """Release what the workers hold, then let each serve `budget` requests more: between two looks of the
        schedule the run moves on by a bounded number of rows, so neither a fault's share nor the run's end passes
        unseen, whatever the run's speed or the machine's load."""
        ports = self.live() if ports is None else ports
        for port in ports:
            self.faults(port, {"hold": None, "hold_after": None})
        time.sleep(0.1)  # every held request sees the release (the emulator looks every 50 ms)
        for port in ports:
            if (state := self.faults(port, {"hold_after": self.budget})) is not None:
                self.gated[port] = state["injected"]["hold"]

    def top_up(self) -> None:
        """Gate again the workers whose budget ran out (they hold requests): at most one budget a look each."""
        if self.budget is not None:
            held = {p: s["injected"]["hold"] for p in self.live() if (s := self.faults(p)) is not None}
            if spent := [p for p, n in held.items() if n > self.gated.get(p, 0)]:
                self.gate(spent)

    def answered(self) -> int:
        """Generation requests the workers answered (their own route counts), each worker started counted once: the
        run's progress as the fleet sees it at once (committed rows follow it by the commit's delay)."""
        for worker in [self.workers[p] for p in self.live()]:
            try:
                routes = call("GET", f"{worker.url}/_emulator/routes")
            except OSError:  # it has just died: its last count stands
                continue
            self.answers[id(worker)] = sum(routes.get(f"POST {path} 200", 0) for path in GENERATION_ROUTES)
        return sum(self.answers.values())

    def start_smg(self, n: int, health_interval_s: float = 1) -> None:
        urls = [self.start().url for _ in range(n)]
        port = free_port()
        env = {
            **os.environ,
            "SMG_PORT": str(port),
            "SMG_METRICS_PORT": str(free_port()),
            "SMG_HEALTH_INTERVAL_S": str(health_interval_s),
        }
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

    def relaunch_dead(self, now: float, disk_full: bool = False) -> None:
        """Relaunch, at its port, a worker dead for 2 s (what `dflash fleet up` does); count the deaths seen now."""
        for port, worker in list(self.workers.items()):
            if port in self.removed or worker.alive():
                continue
            if port not in self.dead_since:
                self.dead_since[port] = self.last_death = now
                self.deaths[disk_full] += 1
            elif now - self.dead_since[port] >= 2.0:
                del self.dead_since[port]
                self.start(port)

    def settle(self) -> None:
        """Held, until no worker died for 2 s: a stop of the command then never lands while it probes a death it has
        just seen (it would die before writing the death down, and the next run would send its suspects again)."""
        self.hold()
        while True:
            self.relaunch_dead(now := time.monotonic())  # a death during the hold is seen here first
            if now - self.last_death >= 2.0:
                return
            time.sleep(0.25)

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
    warm: bool = False  # forked warm (tests/support/forks.py), as the test suite starts its commands
    proc: subprocess.Popen | Forked | None = None
    exits: list[int] = field(default_factory=list)
    peak_rss: int = 0
    answered: int = 0  # the fleet's answers when it was last started

    def start(self, answered: int = 0) -> None:
        self.answered = answered
        if self.warm:  # forked from a process that imported Dagster already: a restart without the imports' seconds
            self.proc = Forked(
                "dflash_assets.cli:main", ["backfill", *self.args], self.env, ROOT, self.log, self.log, True
            )
            return
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


def room(data: Path) -> None:
    """The full disk's end: the ballast removed, the tmpfs grown back."""
    (data / "ballast").unlink()
    subprocess.run(["mount", "-o", "remount,size=8g", str(data)], check=True)


def inject(fault: Fault, fleet: Fleet, orch: Orchestrator, data: Path, rng: random.Random) -> None:
    alive = fleet.live()
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
        fleet.faults(port, {"hold": None, "hold_after": None})  # what it holds is answered (no later gate reaches it)
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
    fleet, orch = Fleet(logs, args.warm), None
    try:
        fleet.start_smg(args.workers)
        env = {**os.environ, "DAGSTER_HOME": str(home), "DFLASH_DATA_DIR": str(data), "DFLASH_PROMPTS": str(src)}
        env |= {"DFLASH_FLEET_MODE": "attach", "DFLASH_FLEET_URLS": fleet.gateway, "DFLASH_RETRY_DELAY_S": "1"}
        env |= {"DFLASH_SHARD_SIZE": str(args.shard_size or max(100, args.prompts // 10))}
        flags = ["--max-output-tokens", "512", "--stall-timeout-s", "5", "--no-server-timeout-s", "60"]
        flags += ["--commit-rows", str(max(20, args.prompts // 400)), "--commit-seconds", "1"]
        orch = Orchestrator(env, flags, logs / "backfill.log", args.warm)
        figures = run_schedule(fleet, orch, data, schedule, rng, (args.prompts, args.timeout_s))
        done = [r["prompt_id"] for r in rows(data, "completions")]
        failed = rows(data, "failures")
    finally:
        if orch is not None and orch.proc is not None and orch.proc.poll() is None:
            orch.signal(signal.SIGKILL)  # interrupted (Ctrl-C): the command stops too
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
    fleet: Fleet, orch: Orchestrator, data: Path, schedule: list[Fault], rng: random.Random, size: tuple[int, float]
) -> dict:
    """The command, and each fault once the fleet's answers reach its share (and the command was answered since it
    last started): the fleet held, the fault injected, the fleet released. Each worker answers a bounded number of
    requests between two looks (Fleet.gate), far fewer than the schedule's tail, so every fault comes before the run
    can end. A stop (kill -9, SIGTERM, the full disk) is followed by the same command; the full disk must stop it
    before the next fault comes. Until the command ends done (0, or 3: a blocking check stopped the export, every row
    committed)."""
    (total, timeout_s), start, disk_full = size, time.monotonic(), None
    pending = list(schedule)
    fleet.budget = max(8, total // 40)  # a look's answers, far fewer than the schedule's tail (30% of the rows)
    fleet.gate()
    orch.start()
    while True:
        now, n, answered = time.monotonic(), committed(data), fleet.answered()
        if now - start > timeout_s:  # said, and everything stopped (the caller's finally), not killed from outside
            done = [f.name for f in schedule if f.at is not None]
            raise TimeoutError(
                f"no end in {timeout_s:.0f} s: {n:,} rows committed, {answered:,} answered, faults "
                f"come {done}, command exits {orch.exits} (its log: backfill.log)"
            )
        fleet.relaunch_dead(now, disk_full is not None)
        for f in schedule:
            if f.at is not None and f.recovered_s is None and n > f.rows:
                f.recovered_s = now - f.at
        status = orch.ended()
        if status is not None:
            if disk_full is not None:  # the run stopped on it: room again, then the same command
                room(data)
                disk_full = None
            if status in (0, 3):
                if pending:
                    raise RuntimeError(f"the command ended {status} before {[f.name for f in pending]} came")
                break
            if len(orch.exits) > 40:
                raise RuntimeError(f"the command did not finish after 40 starts: exits {orch.exits}")
            orch.start(answered)
        elif disk_full is None and pending and answered >= pending[0].share * total > 0 and answered > orch.answered:
            fault = pending.pop(0)
            if fault.name in STOPS:
                fleet.settle()
            else:
                fleet.hold()
            fault.at, fault.rows = time.monotonic(), committed(data)  # what the run committed meanwhile is before it
            disk_full = fault.at if fault.name == "disk full" else None
            inject(fault, fleet, orch, data, rng)
            fleet.budget = fleet.budget if pending else None  # after the last fault, the run goes at its own pace
            fleet.gate()
        else:
            if disk_full is not None:
                if now - disk_full > 120:
                    raise RuntimeError(f"the full disk did not stop the command in 120 s ({n:,} rows committed)")
                fill(data)  # again, as the run frees some (a compaction deletes parts)
            fleet.top_up()
        time.sleep(0.25)
    return {
        "wall_s": round(time.monotonic() - start, 1),
        "exits": orch.exits,
        "worker_deaths": sum(fleet.deaths),
        "deaths_on_full_disk": fleet.deaths[1],  # a death no run can record (its suspects are written to the full disk)
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
    print(f"| worker deaths | {figures['worker_deaths']} ({figures['deaths_on_full_disk']} while the disk was full) |")
    print(f"| command exits | {figures['exits']} |")
    print(f"| peak RSS of the orchestrator's process tree | {figures['peak_rss_mb']} MB |")


POISON_FLAGS = [*FLAGS[:2], "--length-median", "120", "--length-sigma", "0.4", "--decode-tokens-per-s", "1500"]
POISON_FLAGS += ["--max-running-requests", "3", "--fault-crash-on", MARKER]


def poison_runs(runs: int, intervals: list[int], workers: int, seed: int) -> dict:
    """`--poison-runs`: a prompt that kills its worker, behind smg at each health-check interval, `runs` times: the
    shard engine (generation/) with the dispatch defaults, on `workers` fresh emulators each time; per run the
    workers lost, the innocent prompts failed and the prompt quarantined."""
    from dflash_assets.settings import DispatchSettings
    from tests.support.shards import generate, make_shard

    rng, settings = random.Random(seed), DispatchSettings(commit_rows=4, commit_seconds=0.2, load_sample_s=0)
    found: dict = {}
    for interval in intervals:
        for _ in range(runs):
            poisoned = rng.randrange(30)
            prompts = {
                f"p{i:02d}": f"Poison question {i}." + (f" {MARKER}" if i == poisoned else "") for i in range(30)
            }
            with tempfile.TemporaryDirectory(prefix="dflash-poison-") as tmp:
                fleet = Fleet(Path(tmp), warm=True, flags=POISON_FLAGS)
                try:
                    fleet.start_smg(workers, interval)
                    make_shard(Path(tmp) / "data", [next(iter(fleet.workers.values())).url], prompts)
                    try:
                        ended = f"{generate(Path(tmp) / 'data', [fleet.gateway], 256, settings).completed} committed"
                    except Exception as e:  # the run failed (no worker left): said so in the table
                        ended = f"{type(e).__name__}: {e}"[:80]
                    failed = [r["prompt_id"] for r in rows(Path(tmp) / "data", "failures")]
                    lost = sum(not w.alive() for w in fleet.workers.values())
                finally:
                    fleet.stop()
            quarantined = [p for p in failed if p == f"p{poisoned:02d}"]
            found.setdefault(str(interval), []).append((lost, len(failed) - len(quarantined), ended, quarantined))
    return found


def poison_report(found: dict) -> None:
    print("| health check | runs | workers lost per run | innocent prompts failed | poisoned prompt quarantined |")
    print("|---|---|---|---|---|")
    for interval, runs in found.items():
        lost, innocent, quarantined = [r[0] for r in runs], sum(r[1] for r in runs), sum(bool(r[3]) for r in runs)
        print(f"| {interval} s | {len(runs)} | {' '.join(map(str, lost))} (max {max(lost)}) | {innocent} | ", end="")
        print(f"{quarantined} of {len(runs)} |")
        for ended in sorted({r[2] for r in runs if not r[2].startswith("29 ")}):  # a run that did not end well
            print(f"  {interval} s: a run ended {ended}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=58)
    parser.add_argument("--shard-size", type=int, help="prompts a shard (default: a tenth of them, 100 at least)")
    parser.add_argument("--warm", action="store_true", help="the command and the workers forked warm, as in the tests")
    parser.add_argument("--poison-runs", type=int, help="instead: the poisoned prompt alone, this many runs each")
    parser.add_argument("--health-intervals", default="1,5", help="smg's health checks for --poison-runs (seconds)")
    parser.add_argument("--timeout-s", type=float, default=float("inf"), help="stop everything and fail past this")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "dflash-chaos-logs")
    args = parser.parse_args()
    if args.poison_runs:
        intervals = [int(i) for i in args.health_intervals.split(",")]
        found = poison_runs(args.poison_runs, intervals, args.workers, args.seed)
        poison_report(found)
        if args.json:
            args.json.write_text(json.dumps(found))
        return
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
