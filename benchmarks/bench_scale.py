"""The orchestrator's own cost at scale: `dflash backfill` of N prompts on emulated servers that decode instantly
(so the client is what is measured), CPU seconds and peak RSS per stage, every row checked once.

    uv run python benchmarks/bench_scale.py                              # 100,000 prompts, once
    uv run python benchmarks/bench_scale.py --prompts 100000,1000000 --runs 3
    uv run python benchmarks/bench_scale.py --prompts 20000 --profile /tmp/backfill.prof
    DFLASH_BENCH_TRACE=/tmp/rss.tsv uv run python benchmarks/bench_scale.py --prompts 200000   # RSS each second

The source is bench_repeats.py's (prompts of 10-400 words, 5% exact and 5% near repeats of earlier lines), the
servers `--servers` emulators in attach mode (SGLang 0.5.23's emulator, instant decode, answers of median 200 tokens
unless `--emulator-args` says otherwise), shards of `--shard-size`, cap `--max-output-tokens`. Each run is a fresh `dflash backfill` process (a
fresh instance and data dir) whose CPU is its own and its children's (os.wait4), the emulators apart, and whose peak
RSS is its own. Inside it, the stages are timed where the code enters them (process CPU, the windows exclusive of one
another; commits made in a worker thread while requests are in flight are moved from send to commit by their thread's
CPU), and each stage's peak RSS is the kernel's high-water mark, read and reset when another stage starts
(highwater.py):

  prompt shards   the source read, its repeats found, prompts validated and counted by /v1/tokenize, shards written
  plan            what is left of each shard and the preflight
  send            the dispatch loop: requests, answers, rows
  commit          rows to Parquet parts, compaction, each shard's figures
  checks          the quality checks (the run's and the export's gate)
  report          the shard reports and the summary with the cap plan
  export          the drafter training set
  other           the rest: imports, Dagster's runs and event log, the terminal

Then every row is checked to be there once: completions + rejects = prompts, no (prompt, turn) twice.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import highwater

STAGES = ("prompt shards", "plan", "send", "commit", "checks", "report", "export", "other")
PAGE = os.sysconf("SC_PAGE_SIZE")


class Stages:
    """Process CPU charged to the stage on top of a stack (windows exclusive of one another), and the largest RSS
    while each stage was on top: the kernel's peak since the last switch (highwater.py), and what a thread samples."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.peak: dict[str, int] = defaultdict(int)
        self.stack, self.mark, self.lock = ["other"], time.process_time(), threading.Lock()
        self.statm = open("/proc/self/statm", "rb")  # noqa: SIM115 - read for the life of the process

    def rss(self) -> int:
        self.statm.seek(0)
        return int(self.statm.read().split()[1]) * PAGE

    def _switch(self) -> None:
        now, top = time.process_time(), self.stack[-1]
        self.cpu[top] += now - self.mark
        self.mark = now
        self.peak[top] = max(self.peak[top], self.rss(), highwater.peak())  # the kernel's: even under the GIL
        highwater.reset()

    def enter(self, stage: str) -> None:
        with self.lock:
            self._switch()
            self.stack.append(stage)

    def leave(self, stage: str) -> None:
        with self.lock:
            self._switch()
            del self.stack[len(self.stack) - 1 - self.stack[::-1].index(stage)]

    def moved(self, stage: str, seconds: float, within: str) -> None:
        """`seconds` of one thread's CPU spent on `stage` while the window `within` was on top: charged to it."""
        with self.lock:
            if self.stack[-1] == within:
                self.cpu[within] -= seconds
                self.cpu[stage] += seconds

    def sample(self, trace: Path | None) -> None:
        """Every 20 ms the RSS, to the stage on top; with `trace`, a line a second: seconds, stage, RSS in MB."""
        log, t0, last = (trace.open("w") if trace else None), time.monotonic(), 0.0
        while True:
            time.sleep(0.02)
            with self.lock:
                top, rss = self.stack[-1], self.rss()
                self.peak[top] = max(self.peak[top], rss)
            if log and time.monotonic() - last >= 1:
                last = time.monotonic()
                log.write(f"{last - t0:.0f}\t{top}\t{rss / 2**20:.0f}\t{heap()}\n")
                log.flush()

    def figures(self) -> dict:
        with self.lock:
            self._switch()
        # the processes it started and waited for: a child's peak counts the memory it shared with this one
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        return {"cpu": dict(self.cpu), "peak": dict(self.peak), "children_peak": children}


def heap() -> str:
    """What holds the memory: glibc's heap in use and free in it, Arrow's pool (MB), Python's allocated blocks
    (thousands; not gc.get_objects() from this thread: it can hand out a tuple being built, and CPython 3.11 then
    fails that tuple's resize with SystemError)."""
    import ctypes

    import pyarrow as pa

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (f, ctypes.c_size_t)
            for f in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    m = libc.mallinfo2()
    mb = 2**20
    return f"{(m.uordblks + m.hblkhd) / mb:.0f}\t{m.fordblks / mb:.0f}\t{pa.total_allocated_bytes() / mb:.0f}\t{sys.getallocatedblocks() // 1000}"


