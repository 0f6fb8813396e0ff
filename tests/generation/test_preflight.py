"""Preflight: nothing is sent that the servers will reject, and what cannot be sent says why, in numbers."""

import duckdb
import pytest

from dflash_assets.generation.preflight import PreflightError
from dflash_assets.store.stores import prompt_store
from tests.support.http import requests_served
from tests.support.shards import FEW_RETRIES, SHORT, generate, longest_prompt, make_shard, numbered


def rejects(tmp_path, stage: str) -> list[tuple]:
    return duckdb.sql(
        f"select prompt_id, reason, prompt_tokens, max_output_tokens, server_context_length from "
        f"read_parquet('{tmp_path}/data/rejects/**/*.parquet', hive_partitioning = false) "
        f"where stage = '{stage}' order by prompt_id"
    ).fetchall()


PROMPTS = ["short one", "another short", "word " * 300, "a third short", "word " * 250]


def test_reject_policy_sends_the_rest_and_names_the_numbers(tmp_path, emulator):
    server = emulator("--context-length", "1024", *SHORT)
    make_shard(tmp_path / "data", [server.emu.url], numbered(PROMPTS))
    run = generate(tmp_path / "data", [server.emu.url], 800, FEW_RETRIES)
    assert (run.prompts, run.completed, run.rejected_preflight, run.failed) == (5, 3, 2, 0)
    rows = rejects(tmp_path, "preflight")
    assert [r[0] for r in rows] == ["q2", "q4"]
    for _, reason, tokens, cap, context in rows:
        assert (cap, context) == (800, 1024) and tokens + cap > 1022
        assert reason == (
            f"prompt of {tokens} tokens + max_output_tokens 800 = {tokens + 800} exceeds the server "
            f"context length 1024 minus a safety margin of 2 tokens"
        )
    assert requests_served(server) == 3, "the overflowing prompts were never sent"


def test_fail_policy_fails_before_any_request_with_the_counts(tmp_path, emulator):
    server = emulator("--context-length", "1024", *SHORT)
    make_shard(tmp_path / "data", [server.emu.url], numbered(PROMPTS))
    with pytest.raises(PreflightError) as err:
        generate(tmp_path / "data", [server.emu.url], 800, FEW_RETRIES, preflight_policy="fail")
    assert str(err.value).startswith(
        "2 of 5 prompts do not fit: the servers' context length is 1024 tokens and max_output_tokens is 800"
    )
    assert requests_served(server) == 0


def test_when_every_prompt_overflows_the_run_fails_naming_the_context_that_would_fit(tmp_path, emulator):
    # a context that cannot hold prompt + cap: --context-length 8192 with max_output_tokens 8192
    server = emulator("--context-length", "8192", *SHORT)
    make_shard(tmp_path / "data", [server.emu.url], numbered(["short one", "another short", "a third"]))
    largest = longest_prompt(tmp_path / "data" / "prompt_shards")
    with pytest.raises(PreflightError) as err:
        generate(tmp_path / "data", [server.emu.url], 8192, FEW_RETRIES)
    message = str(err.value)
    # the cap alone fills the context: said so, never "a prompt may have at most -2 tokens"
    assert message == (
        "3 of 3 prompts do not fit: max_output_tokens 8,192 leaves no room for a prompt in the servers' context "
        "length 8,192 (read from the servers; 2 tokens kept free): lower --max-output-tokens below 8,190, or give "
        f"the servers --context-length {largest + 8192 + 2:,} or more. Nothing was sent."
    )
    assert requests_served(server) == 0


def test_servers_that_disagree_on_context_length_are_reported_and_the_smallest_is_used(tmp_path, emulator):
    a, b = emulator("--context-length", "4096", *SHORT), emulator("--context-length", "2048", *SHORT)
    urls = [a.emu.url, b.emu.url]
    make_shard(tmp_path / "data", urls, numbered(["short one", "another"]))
    logs: list[str] = []
    run = generate(tmp_path / "data", urls, 1500, FEW_RETRIES, log=logs.append)
    assert run.fleet_notes == [
        f"servers disagree on context length ({a.emu.url}: 4096, {b.emu.url}: 2048); using the smallest, 2048"
    ]
    assert run.completed == 2


def test_the_fleet_refuses_to_mix_models(tmp_path, emulator):
    a = emulator(*SHORT)
    b = emulator("--served-model-name", "other-model", *SHORT)
    make_shard(tmp_path / "data", [a.emu.url], numbered(["short one"]))
    with pytest.raises(PreflightError, match="the fleet serves 2 different models, refusing to mix them"):
        generate(tmp_path / "data", [a.emu.url, b.emu.url], 100, FEW_RETRIES)


def test_a_context_400_from_the_server_is_rejected_with_its_message_and_never_retried(tmp_path, emulator):
    server = emulator("--context-length", "1024", *SHORT)
    make_shard(tmp_path / "data", [server.emu.url], numbered(["short one", "word " * 300]))
    # make the shard lie about a prompt's size, as a stale count would, so preflight lets it through
    store = prompt_store(tmp_path / "data", "00000")
    table = store.read().to_pylist()
    for row in table:
        row["prompt_tokens"] = 10
    store.replace(table, "prompts.parquet")
    run = generate(tmp_path / "data", [server.emu.url], 800, FEW_RETRIES)
    assert (run.completed, run.rejected_server, run.failed) == (1, 1, 0)
    [(pid, reason, *_)] = rejects(tmp_path, "server")
    assert pid == "q1"
    assert reason.startswith(
        "HTTP 400: Requested token count exceeds the model's maximum context length of 1024 tokens."
    )
    assert requests_served(server) == 2, "the rejected prompt was sent once, not retried"
    again = generate(tmp_path / "data", [server.emu.url], 800, FEW_RETRIES)
    assert (again.completed, again.rejected_server) == (1, 1)
    assert requests_served(server) == 2, "nor resent by a later run at the same budget"
