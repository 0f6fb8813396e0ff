"""Streaming benchmarks against the emulator: runaways stopped early, stalls noticed, the client's CPU.

    uv run python benchmarks/bench_streaming.py                 # everything (a few minutes on 2 cores)
    uv run python benchmarks/bench_streaming.py runaways stall cpu false_positives

- runaways: --loop-share 0.08 at cap 32768 (a fixed cap) and at 4096 (the window policy's): decoded tokens with
  early stopping and without (today: a blocking POST that decodes every loop to the cap), the share of the
  runaway rows stopped, and what the runaways cost against today (goal <= 10%).
- stall: a stream that goes silent after its first tokens: seconds from the stall to the retry, against today's
  wait (request_timeout_s); a run with such stalls: rows lost and rows committed twice (goal 0).
- cpu: the client's CPU per million streamed tokens, blocking and streamed, at --stream-interval 1, 4, 16, 32, and
  the cores a 7-GPU fleet (7 servers x 3,500 tok/s = 24,500 tok/s) needs (goal <= 0.5).
- backfill: `dflash backfill` of 20,000 and 100,000 prompts streamed and `--no-stream`, side by side (alternating,
  twice each), on two emulated servers with instant decode and short answers at the emulator's default event size:
  the CPU seconds of the dflash process (the figure to compare on a shared machine), completions/s and peak RSS
  (goal: streamed within 10% of --no-stream). Not in the default sections (about 25 minutes on 2 cores).
- paced: streams at --stream-interval 1 that decode at 40 tokens/s a request (each token an event of its own in
  time): the client's CPU and socket reads per request, its reads gathered a tick at a time and not. Not in the
  default sections (about four minutes).
- false_positives: honest long rows (no loops, cap 32768): the share the runaway rule stops early (expected 0).
Each section prints its figures beside its goal.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import duckdb

from dflash_assets.emulator.process import start_emulator
from dflash_assets.fleet.client import ServerClient, ServerError
from dflash_assets.fleet.fleet import connected, open_session, run
from dflash_assets.fleet.stream import GATHER_S, Gather, GatheredConnector, GatheredHandler, Watch
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.request import chat_body
from dflash_assets.generation.send import watch_of
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality.tables import register_runaway, runaway_sql
from dflash_assets.settings import DispatchSettings, FleetSettings, GenerationSettings, RunawaySettings, ServerSettings

FLEET_TOK_S = 7 * 3500
BASE = [
    "--reasoning-parser",
    "qwen3",
    "--sampling",
    "per-prompt",
    "--random-seed",
    "1",
    "--native-context-length",
    "65536",
]  # room for a 32768 cap


def say(name: str, value: str, goal: str = "") -> None:
    print(f"  {name}: {value}" + (f"   (goal {goal})" if goal else ""), flush=True)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def shard_run(data: Path, urls: list[str], n: int, cap: int, settings: DispatchSettings):
    src = data.parent / "prompts.jsonl"
    if not src.exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(
            "".join(
                json.dumps({"id": f"b{i:05d}", "prompt": f"Benchmark problem {i}: solve it."}) + "\n" for i in range(n)
            )
        )
    async with connected(urls) as fleet:
        await build_prompt_shard(src, 0, "00000", n, data, fleet, {"enable_thinking": True})
        return await generate_shard(
            data,
            "00000",
            fleet,
            GenerationSettings(max_output_tokens=cap, cap_policy="fixed"),
            settings,
            log=lambda m: None,
        )


def rows(data: Path) -> list[tuple]:
    con = duckdb.connect()
    register_runaway(con, RunawaySettings())
    return con.execute(
        f"SELECT prompt_id, finish_reason, completion_tokens, {runaway_sql(RunawaySettings())} FROM "
        f"read_parquet('{data}/completions/**/*.parquet') ORDER BY prompt_id"
    ).fetchall()


def runaways(tmp: Path, n: int) -> None:
    print("runaways (--loop-share 0.08): decoded tokens with early stopping and without", flush=True)
    for cap, median in ((32768, 3000), (4096, 1500)):
        flags = BASE + [
            "--loop-share",
            "0.08",
            "--length-max",
            str(4 * cap),
            "--length-median",
            str(median),
            "--length-sigma",
            "0.8",
            "--stream-interval",
            "16",
        ]
        with start_emulator(flags) as emu:
            today_dir, early_dir = tmp / f"today{cap}" / "data", tmp / f"early{cap}" / "data"
            t0 = time.monotonic()
            asyncio.run(shard_run(today_dir, [emu.url], n, cap, DispatchSettings(stream=False, load_sample_s=0)))
            t1 = time.monotonic()
            asyncio.run(shard_run(early_dir, [emu.url], n, cap, DispatchSettings(load_sample_s=0)))
            t2 = time.monotonic()
        today, early = rows(today_dir), rows(early_dir)
        loops = {r[0] for r in today if r[3]}
        stopped = {r[0] for r in early if r[1] == "runaway"}
        cost_today = sum(r[2] for r in today if r[0] in loops)
        cost_early = sum(r[2] for r in early if r[0] in loops)
        all_today, all_early = sum(r[2] for r in today), sum(r[2] for r in early)
        print(f" cap {cap:,} ({n} prompts, honest median {median}; runs {t1 - t0:.0f}s / {t2 - t1:.0f}s):")
        say("runaway rows (the checks, today)", f"{len(loops)} of {n} ({len(loops) / n:.1%})")
        say(
            "runaway rows stopped early",
            f"{len(stopped & loops)} of {len(loops)} "
            f"({len(stopped & loops) / max(len(loops), 1):.0%}); stopped that are not runaways: {len(stopped - loops)}",
            "all, and none other",
        )
        say(
            "decoded tokens, all rows",
            f"today {all_today:,}, early stopping {all_early:,} ({1 - all_early / all_today:.1%} fewer)",
        )
        say(
            "decoded tokens, runaway rows",
            f"today {cost_today:,}, early stopping {cost_early:,}: {cost_early / max(cost_today, 1):.1%} of today",
            "<= 10%",
        )


def stall(tmp: Path, n: int, stall_timeout_s: float, request_timeout_s: float) -> None:
    print(f"stall (a stream silent after its first 32 tokens, stall_timeout_s {stall_timeout_s:g})", flush=True)
    after, rate = 32, 2000.0
    flags = BASE + ["--length-median", "300", "--length-sigma", "0.4", "--decode-tokens-per-s", str(rate)]
    fault = ["--fault-stall-seconds", "3600", "--fault-stall-after-tokens", str(after)]
    body = chat_body(GenerationSettings(max_output_tokens=1024), "m", [{"role": "user", "content": "a stalled one"}])

    async def abandoned(url: str, watch: Watch | None, timeout: float) -> float:
        async with open_session() as session:
            client = ServerClient(session, url, request_timeout_s=timeout)
            t0 = time.monotonic()
            try:
                await client.chat(body, watch)
            except ServerError:
                pass
            return time.monotonic() - t0 - after / rate  # less the decode of the tokens before the stall

    with start_emulator(flags + fault) as emu:
        streamed = [asyncio.run(abandoned(emu.url, Watch(stall_timeout_s=stall_timeout_s), 3600)) for _ in range(3)]
        blocking = asyncio.run(abandoned(emu.url, None, request_timeout_s))
    say(
        "stall -> retry, streamed",
        f"{statistics.median(streamed):.1f}s (median of 3; the timer fires between 1 "
        f"and {1 + 0.25:.2f} x stall_timeout_s)",
        f"~stall_timeout_s ({DispatchSettings().stall_timeout_s:g}s by default)",
    )
    say(
        "stall -> retry, today (blocking)",
        f"{blocking:.1f}s at request_timeout_s {request_timeout_s:g}: the "
        f"whole request_timeout_s, {FleetSettings().request_timeout_s:g}s by default",
    )
    with start_emulator(flags + fault + ["--fault-stall-next", "4"]) as bad, start_emulator(flags) as good:
        data = tmp / "stall" / "data"
        t0 = time.monotonic()
        run = asyncio.run(
            shard_run(
                data, [bad.url, good.url], n, 1024, DispatchSettings(stall_timeout_s=stall_timeout_s, load_sample_s=0)
            )
        )
        elapsed = time.monotonic() - t0
    committed = duckdb.sql(f"SELECT prompt_id, attempt FROM read_parquet('{data}/completions/**/*.parquet')").fetchall()
    ids = [r[0] for r in committed]
    say(
        "run with 4 mid-stream stalls",
        f"{n} prompts, {len(set(ids))} committed, {n - len(set(ids))} lost, "
        f"{len(ids) - len(set(ids))} twice, {sum(a > 1 for _, a in committed)} retried, {run.failed} failed, "
        f"{elapsed:.0f}s",
        "0 lost, 0 twice",
    )


def cpu(n: int, intervals: list[int]) -> dict[float, int]:
    print("client CPU per million streamed tokens (chat, 32 in flight, instant decode)", flush=True)
    body = GenerationSettings(max_output_tokens=4096)

    async def measure(url: str, watch: Watch | None) -> tuple[int, float]:
        async with open_session() as session:
            client, gate, tokens = ServerClient(session, url), asyncio.Semaphore(32), 0

            async def one(i: int) -> None:
                nonlocal tokens
                async with gate:
                    resp = await client.chat(chat_body(body, "m", [{"role": "user", "content": f"cpu {i}"}]), watch)
                    tokens += resp.completion_tokens

            c0 = cpu_s()
            await asyncio.gather(*(one(i) for i in range(n)))
            return tokens, cpu_s() - c0

    fits: dict[float, int] = {}
    for interval in intervals:
        flags = BASE + [
            "--stream-interval",
            str(interval),
            "--length-median",
            "2000",
            "--length-sigma",
            "0.3",
            "--max-running-requests",
            "64",
        ]
        with start_emulator(flags) as emu:
            figures = {}
            for name, watch in (
                ("blocking", None),
                ("streamed", watch_of(DispatchSettings(runaway_check_tokens=0))),
                ("streamed + runaway check", watch_of(DispatchSettings())),
            ):
                if name == "blocking" and interval != intervals[0]:
                    continue  # the stream interval does not change a blocking request
                tokens, used = asyncio.run(measure(emu.url, watch))
                figures[name] = used / tokens * 1e6
                cores = used / tokens * FLEET_TOK_S
                say(
                    f"--stream-interval {interval}, {name}",
                    f"{figures[name]:.1f} CPU s per M tokens: "
                    f"{cores:.2f} cores at {FLEET_TOK_S:,} tok/s ({tokens:,} tokens)",
                    "<= 0.5 core",
                )
            watched = figures["streamed + runaway check"] * FLEET_TOK_S / 1e6
            fits.update({budget: interval for budget in (0.5, 0.25) if watched <= budget and budget not in fits})
    say("smallest --stream-interval whose watched stream fits 0.5 core", str(fits.get(0.5, "none")))
    say(
        "... and leaves half of it to the rest of the client (<= 0.25 core)",
        str(fits.get(0.25, "none")),
        f"what launch mode sets: --stream-interval {ServerSettings().stream_interval}",
    )
    return fits


def paced(n: int, tokens_per_s: float) -> None:
    """Streams at --stream-interval 1 that decode at a real pace (`tokens_per_s` a request), so each token is an
    event on its own in time: the client's CPU and socket reads per request with its reads gathered a tick at a
    time (fleet/stream.Gather, GATHER_S) and without (a tick of 0)."""
    print(
        f"streams paced at {tokens_per_s:g} tokens/s a request, --stream-interval 1 (64 in flight, {n} requests, "
        f"answers median 200 tokens): reads gathered every {GATHER_S:g}s and not",
        flush=True,
    )
    body = GenerationSettings(max_output_tokens=1024)
    flags = SHORT + ["--stream-interval", "1", "--decode-tokens-per-s", str(tokens_per_s), "--max-running-requests"]
    flags += ["64"]

    class Reads(GatheredHandler):
        count = 0

        def data_received(self, data: bytes) -> None:
            Reads.count += 1
            super().data_received(data)

    async def measure(url: str, gather_s: float) -> tuple[float, float, int]:
        connector = GatheredConnector(gather_s=gather_s)
        connector._factory = functools.partial(Reads, loop=connector._loop, gather=Gather(gather_s))  # type: ignore
        async with aiohttp.ClientSession(connector=connector) as session:
            client, gate, tokens = ServerClient(session, url), asyncio.Semaphore(64), 0

            async def one(i: int) -> None:
                nonlocal tokens
                async with gate:
                    messages = [{"role": "user", "content": f"paced {i}"}]
                    resp = await client.chat(chat_body(body, "m", messages, True), watch_of(DispatchSettings()))
                    tokens += resp.completion_tokens

            Reads.count, c0 = 0, cpu_s()
            await asyncio.gather(*(one(i) for i in range(n)))
            return (cpu_s() - c0) / n * 1e3, Reads.count / n, tokens

    with start_emulator(flags) as emu:
        for gather_s in (0.0, GATHER_S, 0.0, GATHER_S):
            ms, reads, tokens = run(measure(emu.url, gather_s))
            say(
                f"gathered every {gather_s:g}s" if gather_s else "not gathered",
                f"{ms:.2f} ms of client CPU, {reads:.0f} socket reads a request ({tokens / n:.0f} tokens)",
            )


# short answers, instant decode: the client's cost per request is what is measured, not the decode
SHORT = ["--reasoning-parser", "qwen3", "--length-median", "200", "--length-sigma", "0.8", "--length-max", "2000"]


def attached(run: Path, urls: list[str]) -> dict:
    """The environment of a `dflash` command on a fresh instance and data dir under `run`, attached to `urls`."""
    (run / "home").mkdir(parents=True)
    return os.environ | {
        "DAGSTER_HOME": str(run / "home"),
        "DFLASH_DATA_DIR": str(run / "data"),
        "DFLASH_FLEET_MODE": "attach",
        "DFLASH_FLEET_URLS": ",".join(urls),
    }


def backfill_once(tmp: Path, src: Path, urls: list[str], streamed: bool, shard_size: int) -> dict:
    """One `dflash backfill` of `src` in attach mode on a fresh data dir and instance: its own CPU, wall, peak RSS."""
    run = tmp / f"backfill-{time.monotonic_ns()}"
    env = attached(run, urls)
    argv = [sys.executable, "-m", "dflash_assets.cli", "backfill", "--prompts", str(src), "--shard-size"]
    argv += [str(shard_size)] + ([] if streamed else ["--no-stream"])
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"dflash backfill failed: {proc.stderr.read()[-2000:]}")
    rows = duckdb.sql(f"SELECT count(*) FROM read_parquet('{run}/data/completions/**/*.parquet')").fetchall()[0][0]
    shutil.rmtree(run)
    return {"cpu": usage.ru_utime + usage.ru_stime, "wall": wall, "rss_mb": usage.ru_maxrss / 1024, "rows": rows}


def backfill(tmp: Path, sizes: list[int], shard_size: int, repeats: int) -> None:
    print(
        f"dflash backfill, streamed beside --no-stream (2 emulated servers, instant decode, answers median 200 "
        f"tokens, the default event size; shards of {shard_size:,}; alternating, {repeats} each)",
        flush=True,
    )
    with start_emulator(SHORT) as one, start_emulator(SHORT) as two:
        for n in sizes:
            src = tmp / f"backfill{n}.jsonl"
            src.write_text(
                "".join(
                    json.dumps({"id": f"p{i:07d}", "prompt": f"Prompt {i}: item {i % 97}."}) + "\n" for i in range(n)
                )
            )
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for _ in range(repeats):
                for streamed in (False, True):
                    r = backfill_once(tmp, src, [one.url, two.url], streamed, shard_size)
                    assert r["rows"] == n, r
                    runs[streamed].append(r)
            for streamed in (False, True):
                name = "streamed" if streamed else "--no-stream"
                each = runs[streamed]
                say(
                    f"{n:,} prompts, {name}",
                    ", ".join(f"{r['cpu']:.1f}" for r in each)
                    + " CPU-s ("
                    + ", ".join(f"{n / r['wall']:.0f}" for r in each)
                    + f" completions/s; peak RSS {max(r['rss_mb'] for r in each):.0f} MB)",
                )
            block = statistics.mean(r["cpu"] for r in runs[False])
            stream = statistics.mean(r["cpu"] for r in runs[True])
            say(f"{n:,} prompts, streamed / --no-stream CPU", f"{stream / block:.2f}x", "<= 1.10x")
            # each streamed run against the --no-stream run just before it: a shared machine's drift cancels
            pairs = [s["cpu"] / b["cpu"] for b, s in zip(runs[False], runs[True], strict=True)]
            say(
                f"{n:,} prompts, each pair",
                ", ".join(f"{p:.2f}x" for p in pairs) + f" (median {statistics.median(pairs):.2f}x)",
            )


def false_positives(tmp: Path, n: int) -> None:
    print("false positives: honest long rows (no loops, cap 32768, median 6000)", flush=True)
    flags = BASE + [
        "--length-median",
        "6000",
        "--length-sigma",
        "0.6",
        "--length-max",
        "60000",
        "--stream-interval",
        "16",
    ]
    with start_emulator(flags) as emu:
        data = tmp / "honest" / "data"
        asyncio.run(shard_run(data, [emu.url], n, 32768, DispatchSettings(load_sample_s=0)))
    got = rows(data)
    stopped = sum(r[1] == "runaway" for r in got)
    tokens = sum(r[2] for r in got)
    checks = tokens // DispatchSettings().runaway_check_tokens
    say(
        "stopped early",
        f"{stopped} of {len(got)} rows ({stopped / len(got):.1%}) over {tokens:,} tokens (~{checks:,} checks)",
        "0",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", default=["runaways", "stall", "cpu", "false_positives"])
    parser.add_argument("--prompts", type=int, default=300, help="prompts per runaway run")
    parser.add_argument("--stall-timeout-s", type=float, default=10.0)
    parser.add_argument("--request-timeout-s", type=float, default=20.0, help="today's wait, measured short")
    parser.add_argument("--cpu-requests", type=int, default=60)
    parser.add_argument("--intervals", default="1,4,16,32")
    parser.add_argument("--backfill-prompts", default="20000,100000")
    parser.add_argument("--backfill-shard-size", type=int, default=2500)
    parser.add_argument("--backfill-repeats", type=int, default=2)
    parser.add_argument("--paced-requests", type=int, default=400)
    parser.add_argument("--paced-tokens-per-s", type=float, default=40.0)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for section in a.sections:
            t0 = time.monotonic()
            if section == "runaways":
                runaways(tmp, a.prompts)
            elif section == "stall":
                stall(tmp, 60, a.stall_timeout_s, a.request_timeout_s)
            elif section == "cpu":
                cpu(a.cpu_requests, [int(i) for i in a.intervals.split(",")])
            elif section == "backfill":
                sizes = [int(n) for n in a.backfill_prompts.split(",")]
                backfill(tmp, sizes, a.backfill_shard_size, a.backfill_repeats)
            elif section == "paced":
                paced(a.paced_requests, a.paced_tokens_per_s)
            elif section == "false_positives":
                false_positives(tmp, 100)
            else:
                parser.error(f"unknown section {section!r}")
            print(f"  ({section}: {time.monotonic() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
