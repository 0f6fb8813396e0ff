"""Servers that fail: a crash, 503 bursts, the whole fleet down, a status-less abort, a transient error, a wrong key.
What is the server's fault is retried (with backoff, on what is left of the fleet, an ejected server readmitted
once it is healthy); what is the prompt's is a reject; a wrong key or URL stops the run. Failures are never stored
as results: 0.5.23 answers an abort with HTTP 200 (tokenizer_manager._handle_abort_finish_reason lets it through).
Runs finish on what is left, or stop cleanly and a later run finishes the shard.
"""

import asyncio

import duckdb
import pytest

from dflash_assets.fleet.client import ServerAccessError, ServerClient, ServerError
from dflash_assets.fleet.fleet import Fleet, connected, open_session
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.slots import FleetDown
from dflash_assets.settings import DispatchSettings, GenerationSettings
from tests.support.shards import generate, make_shard, quiet, rows

# a crash, 503 bursts and the fleet down: 60 prompts on servers of 4 slots, a few seconds per run
FAULTY = [
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
FAULT_N = 60
FAULT_PROMPTS = {f"f{i:03d}": f"fault test {i}" for i in range(FAULT_N)}
FAULTS = DispatchSettings(
    max_attempts=6,
    backoff_base_s=0.05,
    backoff_max_s=0.5,
    commit_rows=5,
    commit_seconds=0.2,
    no_server_timeout_s=3.0,
    eject_after=2,
)
# one failure at a time: 12 short answers
FLAGS = ["--reasoning-parser", "qwen3", "--length-median", "40", "--length-sigma", "0.2"]
N = 12
PROMPTS = {f"p{i:02d}": f"question {i}" for i in range(N)}
SETTINGS = DispatchSettings(max_attempts=4, backoff_base_s=0.01, commit_rows=5, commit_seconds=0.2)


def served(tmp_path) -> list[tuple]:
    return rows(tmp_path / "data", columns="prompt_id, server_url, attempt")


def failures(tmp_path) -> list[tuple]:
    """The failure rows' prompt, attempts and error: what an assertion on counts shows when it fails."""
    found = list((tmp_path / "data" / "failures").rglob("*.parquet"))
    if not found:
        return []
    return duckdb.sql(
        f"select prompt_id, attempts, error from read_parquet('{tmp_path}/data/failures/**/*.parquet')"
    ).fetchall()


def answered(tmp_path) -> list[tuple]:
    return rows(tmp_path / "data", columns="prompt_id, finish_reason, attempt")


def test_one_of_three_servers_crashes_mid_run_and_the_run_completes_on_the_others(tmp_path, emulator):
    servers = [emulator(*FAULTY), emulator(*FAULTY), emulator(*FAULTY, "--fault-crash-after", "6")]
    urls = [s.emu.url for s in servers]
    make_shard(tmp_path / "data", urls[:1], FAULT_PROMPTS)
    run = generate(tmp_path / "data", urls, 2048, FAULTS)
    assert (run.completed, run.failed) == (FAULT_N, 0), failures(tmp_path)
    done = served(tmp_path)
    assert [r[0] for r in done] == [f"f{i:03d}" for i in range(FAULT_N)]
    by_server = {u: sum(r[1] == u for r in done) for u in urls}
    assert by_server[urls[2]] <= 6, "the crashed server answered at most what it served before crashing"
    assert by_server[urls[0]] + by_server[urls[1]] >= FAULT_N - 6
    assert any(r[2] > 1 for r in done), "the requests in flight on the crashed server were re-dispatched"


def test_503_bursts_are_retried_with_backoff_and_the_run_completes(tmp_path, emulator):
    servers = [emulator(*FAULTY, "--fault-503-next", "10"), emulator(*FAULTY, "--fault-503-next", "10")]
    urls = [s.emu.url for s in servers]
    make_shard(tmp_path / "data", urls[:1], FAULT_PROMPTS)
    settings = DispatchSettings(max_attempts=8, backoff_base_s=0.02, backoff_max_s=0.2, eject_after=50, commit_rows=5)
    run = generate(tmp_path / "data", urls, 2048, settings)
    assert (run.completed, run.failed) == (FAULT_N, 0)
    attempts = [r[2] for r in served(tmp_path)]
    assert len(attempts) == FAULT_N and max(attempts) > 1


def test_all_servers_down_stops_cleanly_then_a_later_run_finishes_the_shard(tmp_path, emulator):
    dying = [emulator(*FAULTY, "--fault-crash-after", "8"), emulator(*FAULTY, "--fault-crash-after", "8")]
    make_shard(tmp_path / "data", [dying[0].emu.url], FAULT_PROMPTS)
    with pytest.raises(FleetDown, match=r"no healthy server for \d+s \(of 2: "):
        generate(tmp_path / "data", [s.emu.url for s in dying], 2048, FAULTS)
    kept = served(tmp_path)
    assert 0 < len(kept) <= 16, "what was answered before the crash stays committed"
    healthy = emulator(*FAULTY)
    run = generate(tmp_path / "data", [healthy.emu.url], 2048, FAULTS)
    assert (run.completed, run.failed, run.already_done) == (FAULT_N, 0, len(kept))
    final = served(tmp_path)
    assert len(final) == FAULT_N == len({r[0] for r in final})
    assert set(kept) <= set(final)


def test_a_status_less_abort_answered_200_is_retried_not_stored_as_a_completion(tmp_path, emulator):
    server = emulator(*FLAGS, "--max-running-requests", "1")
    make_shard(tmp_path / "data", [server.emu.url], PROMPTS)
    status, _ = server.post("/_emulator/faults", {"abort_next": 3})
    assert status == 200
    # what 0.5.23 sends: HTTP 200, finish_reason "abort", no error status
    status, body = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert (status, body["choices"][0]["finish_reason"]) == (200, "abort")
    run = generate(tmp_path / "data", [server.emu.url], 512, SETTINGS)
    stored = answered(tmp_path)
    assert (run.completed, run.failed, len(stored)) == (N, 0, N)
    assert {r[1] for r in stored} <= {"stop", "length"}, "no aborted answer is stored as a completion"
    assert sum(r[2] - 1 for r in stored) == 2, "the two aborts left after the probe were each retried once"
    _, faults = server.get("/_emulator/faults")
    assert faults["injected"]["abort"] == 3


def test_a_transient_tokenize_error_is_retried_and_never_becomes_a_source_reject(tmp_path, emulator):
    server = emulator(*FLAGS)
    server.post("/_emulator/faults", {"tokenize_fail_next": 2})
    built = make_shard(tmp_path / "data", [server.emu.url], PROMPTS)
    assert (built.prompts, built.rejected) == (N, 0)
    _, faults = server.get("/_emulator/faults")
    assert faults["injected"]["tokenize_fail"] == 2


def test_a_tokenize_400_is_still_the_prompts_fault(emulator):
    server = emulator(*FLAGS)

    async def go():
        async with connected([server.emu.url]) as fleet:
            # serving_chat._validate_request refuses it with a 400: a reject, not a retry
            return await fleet.clients[0].count_prompt_tokens([], {})

    with pytest.raises(ServerError) as err:
        asyncio.run(go())
    assert (err.value.status, err.value.retryable, err.value.message) == (400, False, "Messages cannot be empty.")


def test_a_401_during_generation_stops_the_run_with_a_clear_error_and_rejects_nothing(tmp_path, emulator):
    server = emulator(*FLAGS, key="right-key")
    make_shard(tmp_path / "data", [server.emu.url], PROMPTS, "right-key")

    async def go():  # the key changed after the fleet was probed (a rotated gateway key)
        async with connected([server.emu.url], "right-key") as probed:
            infos = probed.infos
        async with open_session() as session:
            fleet = Fleet([ServerClient(session, server.emu.url, "stale-key")], infos, session)
            return await generate_shard(
                tmp_path / "data", "00000", fleet, GenerationSettings(max_output_tokens=512), SETTINGS, log=quiet
            )

    with pytest.raises(ServerAccessError) as err:
        asyncio.run(go())
    message = str(err.value)
    assert "HTTP 401 on POST /v1/chat/completions" in message and "the API key is missing or wrong" in message
    assert "stale-key" not in message
    server_rejects = list((tmp_path / "data" / "rejects").rglob("stage=server/*.parquet"))
    assert sum(duckdb.sql(f"select count(*) from '{p}'").fetchall()[0][0] for p in server_rejects) == 0, (
        "a wrong key is not the prompts' fault"
    )
    assert not list((tmp_path / "data" / "completions").rglob("*.parquet")), "and nothing is stored"


def test_an_ejected_server_whose_health_takes_seconds_is_readmitted_and_the_run_completes(tmp_path, emulator):
    server = emulator(*FLAGS, "--health-delay", "2.5")
    make_shard(tmp_path / "data", [server.emu.url], PROMPTS)
    server.post("/_emulator/faults", {"fail_next": 2})  # two 503s eject the only server
    settings = DispatchSettings(
        max_attempts=5,
        backoff_base_s=0.01,
        eject_after=2,
        no_server_timeout_s=10,
        commit_rows=5,
        commit_seconds=0.2,
        max_in_flight_per_server=1,
    )
    run = generate(tmp_path / "data", [server.emu.url], 512, settings)
    assert (run.completed, run.failed) == (12, 0)
    assert len(answered(tmp_path)) == 12
