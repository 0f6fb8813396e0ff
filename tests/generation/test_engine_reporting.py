"""Each shard's figures describe that shard, when a backfill run streams several through one dispatcher."""

import asyncio
import json

from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shards
from dflash_assets.generation.request import GenerationRun
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.settings import DispatchSettings, GenerationSettings

SHARDS, PER_SHARD = ["00000", "00001", "00002"], 24
FLAGS = ["--decode-tokens-per-s", "20000", "--max-running-requests", "4", "--length-median", "120"]


def run_three_shards(tmp_path, urls):
    src = tmp_path / "p.jsonl"
    src.write_text(
        "".join(
            json.dumps({"id": f"e{i:03d}", "prompt": f"engine report {i}"}) + "\n"
            for i in range(PER_SHARD * len(SHARDS))
        )
    )

    async def go():
        async with connected(urls) as fleet:
            for i, shard in enumerate(SHARDS):
                await build_prompt_shard(src, i, shard, PER_SHARD, tmp_path / "data", fleet, {"enable_thinking": True})
            return await generate_shards(
                tmp_path / "data",
                SHARDS,
                fleet,
                GenerationRun(
                    GenerationSettings(max_output_tokens=1024), DispatchSettings(load_sample_s=0, commit_rows=8)
                ),
                log=lambda m: None,
            )

    return asyncio.run(go())


def test_every_shard_reports_its_own_notes_servers_and_time(tmp_path, emulator):
    # one server without --reasoning-parser while thinking is on: a fleet note, which is the run's, not a shard's
    servers = [emulator(*FLAGS, "--reasoning-parser", "qwen3"), emulator(*FLAGS)]
    runs = run_three_shards(tmp_path, [s.emu.url for s in servers])
    assert [r.completed for r in runs] == [PER_SHARD] * 3

    # notes: each shard its own list; the fleet's warning once, on the run (was: one list shared by every shard)
    assert len({id(r.notes) for r in runs}) == 3 and all(r.notes == [] for r in runs)
    assert all(len(r.fleet_notes) == 1 and "without --reasoning-parser" in r.fleet_notes[0] for r in runs)

    # servers: this shard's rows and tokens per server (was: the run's totals copied onto each shard)
    for r in runs:
        assert set(r.servers) == {s.emu.url for s in servers}
        assert sum(s["completed"] for s in r.servers.values()) == PER_SHARD
        assert sum(s["output_tokens"] for s in r.servers.values()) == r.output_tokens
        assert all(s["in_flight_limit"] == 6 for s in r.servers.values())  # 4 running + the waiting margin
    assert sum(r.output_tokens for r in runs) == sum(s["output_tokens"] for r in runs for s in r.servers.values())

    # time: from the shard's first request to its last answer (was: from the start of the run, so every shard
    # after the first looked slower than it was)
    for r in runs:
        assert r.elapsed_s == r.finished_at - r.first_sent_at > 0
        assert r.finished_at >= r.answered_at
    assert runs[0].first_sent_at < runs[1].first_sent_at < runs[2].first_sent_at
