"""Generation engine benchmarks against the emulator: fleet utilisation, client ceiling, resume scan, memory.

    uv run python benchmarks/bench_engine.py            # everything (a few minutes on 2 cores)
    uv run python benchmarks/bench_engine.py --quick    # smaller sizes, same figures
    uv run python benchmarks/bench_engine.py utilisation ceiling resume memory

Prints one table; each figure beside its goal. Timings are medians of repeated runs where a run is short.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute

from dflash_assets.emulator.process import start_emulator
from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shards
from dflash_assets.generation.plan import plan_remaining
from dflash_assets.generation.request import GenerationRun
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.settings import DispatchSettings, GenerationSettings
from dflash_assets.store.schema import COMPLETION_SCHEMA, PROMPT_SCHEMA
from dflash_assets.store.storage import write_atomic
from dflash_assets.store.stores import committed_ids, completion_store, prompt_store

RESULTS: list[tuple[str, str, str]] = []


def report(name: str, value: str, goal: str) -> None:
    RESULTS.append((name, value, goal))
    print(f"  {name}: {value}   (goal {goal})", flush=True)


def write_source(path: Path, n: int, offset: int = 0) -> None:
    with open(path, "w") as f:
        for i in range(offset, offset + n):
            f.write(json.dumps({"id": f"b{i:07d}", "prompt": f"Benchmark prompt number {i}: say something."}) + "\n")


async def build(src: Path, shard_size: int, shards: int, data: Path, urls: list[str]) -> None:
    async with connected(urls) as fleet:
        for k in range(shards):
            await build_prompt_shard(src, k, f"{k:05d}", shard_size, data, fleet, {"enable_thinking": True})


async def generate(data: Path, shards: str | list[str], urls: list[str], cap: int, **settings):
    async with connected(urls) as fleet:
        runs = await generate_shards(
            data,
            [shards] if isinstance(shards, str) else shards,
            fleet,
            GenerationRun(
                GenerationSettings(max_output_tokens=cap, cap_policy="fixed"),
                DispatchSettings(load_sample_s=0, progress_seconds=1e9, **settings),
            ),
            log=lambda m: None,
        )
        return runs[0] if isinstance(shards, str) else runs


def stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/_emulator/stats", timeout=10) as r:
        return json.load(r)


def busy_slot_seconds(timeline: list, t0: float, t1: float) -> float:
    """Integral of the running-request count over [t0, t1] (a step function given at its changes)."""
    total = 0.0
    for (t, running), (t_next, _) in zip(timeline, timeline[1:] + [[float("inf"), 0]]):
        lo, hi = max(t, t0), min(t_next, t1)
        if hi > lo:
            total += running * (hi - lo)
    return total


# ---- 1. fleet utilisation over a multi-partition run ---------------------------------------------------------


def utilisation(quick: bool) -> None:
    shards, per_shard = (4, 120) if quick else (6, 200)
    flags = [
        "--reasoning-parser",
        "qwen3",
        "--decode-tokens-per-s",
        "1500",
        "--max-running-requests",
        "16",
        "--length-median",
        "300",
        "--length-sigma",
        "1.0",
        "--length-max",
        "3000",
    ]
    print(f"utilisation: {shards} shards x {per_shard} prompts, 2 servers x 16 slots, heavy-tailed lengths")
    modes = (
        ("one shard per run, one run at a time", 1, 1),
        ("one shard per run, pool of 2 runs", 2, 1),
        (f"{shards} shards streamed in one run", 1, shards),
    )
    for mode, pool, per_run in modes:
        with tempfile.TemporaryDirectory() as tmp, start_emulator(flags) as a, start_emulator(flags) as b:
            urls, data = [a.url, b.url], Path(tmp) / "data"
            write_source(Path(tmp) / "p.jsonl", shards * per_shard)
            asyncio.run(build(Path(tmp) / "p.jsonl", per_shard, shards, data, urls))
            groups = [[f"{k:05d}" for k in range(i, min(i + per_run, shards))] for i in range(0, shards, per_run)]

            async def runs():
                gate = asyncio.Semaphore(pool)  # what the sglang_fleet pool does to Dagster runs  # noqa: B023 (awaited in this iteration)

                async def one(group: list[str]):
                    async with gate:
                        return await generate(data, group, urls, 3000)  # noqa: B023 (awaited in this iteration)

                start = time.monotonic()
                done = await asyncio.gather(*(one(g) for g in groups))  # noqa: B023 (awaited in this iteration)
                return start, time.monotonic(), [r for group in done for r in group]

            start, end, done = asyncio.run(runs())
            # from the first prompt sent: before it, the first run only connects, and connecting waits for each
            # server's /health, at least a second as on SGLang 0.5.23 (the later runs' connects stay counted:
            # they are what one shard per run costs)
            start = min(r.first_sent_at for r in done)
            pending_until = max(r.last_sent_at for r in done)  # work was waiting to be sent until then
            busy = avail = 0.0
            for url in urls:
                for rank in stats(url)["ranks"]:
                    busy += busy_slot_seconds(rank["timeline"], start, pending_until)
                    avail += rank["max_running_requests"] * (pending_until - start)
            report(
                f"fleet utilisation while work pending, {mode}",
                f"{busy / avail:.2%} (all shards done in {end - start:.1f} s)",
                ">= 98%",
            )
            report(
                f"idle slot-seconds while work pending, {mode}",
                f"{avail - busy:.1f} of {avail:.1f} ({(avail - busy) / avail:.2%})",
                "<= 1% of the total",
            )


# ---- 2. client ceiling: ~16 KB replies, zero decode time -----------------------------------------------------


def ceiling(quick: bool) -> None:
    n = 2000 if quick else 6000
    # every prompt is distinct, so the emulator's prefix cache could only cost it CPU: off, so that the figure
    # stays the client's ceiling and not the emulator's
    flags = [
        "--reasoning-parser",
        "qwen3",
        "--length-median",
        "2700",
        "--length-sigma",
        "0.01",
        "--max-running-requests",
        "256",
        "--disable-radix-cache",
    ]
    print(f"client ceiling: {n} completions of ~16 KB from an emulator with zero decode time")
    with tempfile.TemporaryDirectory() as tmp, start_emulator(flags) as a:
        data = Path(tmp) / "data"
        write_source(Path(tmp) / "p.jsonl", n)
        asyncio.run(build(Path(tmp) / "p.jsonl", n, 1, data, [a.url]))
        rates, overall = [], []
        for cap in (4096, 4097, 4098):  # three configs: three full runs over the same shard
            t0 = time.monotonic()
            run = asyncio.run(generate(data, "00000", [a.url], cap, max_in_flight_per_server=64, commit_rows=1024))
            rates.append(run.completed / (run.answered_at - run.first_sent_at))  # sending to last answer
            overall.append(run.completed / (time.monotonic() - t0))  # plus planning, the final commit, compaction
        table = completion_store(data, "00000").read(["content", "reasoning_content"])
        size = (
            pa.compute.sum(pa.compute.utf8_length(table["content"])).as_py()
            + pa.compute.sum(pa.compute.utf8_length(table["reasoning_content"])).as_py()
        ) / table.num_rows
        report(
            "client ceiling (completions/s while dispatching, median of 3)",
            f"{statistics.median(rates):,.0f} (reply ~{size / 1024:.1f} KB of content + reasoning; "
            f"{statistics.median(overall):,.0f}/s counting planning, commits and compaction)",
            ">= 2,000/s",
        )


# ---- 3. resume scan with 1,000,000 committed rows ------------------------------------------------------------


def resume(quick: bool) -> None:
    n = 200_000 if quick else 1_000_000
    print(f"resume scan: {n:,} committed rows in one shard")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        ids = [f"r{i:08d}" for i in range(n)]
        write_atomic(
            pa.table(
                {
                    "prompt_id": ids,
                    "shard": ["00000"] * n,
                    "line": list(range(1, n + 1)),
                    "source": ["bench"] * n,
                    "messages_json": ['[{"content":"x","role":"user"}]'] * n,
                    "prompt_tokens": [20] * n,
                    "template_kwargs_json": ['{"enable_thinking":true}'] * n,
                },
                schema=PROMPT_SCHEMA,
            ),
            prompt_store(data, "00000").dir / "prompts.parquet",
        )
        store = completion_store(data, "00000")
        now = datetime.now(UTC)
        step = n // 100
        for p in range(100):  # 100 committed parts, as a long run leaves them before compaction
            chunk = ids[p * step : (p + 1) * step] if p < 99 else ids[99 * step :]
            cols = {f.name: pa.nulls(len(chunk), f.type) for f in COMPLETION_SCHEMA}
            cols.update(
                prompt_id=pa.array(chunk),
                config_hash=pa.array(["c0ffee"] * len(chunk)),
                created_at=pa.array([now] * len(chunk), COMPLETION_SCHEMA.field("created_at").type),
            )
            write_atomic(pa.table(cols, schema=COMPLETION_SCHEMA), store.dir / f"part-{p:05d}.parquet")
        times = []
        for _ in range(5):
            t = time.perf_counter()
            store.recover()
            done = committed_ids(store, "c0ffee")
            total, todo = plan_remaining(prompt_store(data, "00000"), done)
            times.append(time.perf_counter() - t)
        assert (total, len(todo), len(done)) == (n, 0, n)
        report(f"resume scan, {n:,} committed rows (median of 5)", f"{statistics.median(times):.2f} s", "<= 3 s")


# ---- 4. peak memory: prompts per shard -----------------------------------------------------------------------

MEASURE = """
import sys
sys.argv = ["dflash", "generate", "--shard", "00000", "--urls", sys.argv[1], "--data-dir", sys.argv[2],
            "--max-output-tokens", "256", "--commit-rows", "2048"]
