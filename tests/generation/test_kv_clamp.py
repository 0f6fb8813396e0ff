"""A KV pool smaller than the context: 0.5.23 clamps the output silently; preflight holds to the real limit.

managers/tp_worker.py: max_req_len = min(context_len - 1, kv_capacity - 1), max_req_input_len = max_req_len - 5;
managers/scheduler.py init_req_max_new_tokens: max_new_tokens = min(max_new_tokens, max_req_len - input - 1).
"""

import ast
import re

import duckdb
import pytest

from dflash_assets.generation.preflight import PreflightError
from dflash_assets.quality import run_checks
from dflash_assets.quality.checks.registry import CHECKS_BY_NAME, gate_passed
from dflash_assets.store.stores import prompt_store
from tests.support.http import requests_served
from tests.support.quality_data import check, load
from tests.support.sglang_wheel import sglang_srt
from tests.support.shards import FEW_RETRIES, SHORT, generate, longest_prompt, make_shard, numbered

SGLANG = sglang_srt()
SMALL_POOL = [
    "--context-length",
    "4096",
    "--max-total-tokens",
    "1024",
    *SHORT[:3],
    "--length-median",
    "3000",
    "--length-sigma",
    "0.1",
]


def test_the_scheduler_rule_the_emulator_follows_is_0_5_23s():
    worker = (SGLANG / "managers/tp_worker.py").read_text()
    assert re.search(r"max_req_len = min\(\s*self\.model_config\.context_len - 1,\s*kv_capacity - 1,\s*\)", worker)
    assert "max_req_input_len = max_req_len - 5" in worker
    scheduler = ast.unparse(ast.parse((SGLANG / "managers/scheduler.py").read_text()))
    assert "min(max_new_tokens, self.max_req_len - input_len - 1)" in scheduler


def test_a_small_kv_pool_makes_server_info_report_the_lower_request_limit(emulator):
    server = emulator(*SMALL_POOL)
    _, info = server.get("/server_info")
    assert (info["max_total_num_tokens"], info["max_req_input_len"]) == (1024, 1023 - 5)


def test_preflight_holds_prompt_plus_cap_to_the_kv_pool_not_the_context(tmp_path, emulator):
    server = emulator(*SMALL_POOL)
    make_shard(tmp_path / "data", [server.emu.url], numbered(["short one", "another short", "a third short"]))
    largest = longest_prompt(tmp_path / "data" / "prompt_shards")
    with pytest.raises(PreflightError) as err:
        # fits the 4096 context, not the 1024-token pool
        generate(tmp_path / "data", [server.emu.url], 2000, FEW_RETRIES)
    message = str(err.value)
    assert message.startswith(
        "3 of 3 prompts do not fit: the servers grant a request at most 1022 tokens "
        "(prompt + output) because their KV pool holds 1024 tokens, fewer than the context "
        "length 4096; max_output_tokens is 2000"
    )
    assert f"the largest prompt has {largest}" in message and "Nothing was sent" in message
    assert requests_served(server) == 0


def test_within_the_pool_every_length_row_stops_exactly_at_its_cap(tmp_path, emulator):
    server = emulator(*SMALL_POOL)
    make_shard(tmp_path / "data", [server.emu.url], numbered(["short one", "another short", "a third short"]))
    logs = []
    run = generate(tmp_path / "data", [server.emu.url], 900, FEW_RETRIES, log=logs.append)
    assert run.completed == 3 and run.fleet_notes == [
        f"KV pool smaller than the context length ({server.emu.url}: 1024 < 4096): SGLang clamps a request's "
        f"output to the pool silently; preflight holds prompt + max_output_tokens to 1022"
    ]
    rows = duckdb.sql(
        f"select finish_reason, completion_tokens from read_parquet('{tmp_path}/data/completions/**/*.parquet')"
    ).fetchall()
    assert rows == [("length", 900)] * 3


def test_a_clamp_forced_past_preflight_is_caught_by_a_blocking_check(tmp_path, emulator):
    server = emulator(*SMALL_POOL)
    make_shard(tmp_path / "data", [server.emu.url], numbered(["short one", "another short"]))
    store = prompt_store(tmp_path / "data", "00000")
    table = store.read().to_pylist()
    real = {r["prompt_id"]: r["prompt_tokens"] for r in table}
    for row in table:  # a stale count: preflight believes the prompts are tiny
        row["prompt_tokens"] = 1
    store.replace(table, "prompts.parquet")
    run = generate(tmp_path / "data", [server.emu.url], 1021, FEW_RETRIES)
    assert run.completed == 2
    rows = duckdb.sql(
        f"select prompt_id, finish_reason, completion_tokens from read_parquet("
        f"'{tmp_path}/data/completions/**/*.parquet') order by prompt_id"
    ).fetchall()
    # the server granted max_req_len - prompt - 1 = 1023 - prompt - 1, not the 1021 the row records
    assert rows == [(pid, "length", 1022 - real[pid]) for pid in sorted(real)]
    outcomes = run_checks(tmp_path / "data", names=["silent_clamp"])
    [clamp] = outcomes
    assert not clamp.passed and clamp.blocking and not gate_passed(outcomes)
    assert clamp.metadata["clamped_rows"] == 2
    assert clamp.summary_md.startswith("2 of 2 rows (100.00%) finished 'length' below their max_output_tokens")


def test_silent_clamp_counts_every_length_row_below_its_cap(defects_dir):
    rows = load(defects_dir, "completions")
    under = [r for r in rows if r["finish_reason"] == "length" and r["completion_tokens"] < r["max_output_tokens"]]
    outcome = check(defects_dir, "silent_clamp")
    assert CHECKS_BY_NAME["silent_clamp"].blocking and outcome.severity == "ERROR"
    assert not outcome.passed and (outcome.metadata["clamped_rows"], outcome.metadata["rows"]) == (
        len(under),
        len(rows),
    )
    assert len(under) == 4
