"""Liveness: a stream that goes silent is closed after stall_timeout_s, the server aborts it, the request is retried
on another server with its attempt recorded, and a server whose streams all stall is ejected. Nothing is lost,
nothing is committed twice.

The stalls are the emulator's mid-stream fault (stall_after_tokens): the first tokens come, then nothing for an
hour. A test that did not abandon them would hang until its timeout, so each one finishing is the proof.
"""

import asyncio

import pytest

from dflash_assets.fleet.client import ServerClient, ServerError
from dflash_assets.fleet.fleet import open_session
from dflash_assets.fleet.stream import Watch
from dflash_assets.generation.request import chat_body
from dflash_assets.settings import DispatchSettings, GenerationSettings
from tests.support.http import Http, aborted, settled
from tests.support.shards import generate, make_shard, rows

pytestmark = pytest.mark.timeout(180)

HOUR = "3600"
# 60 prompts on servers of 4 slots, a few seconds per run (the fault tests' fleet: test_server_faults.py)
FLAGS = [
    "--reasoning-parser",
    "qwen3",
    "--length-median",
    "200",
    "--length-sigma",
    "0.5",
    "--decode-tokens-per-s",
    "4000",
    "--max-running-requests",
    "4",
]
N = 60
PROMPTS = {f"f{i:03d}": f"fault test {i}" for i in range(N)}
# the stalls last an hour, a healthy server's tokens come every few ms: 3 s tells them apart with room for a loaded
# machine (at 0.5 s a healthy stream on a busy 2-core machine was taken for a stall now and then)
SETTINGS = DispatchSettings(
    stall_timeout_s=3.0,
    first_token_timeout_s=3.0,
    max_attempts=6,
    backoff_base_s=0.05,
    backoff_max_s=0.2,
    eject_after=2,
    commit_rows=5,
    commit_seconds=0.2,
    load_sample_s=0,
)


def run_beside_a_healthy_server(tmp_path, emulator, *fault: str):
    """A shard generated on a server with `fault` and a healthy one: (the two servers, the run, its rows)."""
    faulty, healthy = emulator(*FLAGS, "--enable-metrics", *fault), emulator(*FLAGS)
    urls = [faulty.emu.url, healthy.emu.url]
    make_shard(tmp_path / "data", urls[:1], PROMPTS)
    run = generate(tmp_path / "data", urls, 2048, SETTINGS)
    done = rows(tmp_path / "data", columns="prompt_id, server_url, attempt")
    assert (run.prompts, run.completed, run.failed) == (N, N, 0)
    assert len(done) == N == len({r[0] for r in done}), "every prompt committed once"
    return faulty, urls, run, done


def test_a_stream_silent_for_stall_timeout_is_closed_and_the_server_aborts_it(emulator):
    server = emulator(*FLAGS, "--enable-metrics", "--fault-stall-seconds", HOUR, "--fault-stall-after-tokens", "5")

    async def call():
        async with open_session() as session:
            client = ServerClient(session, server.emu.url)
            body = chat_body(GenerationSettings(max_output_tokens=512), "m", [{"role": "user", "content": "hi"}])
            with pytest.raises(ServerError) as e:
                await client.chat(body, Watch(stall_timeout_s=0.3))
            return e.value

    error = asyncio.run(call())
    assert error.kind == "stalled" and error.retryable
    assert error.message == "POST /v1/chat/completions: no token for 0.3s, the stream was closed"
    assert settled(server)["num_running_reqs"] == 0, "the slot the stalled stream held is free again"
    assert aborted(server) == 1


def test_a_mid_stream_stall_is_retried_on_another_server_with_its_attempt_and_nothing_is_lost(tmp_path, emulator):
    stalling, urls, run, done = run_beside_a_healthy_server(
        tmp_path, emulator, "--fault-stall-seconds", HOUR, "--fault-stall-after-tokens", "8", "--fault-stall-next", "3"
    )
    retried = [r for r in done if r[2] > 1]
    assert len(retried) == 3 and all(r[1] == urls[1] for r in retried), "the 3 stalled ones, each on the other server"
    assert run.servers[urls[0]]["stalls"] == 3
    assert settled(stalling)["num_running_reqs"] == 0 and aborted(stalling) == 3


def test_a_server_whose_streams_all_stall_is_ejected_and_the_run_completes_on_the_others(tmp_path, emulator):
    _, urls, run, done = run_beside_a_healthy_server(
        tmp_path, emulator, "--fault-stall-seconds", HOUR, "--fault-stall-after-tokens", "3"
    )
    assert {r[1] for r in done} == {urls[1]}, "no stream of the stalling server ever finished"
    assert run.servers[urls[0]]["ejections"] >= 1
    assert run.servers[urls[0]]["stalls"] >= SETTINGS.eject_after
    assert run.servers[urls[1]]["stalls"] == 0


def test_a_request_with_no_first_token_for_first_token_timeout_is_retried_elsewhere(tmp_path, emulator):
    _, urls, _, done = run_beside_a_healthy_server(
        tmp_path, emulator, "--fault-stall-seconds", HOUR, "--fault-stall-next", "2"
    )
    retried = [r for r in done if r[2] > 1]
    assert len(retried) == 2 and {r[1] for r in retried} == {urls[1]}


def test_a_stall_on_a_half_open_connection_is_aborted_by_its_rid_and_its_row_written_once(tmp_path, emulator):
    # the half-open fault: the stalled server never sees the client close, so only POST /abort_request frees the slot
    stalling, urls, run, done = run_beside_a_healthy_server(
        tmp_path,
        emulator,
        *("--fault-stall-seconds", HOUR, "--fault-stall-after-tokens", "8", "--fault-stall-next", "2"),
        "--fault-half-open",
    )
    _, stats = stalling.get("/_emulator/stats")
    assert len(stats["stalled_rids"]) == 2
    # each stalled rid aborted once; the two aborts are sent by two tasks at once, so in no set order
    assert sorted(stats["abort_requests"], key=lambda a: a["rid"]) == [
        {"rid": rid, "abort_all": False, "running": True} for rid in sorted(stats["stalled_rids"])
    ]
    assert settled(stalling)["num_running_reqs"] == 0, "the abort freed the slots the close did not"
    assert aborted(stalling) == 2
    retried = [r for r in done if r[2] > 1]
    assert len(retried) == 2 and {r[1] for r in retried} == {urls[1]}, "each stalled row retried on the other server"
    assert run.servers[urls[0]]["stalls"] == 2
    _, healthy = Http(urls[1]).get("/_emulator/stats")
    assert not {r["rid"] for r in healthy["sampled"]} & set(stats["stalled_rids"]), "a fresh rid for each attempt"