from dflash_assets.cli import main
rc = main(sys.argv[1:])
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across exec
print("MAXRSS_KB", [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0])
sys.exit(rc)
"""


def memory(quick: bool) -> None:
    sizes = (2_000, 20_000) if quick else (10_000, 100_000)
    flags = [
        "--reasoning-parser",
        "qwen3",
        "--length-median",
        "40",
        "--length-sigma",
        "0.3",
        "--max-running-requests",
        "256",
    ]
    print(f"peak RSS of the generating process: {sizes[0]:,} vs {sizes[1]:,} prompts in one shard")
    rss = {}
    with start_emulator(flags) as a:
        for n in sizes:
            with tempfile.TemporaryDirectory() as tmp:
                data = Path(tmp) / "data"
                write_source(Path(tmp) / "p.jsonl", n)
                asyncio.run(build(Path(tmp) / "p.jsonl", n, 1, data, [a.url]))
                out = subprocess.run(
                    [sys.executable, "-c", MEASURE, a.url, str(data)], capture_output=True, text=True, timeout=1800
                )
                line = [x for x in out.stdout.splitlines() if x.startswith("MAXRSS_KB")]
                assert line, out.stdout + out.stderr
                rss[n] = int(line[0].split()[1]) / 1024
    (small, big) = sizes
    report(
        f"peak RSS, {small:,} vs {big:,} prompts per shard",
        f"{rss[small]:.0f} MB vs {rss[big]:.0f} MB (x{rss[big] / rss[small]:.2f} for x{big // small} prompts)",
        "flat, <= 500 MB",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="*", default=["utilisation", "ceiling", "resume", "memory"])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for name in args.which:
        globals()[name](args.quick)
    print("\n| benchmark | measured | goal |\n|---|---|---|")
    for row in RESULTS:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
