"""Server faults: a crash, 503 bursts, the whole fleet down. Runs finish on what is left, or stop cleanly."""

import asyncio
import json

import duckdb
import pytest

from dflash_assets.fleet.fleet import connect
from dflash_assets.generation.config import DispatchSettings, GenerationConfig
from dflash_assets.generation.slots import FleetDown
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard

FLAGS = ["--reasoning-parser", "qwen3", "--length-median", "200", "--length-sigma", "0.5",
         "--decode-tokens-per-s", "4000", "--max-running-requests", "4"]
N = 60
SETTINGS = DispatchSettings(max_attempts=6, backoff_base_s=0.05, backoff_max_s=0.5, commit_rows=5,
                            commit_seconds=0.2, no_server_timeout_s=3.0, eject_after=2)


def make_shard(tmp_path, url) -> None:
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"f{i:03d}", "prompt": f"fault test {i}"}) + "\n" for i in range(N)))

    async def go():
        fleet = await connect([url])
        try:
            await build_prompt_shard(src, 0, "00000", N, tmp_path / "data", fleet, {"enable_thinking": True})
        finally:
            await fleet.session.close()

    asyncio.run(go())


def generate(tmp_path, urls, settings=SETTINGS):
    async def go():
        fleet = await connect(urls)
        try:
            return await generate_shard(tmp_path / "data", "00000", fleet, GenerationConfig(max_output_tokens=2048),
                                        settings, log=lambda m: None)
        finally:
            await fleet.session.close()

    return asyncio.run(go())


def rows(tmp_path) -> list[tuple]:
    return duckdb.sql(f"select prompt_id, server_url, attempt from read_parquet("
                      f"'{tmp_path}/data/completions/**/*.parquet') order by prompt_id").fetchall()


def test_one_of_three_servers_crashes_mid_run_and_the_run_completes_on_the_others(tmp_path, emulator):
    servers = [emulator(*FLAGS), emulator(*FLAGS), emulator(*FLAGS, "--fault-crash-after", "6")]
    urls = [s.emu.url for s in servers]
    make_shard(tmp_path, urls[0])
    run = generate(tmp_path, urls)
    assert (run.completed, run.failed) == (N, 0)
    done = rows(tmp_path)
    assert [r[0] for r in done] == [f"f{i:03d}" for i in range(N)]
    by_server = {u: sum(r[1] == u for r in done) for u in urls}
    assert by_server[urls[2]] <= 6, "the crashed server answered at most what it served before crashing"
    assert by_server[urls[0]] + by_server[urls[1]] >= N - 6
    assert any(r[2] > 1 for r in done), "the requests in flight on the crashed server were re-dispatched"


def test_503_bursts_are_retried_with_backoff_and_the_run_completes(tmp_path, emulator):
    servers = [emulator(*FLAGS, "--fault-503-next", "10"), emulator(*FLAGS, "--fault-503-next", "10")]
    urls = [s.emu.url for s in servers]
    make_shard(tmp_path, urls[0])
    run = generate(tmp_path, urls, DispatchSettings(max_attempts=8, backoff_base_s=0.02, backoff_max_s=0.2,
                                                    eject_after=50, commit_rows=5))
    assert (run.completed, run.failed) == (N, 0)
    attempts = [r[2] for r in rows(tmp_path)]
    assert len(attempts) == N and max(attempts) > 1


def test_all_servers_down_stops_cleanly_then_a_later_run_finishes_the_shard(tmp_path, emulator):
    dying = [emulator(*FLAGS, "--fault-crash-after", "8"), emulator(*FLAGS, "--fault-crash-after", "8")]
    make_shard(tmp_path, dying[0].emu.url)
    with pytest.raises(FleetDown, match=r"no healthy server for \d+s \(of 2: "):
        generate(tmp_path, [s.emu.url for s in dying])
    kept = rows(tmp_path)
    assert 0 < len(kept) <= 16, "what was answered before the crash stays committed"
    healthy = emulator(*FLAGS)
    run = generate(tmp_path, [healthy.emu.url])
    assert (run.completed, run.failed, run.already_done) == (N, 0, len(kept))
    final = rows(tmp_path)
    assert len(final) == N == len({r[0] for r in final})
    assert set(kept) <= set(final)