def window(stages: Stages, owner: object, name: str, stage: str) -> None:
    """`owner.name` (a function or a coroutine function) charges the CPU spent inside it to `stage`."""
    f = getattr(owner, name)
    if inspect.iscoroutinefunction(f):

        async def timed(*a, **k):
            stages.enter(stage)
            try:
                return await f(*a, **k)
            finally:
                stages.leave(stage)
    else:

        def timed(*a, **k):
            stages.enter(stage)
            try:
                return f(*a, **k)
            finally:
                stages.leave(stage)

    setattr(owner, name, timed)


def threaded(stages: Stages, owner: object, name: str, stage: str, within: str) -> None:
    """`owner.name`, called in any thread while the window `within` runs, moves its thread's CPU to `stage`."""
    f = getattr(owner, name)

    def timed(*a, **k):
        t0 = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            stages.moved(stage, time.thread_time() - t0, within)

    setattr(owner, name, timed)


def probe(stages: Stages) -> None:
    """The stages' windows, where the backfill's code looks them up."""
    import dflash_assets.cli.shards as cli_shards
    import dflash_assets.defs.completions.assets as completions
    import dflash_assets.defs.prompts.assets as prompts
    import dflash_assets.defs.quality.assets as reports
    import dflash_assets.defs.quality.checks as checks
    import dflash_assets.defs.training.assets as training
    import dflash_assets.generation.commit as commit
    import dflash_assets.generation.engine as engine
    import dflash_assets.quality.planning.planner as planner
    import dflash_assets.quality.planning.window_plan as window_plan
    import dflash_assets.store.parts as parts
    from dflash_assets.generation.send import Dispatch

    for owner, name, stage in (
        (prompts, "build_prompt_shard", "prompt shards"),
        (completions, "source_turns", "prompt shards"),
        (engine, "plan_shard", "plan"),
        (Dispatch, "run", "send"),
        (commit.ShardOutput, "close", "commit"),
        (engine, "account", "commit"),
        (checks, "run_checks", "checks"),
        (checks, "judge_each_config", "checks"),
        (training, "run_checks", "checks"),
        (reports, "_report_and_histogram", "report"),
        (planner, "plan_caps", "report"),
        (window_plan, "window_plan", "report"),
        (training, "export_training_set", "export"),
    ):
        window(stages, owner, name, stage)
    window(stages, cli_shards, "run_shards", "other")  # the terminal's table stays `other`
    threaded(stages, parts.PartStore, "commit", "commit", "send")


def child(out: Path, profile: str | None, argv: list[str]) -> int:
    """Run `dflash <argv>` in this process with the stages probed; write their figures to `out`."""
    stages = Stages()
    trace = os.environ.get("DFLASH_BENCH_TRACE")
    threading.Thread(target=stages.sample, args=(Path(trace) if trace else None,), daemon=True).start()
    probe(stages)
    from dflash_assets.cli import main

    profiler = cProfile.Profile(time.process_time) if profile else None  # CPU, not wall: a shared machine
    if profiler:
        profiler.enable()
    try:
        status = main(argv)
    finally:
        if profiler:
            profiler.disable()
            profiler.dump_stats(profile)
        out.write_text(json.dumps(stages.figures()))
    return status


def verified(run: Path, n: int) -> dict:
    """Every row once: (prompt, turn) committed at most once, completions + rejects (source, preflight, server) +
    failed = prompts."""
    import duckdb

    con = duckdb.connect()
    rows, distinct = con.execute(
        f"SELECT count(*), count(DISTINCT (prompt_id, coalesce(turn, 0))) FROM "
        f"read_parquet('{run}/data/completions/**/*.parquet')"
    ).fetchone()
    rejects = con.execute(
        f"SELECT count(DISTINCT prompt_id) FROM read_parquet('{run}/data/rejects/**/*.parquet', union_by_name=true)"
    ).fetchone()[0]
    failures = list((run / "data").glob("failures/**/*.parquet"))
    failed = (
        con.execute(f"SELECT count(*) FROM read_parquet({[str(p) for p in failures]})").fetchone()[0] if failures else 0
    )
    if distinct != rows or rows + rejects + failed != n:
        raise SystemExit(
            f"rows not once: {rows} rows, {distinct} distinct, {rejects} rejected, {failed} failed, {n} prompts"
        )
    return {"rows": rows, "rejected": rejects, "failed": failed}


