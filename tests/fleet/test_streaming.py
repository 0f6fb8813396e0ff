"""Streamed generation commits the row a blocking POST commits, column for column, on both routes.

Fresh generation goes through /v1/chat/completions, continuation by token ids through /generate. Each mode runs
on its own fresh emulator with the same flags (the same prefix-cache history: one request in flight, in prompt
order), with --non-ascii so that a streamed event can end inside a character, and one event per token.
"""

import json
import shutil

import aiohttp
import duckdb
import pytest

from dflash_assets.fleet.client import ServerClient
from dflash_assets.fleet.fleet import on_fleet, run
from dflash_assets.generation.continuation import continue_shard
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.request import chat_body
from dflash_assets.generation.send import watch_of
from dflash_assets.generation.shards import SourceRules, build_prompt_shard
from dflash_assets.settings import DispatchSettings, GenerationSettings, RepeatSettings
from tests.support.forks import start_emulator

pytestmark = pytest.mark.timeout(300)

FLAGS = [
    "--reasoning-parser",
    "qwen3",
    "--non-ascii",
    "--random-seed",
    "7",
    "--sampling",
    "per-prompt",
    "--enable-cache-report",
    "--stream-interval",
    "1",
    "--length-median",
    "160",
    "--length-sigma",
    "0.8",
]
N = 24
# what a row records of when and where it was made; every other column must be the same
PROVENANCE = {"latency_s", "created_at", "server_url"}


def settings(stream: bool) -> DispatchSettings:
    return DispatchSettings(
        stream=stream,
        store_token_ids=True,
        max_in_flight_per_server=1,
        commit_rows=8,
        commit_seconds=0.2,
        load_sample_s=0,
    )


def make_shard(data_dir, url) -> None:
    src = data_dir.parent / "prompts.jsonl"
    lead = "You are a careful analyst. Read the case below, think it through step by step, then answer it. "
    src.write_text(
        "".join(json.dumps({"id": f"s{i:03d}", "prompt": f"{lead}Case {i}."}) + "\n" for i in range(N))
    )  # the shared lead-in is cached: cached_tokens > 0
    # the prompts differ only in their case number: near repeats, kept here (the cache's shared lead-in is the point)
    keep = RepeatSettings(keep_repeats=True)
    on_fleet(
        [url],
        lambda f: build_prompt_shard(
            src, 0, "00000", N, data_dir, f, {"enable_thinking": True}, SourceRules(repeats=keep)
        ),
    )


def generate(data_dir, url, cap: int, stream: bool):
    return on_fleet(
        [url],
        lambda f: generate_shard(
            data_dir, "00000", f, GenerationSettings(max_output_tokens=cap), settings(stream), log=lambda m: None
        ),
    )


def rows(data_dir, config_hash: str) -> list[dict]:
    rel = duckdb.sql(
        f"select * exclude ({', '.join(PROVENANCE)}) from read_parquet("
        f"'{data_dir}/completions/**/*.parquet', union_by_name = true) "
        f"where config_hash = '{config_hash}' order by prompt_id"
    )
    return [dict(zip(rel.columns, r)) for r in rel.fetchall()]


def assert_same_rows(streamed: list[dict], blocking: list[dict]) -> None:
    assert len(streamed) == len(blocking) == N
    for s, b in zip(streamed, blocking):
        assert s == b, f"row {s['prompt_id']}: " + ", ".join(k for k in s if s[k] != b[k])


@pytest.fixture(scope="module")
def chat_runs(tmp_path_factory):
    """The same shard generated at a cap of 96 (many rows cut, some inside a character), blocking and streamed."""
    runs = {}
    for stream in (False, True):
        data = tmp_path_factory.mktemp(f"chat-{stream}") / "data"
        with start_emulator(FLAGS) as emu:
            make_shard(data, emu.url)
            runs[stream] = data, generate(data, emu.url, 96, stream)
    return runs


