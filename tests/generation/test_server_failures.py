"""Failures are never stored as results: what 0.5.23 answers when it did not finish a request, and who is at fault.

A status-less abort is an HTTP 200 (tokenizer_manager._handle_abort_finish_reason lets it through), a transient
error while counting tokens is the server's, and a 401/403/404 means the key or the URL is wrong: the run stops.
"""

import asyncio
import json

import duckdb
import pytest

from dflash_assets.fleet.client import ServerAccessError, ServerClient, ServerError
from dflash_assets.fleet.fleet import Fleet, connect, open_session
from dflash_assets.generation.config import DispatchSettings, GenerationConfig
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard

FLAGS = ["--reasoning-parser", "qwen3", "--length-median", "40", "--length-sigma", "0.2"]
SETTINGS = DispatchSettings(max_attempts=4, backoff_base_s=0.01, commit_rows=5, commit_seconds=0.2)
N = 12


def build(tmp_path, url, key=None):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i:02d}", "prompt": f"question {i}"}) + "\n" for i in range(N)))

    async def go():
        async with await connect([url], key) as fleet:
            return await build_prompt_shard(src, 0, "00000", N, tmp_path / "data", fleet, {"enable_thinking": True})

    return asyncio.run(go())


def generate(tmp_path, fleet_of):
    async def go():
        async with await fleet_of() as fleet:
            return await generate_shard(tmp_path / "data", "00000", fleet, GenerationConfig(max_output_tokens=512),
                                        SETTINGS, log=lambda m: None)

    return asyncio.run(go())


def completions(tmp_path) -> list[tuple]:
    return duckdb.sql(f"select prompt_id, finish_reason, attempt from read_parquet("
                      f"'{tmp_path}/data/completions/**/*.parquet') order by prompt_id").fetchall()


def test_a_status_less_abort_answered_200_is_retried_not_stored_as_a_completion(tmp_path, emulator):
    server = emulator(*FLAGS, "--max-running-requests", "1")
    build(tmp_path, server.emu.url)
    status, _ = server.post("/_emulator/faults", {"abort_next": 3})
    assert status == 200
    # what 0.5.23 sends: HTTP 200, finish_reason "abort", no error status
    status, body = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert (status, body["choices"][0]["finish_reason"]) == (200, "abort")
    run = generate(tmp_path, lambda: connect([server.emu.url]))
    rows = completions(tmp_path)
    assert (run.completed, run.failed, len(rows)) == (N, 0, N)
    assert {r[1] for r in rows} <= {"stop", "length"}, "no aborted answer is stored as a completion"
    assert sum(r[2] - 1 for r in rows) == 2, "the two aborts left after the probe were each retried once"
    _, faults = server.get("/_emulator/faults")
    assert faults["injected"]["abort"] == 3


def test_a_transient_tokenize_error_is_retried_and_never_becomes_a_source_reject(tmp_path, emulator):
    server = emulator(*FLAGS)
    server.post("/_emulator/faults", {"tokenize_fail_next": 2})
    built = build(tmp_path, server.emu.url)
    assert (built.prompts, built.rejected) == (N, 0)
    _, faults = server.get("/_emulator/faults")
    assert faults["injected"]["tokenize_fail"] == 2


def test_a_tokenize_400_is_still_the_prompts_fault(emulator):
    server = emulator(*FLAGS)

    async def go():
        async with await connect([server.emu.url]) as fleet:
            # serving_chat._validate_request refuses it with a 400: a reject, not a retry
            return await fleet.clients[0].count_prompt_tokens([], {})

    with pytest.raises(ServerError) as err:
        asyncio.run(go())
    assert (err.value.status, err.value.retryable, err.value.message) == (400, False, "Messages cannot be empty.")


def test_a_401_during_generation_stops_the_run_with_a_clear_error_and_rejects_nothing(tmp_path, emulator):
    server = emulator(*FLAGS, key="right-key")
    build(tmp_path, server.emu.url, "right-key")

    async def rotated_key() -> Fleet:  # the key changed after the fleet was probed (a rotated gateway key)
        probed = await connect([server.emu.url], "right-key")
        await probed.session.close()
        session = open_session()
        return Fleet([ServerClient(session, server.emu.url, "stale-key")], probed.infos, session)

    with pytest.raises(ServerAccessError) as err:
        generate(tmp_path, rotated_key)
    message = str(err.value)
    assert "HTTP 401 on POST /v1/chat/completions" in message and "the API key is missing or wrong" in message
    assert "stale-key" not in message
    server_rejects = list((tmp_path / "data" / "rejects").rglob("stage=server/*.parquet"))
    assert sum(duckdb.sql(f"select count(*) from '{p}'").fetchall()[0][0] for p in server_rejects) == 0, \
        "a wrong key is not the prompts' fault"
    assert not list((tmp_path / "data" / "completions").rglob("*.parquet")), "and nothing is stored"


def test_an_ejected_server_whose_health_takes_seconds_is_readmitted_and_the_run_completes(tmp_path, emulator):
    server = emulator(*FLAGS, "--health-delay", "2.5")
    build(tmp_path, server.emu.url)
    server.post("/_emulator/faults", {"fail_next": 2})  # two 503s eject the only server
    settings = DispatchSettings(max_attempts=5, backoff_base_s=0.01, eject_after=2, no_server_timeout_s=10,
                                commit_rows=5, commit_seconds=0.2, max_in_flight_per_server=1)
    run = asyncio.run(_generate(tmp_path, server.emu.url, settings))
    assert (run.completed, run.failed) == (12, 0)
    assert len(completions(tmp_path)) == 12


async def _generate(tmp_path, url, settings):
    async with await connect([url]) as fleet:
        return await generate_shard(tmp_path / "data", "00000", fleet, GenerationConfig(max_output_tokens=512),
                                    settings, log=lambda m: None)
