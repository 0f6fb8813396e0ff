"""regenerate: all_turns against the emulator: fleet utilisation with 3-turn conversations, and the share of
prompt tokens served from the servers' prefix cache with and without same-server routing of follow-up turns.

    uv run python benchmarks/bench_all_turns.py            # 600 conversations (a few minutes on 2 cores)
    uv run python benchmarks/bench_all_turns.py --quick    # 240 conversations

The setup of bench_engine.py's utilisation figure: 2 servers x 16 slots, 1500 tok/s per request, heavy-tailed
lengths (median 300, sigma 1.0, max 3000), cap 3000; here each prompt is a 3-turn conversation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import duckdb
from bench_engine import busy_slot_seconds, stats

from dflash_assets.emulator.process import start_emulator
from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shards
from dflash_assets.generation.request import GenerationRun
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.settings import DispatchSettings, GenerationSettings

FLAGS = [
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
    "--enable-cache-report",
    "--prefill-tokens-per-s",
    "50000",
]


def write_source(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            turns = [{"from": "system", "value": f"You are assistant number {i % 5}."}]
            for k in range(1, 4):
                turns += [
                    {"from": "human", "value": f"Conversation {i}, question {k}: tell me more about part {k}."},
                    {"from": "gpt", "value": "a source answer, replaced"},
                ]
            f.write(json.dumps({"id": f"c{i:06d}", "conversations": turns}) + "\n")


async def run(data: Path, src: Path, shards: int, per_shard: int, urls: list[str], imbalance: float):
    async with connected(urls) as fleet:
        for k in range(shards):
            await build_prompt_shard(src, k, f"{k:05d}", per_shard, data, fleet, {"enable_thinking": True})
        start = time.monotonic()
        runs = await generate_shards(
            data,
            [f"{k:05d}" for k in range(shards)],
            fleet,
            GenerationRun(
                GenerationSettings(max_output_tokens=3000, cap_policy="fixed", regenerate="all_turns"),
                DispatchSettings(load_sample_s=0, progress_seconds=1e9, same_server_max_imbalance=imbalance),
            ),
            log=lambda m: None,
        )
        return start, time.monotonic(), runs


def measure(conversations: int, imbalance: float, label: str) -> None:
    shards = 4
    per_shard = conversations // shards
    with tempfile.TemporaryDirectory() as tmp, start_emulator(FLAGS) as a, start_emulator(FLAGS) as b:
        urls, data, src = [a.url, b.url], Path(tmp) / "data", Path(tmp) / "p.jsonl"
        write_source(src, shards * per_shard)
        start, end, runs = asyncio.run(run(data, src, shards, per_shard, urls, imbalance))
        new_until = max(r.last_sent_at for r in runs)  # the last new conversation handed to the dispatcher
        turns_until = max(max(r.last_sent_at, r.follow_up_sent_at or 0) for r in runs)  # the last turn of any
        timelines = [(rank["timeline"], rank["max_running_requests"]) for u in urls for rank in stats(u)["ranks"]]

        def share(until: float) -> float:
            busy = sum(busy_slot_seconds(t, start, until) for t, _ in timelines)
            return busy / sum(slots * (until - start) for _, slots in timelines)

        prompt, cached, rows = duckdb.sql(
            f"select sum(prompt_tokens), sum(cached_tokens), count(*) from read_parquet("
            f"'{data}/completions/**/*.parquet')"
        ).fetchall()[0]
        follow = duckdb.sql(
            f"select sum(cached_tokens) / sum(prompt_tokens) from read_parquet('{data}/completions/**/*.parquet') "
            f"where turn > 1"
        ).fetchall()[0][0]
        stayed = duckdb.sql(
            f"select avg(same::int) from (select turn, server_url = lag(server_url) over (partition by prompt_id "
            f"order by turn) as same from read_parquet('{data}/completions/**/*.parquet')) where turn > 1"
        ).fetchall()[0][0]
        print(
            f"{label}: {rows} turns of {shards * per_shard} conversations in {end - start:.1f} s; "
            f"{stayed:.0%} of follow-up turns on the server of the turn before"
        )
        print(f"  fleet utilisation while new conversations were waiting: {share(new_until):.2%}   (goal >= 95%)")
        print(f"  fleet utilisation until the last turn was sent: {share(turns_until):.2%}")
        print(
            f"  prompt tokens served from the prefix cache: {cached / prompt:.2%} of {prompt:,} "
            f"(follow-up turns: {follow:.2%}); prefilled {prompt - cached:,}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    n = 240 if parser.parse_args().quick else 600
    print(f"all_turns: {n} conversations of 3 turns, 2 servers x 16 slots, heavy-tailed lengths, cap 3000")
    measure(n, 0.25, "follow-ups to the same server (imbalance <= 0.25)")
    measure(n, -1.0, "follow-ups to the least-loaded server")


if __name__ == "__main__":
    main()