def backfill(tmp: Path, src: Path, n: int, urls: list[str], a: argparse.Namespace, profile: str | None) -> dict:
    """One `dflash backfill` of `src` on a fresh instance and data dir: its CPU, wall, peak RSS and stages."""
    from bench_streaming import attached

    run = tmp / f"run-{time.monotonic_ns()}"
    env = attached(run, urls)
    argv = [sys.executable, __file__, "--child", str(run / "stages.json")] + (["--profile", profile] if profile else [])
    argv += ["--", "backfill", "--prompts", str(src), "--shard-size", str(a.shard_size)]
    argv += ["--max-output-tokens", str(a.max_output_tokens)]
    t0 = time.monotonic()
    with (run / "terminal.txt").open("w") as terminal:
        proc = subprocess.Popen(argv, env=env, stdout=terminal, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    failed = None
    if os.waitstatus_to_exitcode(status) != 0:  # its figures are still shown, with the first cause
        lines = (run / "terminal.txt").read_text().splitlines()
        failed = next((line for line in lines if line.startswith("Failed")), lines[-1] if lines else "no output")
    stages = json.loads((run / "stages.json").read_text())
    cpu = usage.ru_utime + usage.ru_stime
    stages["cpu"]["other"] = cpu - sum(v for k, v in stages["cpu"].items() if k != "other")  # the rest of the tree
    # the process's own peak: the largest of its stages' (its ru_maxrss is that of the last stage only, highwater.py)
    peak = max(stages["peak"].values()) / 2**20
    figures = {"n": n, "cpu": cpu, "wall": wall, "rss_mb": peak, **verified(run, n)}
    figures |= {"stage_cpu": stages["cpu"], "stage_peak": stages["peak"], "failed_with": failed}
    figures["children_rss_mb"] = stages["children_peak"] / 2**20
    print(f"  {json.dumps(figures)}", flush=True)  # every figure of the run, as measured
    if not a.keep:
        subprocess.run(["rm", "-rf", str(run)], check=True)
    return figures


def table(n: int, runs: list[dict]) -> None:
    """The per-stage table of `runs` of `n` prompts: medians where there are several."""
    med = lambda values: statistics.median(values)  # noqa: E731
    rows = med([r["rows"] for r in runs])
    print(f"\n{n:,} prompts, {len(runs)} run(s){' (medians)' if len(runs) > 1 else ''}:")
    print(f"  {'stage':<14}{'CPU-s':>9}{'ms/completion':>15}{'peak RSS MB':>13}")
    for stage in STAGES:
        cpu = med([r["stage_cpu"].get(stage, 0.0) for r in runs])
        peak = med([r["stage_peak"].get(stage, 0) for r in runs]) / 2**20
        print(f"  {stage:<14}{cpu:>9.1f}{cpu / rows * 1e3:>15.3f}{peak:>13.0f}")
    cpu = med([r["cpu"] for r in runs])
    print(f"  {'total':<14}{cpu:>9.1f}{cpu / rows * 1e3:>15.3f}{med([r['rss_mb'] for r in runs]):>13.0f}")
    for r in runs:
        print(
            f"  run: {r['cpu']:.1f} CPU-s, {r['cpu'] / r['rows'] * 1e3:.3f} ms a completion, {r['wall']:.0f} s wall, "
            f"peak RSS {r['rss_mb']:.0f} MB (of its children {r['children_rss_mb']:.0f}); rows {r['rows']:,} once, rejected {r['rejected']:,}, "
            f"failed {r['failed']:,}" + (f"; THE BACKFILL FAILED: {r['failed_with']}" if r["failed_with"] else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="100000", help="comma-separated prompt counts")
    parser.add_argument("--runs", type=int, default=1, help="runs of each count (medians)")
    parser.add_argument("--servers", type=int, default=7)
    parser.add_argument("--shard-size", type=int, default=10_000)
    parser.add_argument("--max-output-tokens", type=int, default=4096)
    parser.add_argument(
        "--emulator-args",
        default="--reasoning-parser qwen3 --length-median 200 --length-sigma 0.8 --length-max 2000",
        help="each emulator's flags (instant decode is its default); the default: answers of median 200 tokens",
    )
    parser.add_argument("--profile", help="cProfile the (first) backfill into this file and print its top functions")
    parser.add_argument(
        "--keep", action="store_true", help="keep each run's instance, data dir and source in a folder it prints"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        sys.exit(child(Path(a.child), a.profile, a.argv))
    from bench_repeats import write_source

    from dflash_assets.emulator.process import start_emulator

    with ExitStack() as emulators:
        if a.keep:  # the runs outlive the benchmark: their folder is printed
            tmp = tempfile.mkdtemp(prefix="bench-scale-", dir=os.environ.get("TMPDIR"))
            print(f"runs kept in {tmp}", flush=True)
        else:
            tmp = emulators.enter_context(tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")))
        flags = a.emulator_args.split()
        servers = [emulators.enter_context(start_emulator(flags)) for _ in range(a.servers)]
        print(
            f"dflash backfill on {a.servers} emulated servers ({a.emulator_args}), shards of {a.shard_size:,}, "
            f"cap {a.max_output_tokens}; CPU of the backfill's process tree, the emulators apart",
            flush=True,
        )
        for n in (int(x) for x in a.prompts.split(",")):
            src = Path(tmp) / f"prompts{n}.jsonl"
            write_source(src, n)
            runs = []
            for i in range(a.runs):
                runs.append(backfill(Path(tmp), src, n, [s.url for s in servers], a, a.profile if i == 0 else None))
                print(f"  {n:,}: run {i + 1}: {runs[-1]['cpu']:.1f} CPU-s, {runs[-1]['wall']:.0f} s", flush=True)
            table(n, runs)
    if a.profile:
        pstats.Stats(a.profile).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
