"""Requests a fixed-cap all_turns run no longer sends: a later turn whose history already fills the trainer's window
ends its conversation there (generation/turns.py fills_before), with no request for it or the turns after it.

    uv run python benchmarks/bench_turn_window.py                       # the demo's prompts, cap 4096, L 2048 and 4096

The demo's prompts, built and generated all_turns at a fixed cap, twice per window L, each run on its own fresh
emulator (instant decode, the demo's flags, `--random-seed 5`): with the trainer's window L, and with a window no
history reaches (every turn sent, as before the rule). A seeded emulator's answer is a function of the request, so
the two runs differ only by the turns not sent; the chat requests are the emulator's own count (GET
/_emulator/routes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import urllib.request
from pathlib import Path

from dflash_assets.emulator.process import start_emulator
from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shards
from dflash_assets.generation.request import GenerationRun
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.settings import DispatchSettings, GenerationSettings

DEMO = Path(__file__).parent.parent / "dflash_assets" / "demo" / "prompts.jsonl"
FLAGS = ["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "0", "--random-seed", "5"]
NO_WINDOW = 10**9  # a window no history fills: every turn is sent


def chat_requests(url: str) -> int:
    with urllib.request.urlopen(f"{url}/_emulator/routes") as response:
        return sum(n for k, n in json.load(response).items() if k.startswith("POST /v1/chat/"))


async def generate(data: Path, url: str, cap: int, window: int) -> tuple[int, list]:
    lines = sum(1 for _ in open(DEMO))
    async with connected([url]) as fleet:
        await build_prompt_shard(DEMO, 0, "00000", lines, data, fleet, {"enable_thinking": True})
        before = chat_requests(url)
        settings = GenerationSettings(
            max_output_tokens=cap, cap_policy="fixed", regenerate="all_turns", trainer_max_length=window
        )
        runs = await generate_shards(
            data, ["00000"], fleet, GenerationRun(settings, DispatchSettings(load_sample_s=0)), log=lambda m: None
        )
        return chat_requests(url) - before, runs


def generated(tmp: str, name: str, cap: int, window: int) -> tuple[int, list]:
    """A run on its own fresh emulator: a seeded one draws a request's answer anew each time it sees it again."""
    with start_emulator(FLAGS) as emu:
        return asyncio.run(generate(Path(tmp) / name, emu.url, cap, window))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cap", type=int, default=4096)
    parser.add_argument("--windows", default="2048,4096")
    args = parser.parse_args()
    print("| cap | window L | chat requests, every turn sent | with the rule | saved | conversations ended (by turn) |")
    print("|---|---|---|---|---|---|")
    for window in [int(w) for w in args.windows.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            every, _ = generated(tmp, "every", args.cap, NO_WINDOW)
            ruled, [run] = generated(tmp, "ruled", args.cap, window)
        turns = sorted(set(run.ended_at_window.values()))
        by_turn = ", ".join(f"turn {k}: {list(run.ended_at_window.values()).count(k)}" for k in turns)
        print(
            f"| {args.cap} | {window} | {every} | {ruled} | {every - ruled} | {len(run.ended_at_window)} ({by_turn}) |"
        )


if __name__ == "__main__":
    main()