def test_a_streamed_chat_row_equals_the_blocking_one_in_every_column(chat_runs):
    (blocking_dir, blocking), (streamed_dir, streamed) = chat_runs[False], chat_runs[True]
    assert blocking.config_hash == streamed.config_hash, "streaming is a dispatch setting: not hashed"
    mine, theirs = rows(streamed_dir, streamed.config_hash), rows(blocking_dir, blocking.config_hash)
    assert_same_rows(mine, theirs)
    # what the comparison covers: both finish reasons, cuts in the thought and in the answer, split characters,
    # token ids and the prefix cache's counts
    assert {r["finish_reason"] for r in mine} == {"stop", "length"}
    assert {r["content"] == "" for r in mine if r["finish_reason"] == "length"} == {True, False}
    assert any("\ufffd" in (r["content"] or r["reasoning_content"]) for r in mine), "a cap cut a character"
    assert any("—" in r["reasoning_content"] for r in mine)
    assert all(r["output_ids"] and len(r["output_ids"]) == r["completion_tokens"] for r in mine)
    assert all(r["prompt_token_ids"] for r in mine) and any(r["cached_tokens"] for r in mine)
    assert all(r["loop_start_tokens"] is None for r in mine)


def test_a_streamed_continuation_row_equals_the_blocking_one_in_every_column(chat_runs, tmp_path):
    parent_dir, parent = chat_runs[False]
    continued = {}
    for stream in (False, True):
        data = tmp_path / f"cont-{stream}" / "data"
        shutil.copytree(parent_dir, data)
        with start_emulator(FLAGS) as emu:
            run = on_fleet(
                [emu.url],
                lambda f: continue_shard(  # noqa: B023 (awaited in this iteration)
                    data,  # noqa: B023
                    "00000",
                    f,
                    parent.config_hash,
                    640,
                    settings(stream),  # noqa: B023
                    log=lambda m: None,
                ),
            )
        assert run.continued > 0 and run.failed == 0
        continued[stream] = data, run
    (blocking_dir, blocking), (streamed_dir, streamed) = continued[False], continued[True]
    mine, theirs = rows(streamed_dir, streamed.config_hash), rows(blocking_dir, blocking.config_hash)
    assert_same_rows(mine, theirs)
    assert sum(r["tokens_reused"] < r["completion_tokens"] for r in mine) == streamed.continued


def test_stream_off_sends_blocking_requests_and_stream_on_streamed_ones(tmp_path, emulator):
    """The setting decides the route's mode: the server counts each request as streaming or not (its
    sglang:num_requests_total{is_streaming} counter)."""
    emu = emulator(*FLAGS, "--enable-metrics")
    data = tmp_path / "data"
    make_shard(data, emu.emu.url)
    generate(data, emu.emu.url, 96, stream=False)
    generate(data, emu.emu.url, 97, stream=True)  # another cap: another config, every prompt sent again
    _, text = emu.get("/metrics")
    counts = {
        line.split('is_streaming="')[1][:5].strip('"'): float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:num_requests_total{")
    }
    assert counts == {"false": N, "true": N}


def test_a_finished_stream_gives_its_connection_back_to_the_pool(emulator):
    """A stream is read to its body's end after data: [DONE] (its last chunk may come in a read of its own), so 40
    streams one after the other share one connection: released before the end, aiohttp closes it instead."""
    emu = emulator(*FLAGS)
    body = chat_body(GenerationSettings(max_output_tokens=64), "m", [{"role": "user", "content": "x"}], token_ids=True)

    async def connections() -> int:
        made = 0

        async def counted(*_) -> None:
            nonlocal made
            made += 1

        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(counted)
        async with aiohttp.ClientSession(trace_configs=[trace]) as session:
            client = ServerClient(session, emu.emu.url)
            for _ in range(40):
                assert (await client.chat(body, watch_of(DispatchSettings()))).finish_reason
        return made

    assert run(connections()) == 1
