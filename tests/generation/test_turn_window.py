"""Preflight counts every turn: under all_turns, a later turn whose history already fills the trainer's window ends
its conversation there (rules.fills_window), with no request for it or the turns after it, counted by turn; a
rerun plans the same without sending anything. Under a fixed cap too: the window policy would refuse such a turn,
and a fixed cap would decode it for nothing the trainer reads."""

import asyncio
import json

import duckdb

from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.settings import DispatchSettings, GenerationSettings
from tests.support.forks import start_emulator
from tests.support.http import Http

WINDOW = 512
ARGS = [
    "--reasoning-parser",
    "qwen3",
    "--length-median",
    "40",
    "--length-sigma",
    "0.1",
    "--decode-tokens-per-s",
    "50000",
]
TURNS = [
    {"role": "user", "content": "First, briefly."},
    {"role": "assistant", "content": "old"},
    {"role": "user", "content": "Second: " + "a b " * 300},  # its history alone is past the window
    {"role": "assistant", "content": "old"},
    {"role": "user", "content": "Third, briefly."},
]
SHORT = [{**m, "content": "Second, briefly."} if m["content"].startswith("Second") else m for m in TURNS]


def chat_requests(url: str) -> int:
    return sum(n for k, n in Http(url).get("/_emulator/routes")[1].items() if k.startswith("POST /v1/chat/completions"))


def run_shard(data_dir, url: str, log: list[str]):
    async def go():
        async with connected([url]) as fleet:
            return await generate_shard(
                data_dir,
                "00000",
                fleet,
                GenerationSettings(max_output_tokens=256, regenerate="all_turns", trainer_max_length=WINDOW),
                DispatchSettings(load_sample_s=0),
                log=log.append,
            )

    return asyncio.run(go())


def test_a_turn_whose_history_fills_the_window_ends_its_conversation_unsent_under_a_fixed_cap(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": i, "messages": m}) + "\n" for i, m in (("long", TURNS), ("short", SHORT))))
    with start_emulator(ARGS) as emu:

        async def build():
            async with connected([emu.url]) as fleet:
                await build_prompt_shard(src, 0, "00000", 2, data, fleet, {"enable_thinking": True})

        asyncio.run(build())
        log: list[str] = []
        run = run_shard(data, emu.url, log)
        sent = chat_requests(emu.url)
        again = run_shard(data, emu.url, log)
        sent_again = chat_requests(emu.url) - sent
    rows = duckdb.sql(
        f"select prompt_id, turn from read_parquet('{data}/completions/**/*.parquet') order by all"
    ).fetchall()
    assert rows == [("long", 1), ("short", 1), ("short", 2), ("short", 3)]
    assert sent == 4, "long's turn 2 and 3 were never requested"
    assert run.ended_at_window == {"long": 2} and run.by_turn[2]["ended_at_window"] == 1
    assert (run.prompts, run.completed, run.rejected, run.failed) == (2, 2, 0, 0)
    assert any(
        "1 conversations end at a turn whose history fills the trainer's window max_length 512 (turn 2: 1)" in n
        for n in run.notes
    )
    # the rerun plans the same end from the committed turn 1, and sends nothing
    assert sent_again == 0 and again.ended_at_window == {"long": 2}
    assert (again.completed, again.already_done, again.rejected) == (2, 1, 0)
    assert "1 ending at a turn that fills the window, 0 to go on with" in log[-1]
