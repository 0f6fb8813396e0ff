"""Agentic conversations on the emulator (#56): a source of 200 conversations of a coding agent (tool schemas, 1 to 4
tool calls, some two at once) and 5 malformed lines. Every good line is regenerated turn by turn, tool calls
included, with the source's tool results spliced after the target's calls; every malformed line is named; kill -9
mid-conversation loses nothing and repeats nothing; SpecForge's own preprocessing trains each exported assistant
turn once and no tool result."""

import asyncio
import json
import os
import random
import signal
import time

import duckdb
import pytest
import yaml

from dflash_assets.demo.make_agentic import lines
from dflash_assets.emulator import tokenizer as tok
from dflash_assets.emulator import tool_calls
from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.prompts import last_turn_request
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality.training.export import export_training_set
from dflash_assets.settings import DispatchSettings, GenerationSettings
from tests.support import specforge_preprocessing
from tests.support.cli import dflash, start

CONVERSATIONS = 200
ARGS = [
    "--decode-tokens-per-s",
    "3000",
    "--max-running-requests",
    "8",
    "--reasoning-parser",
    "qwen3",
    "--tool-call-parser",
    "qwen25",
    "--length-median",
    "120",
    "--length-sigma",
    "0.5",
]
CAP = 1000
GENERATION = GenerationSettings(max_output_tokens=CAP, regenerate="all_turns")


@pytest.fixture(scope="module")
def fleet_args():
    return ARGS


def source(path) -> list[dict]:
    """The 205 lines, written to `path`; the good ones' records in order."""
    text = lines(CONVERSATIONS)
    path.write_text("\n".join(text) + "\n")
    return [r for r in map(json.loads, text) if not r["id"].startswith("bad-")]


def build(data_dir, urls):
    data_dir.mkdir(parents=True, exist_ok=True)
    src = data_dir.parent / f"{data_dir.name}.jsonl"
    records = source(src)

    async def go():
        async with connected(urls) as fleet:
            return await build_prompt_shard(src, 0, "00000", 1000, data_dir, fleet, {"enable_thinking": True})

    return records, asyncio.run(go())


def generate(data_dir, urls):
    async def go():
        async with connected(urls) as fleet:
            return await generate_shard(
                data_dir,
                "00000",
                fleet,
                GENERATION,
                DispatchSettings(load_sample_s=0, store_token_ids=True),
                log=lambda m: None,
            )

    return asyncio.run(go())


def turn_rows(data_dir) -> list[tuple]:
    """Every committed turn, its calls without their ids (a server draws those at random)."""
    for _ in range(20):  # a run's final compaction may delete a part between the listing and the read: read again
        if not list((data_dir / "completions").glob("**/*.parquet")):
            return []
        try:
            rows = duckdb.sql(
                f"select prompt_id, turn, turns, finish_reason, prompt_tokens, content, tool_calls_json, calls_differ "
                f"from read_parquet('{data_dir}/completions/**/*.parquet', union_by_name = true) order by all"
            ).fetchall()
            return [(*r[:6], [c["function"] for c in json.loads(r[6] or "[]")], r[7]) for r in rows]
        except duckdb.IOException:
            time.sleep(0.05)
    raise AssertionError("the completions could not be read")


@pytest.fixture(scope="module")
def clean(tmp_path_factory, fleet_urls):
    data = tmp_path_factory.mktemp("agentic") / "data"
    records, shard = build(data, fleet_urls)
    run = generate(data, fleet_urls)
    return data, records, shard, run, turn_rows(data)


def test_every_good_line_is_read_and_every_malformed_one_named(clean):
    data, records, shard, _, _ = clean
    assert (shard.lines, shard.prompts, shard.rejected) == (CONVERSATIONS + 5, CONVERSATIONS, 5)
    assert shard.formats == {"messages": 150, "sharegpt": 50}
    reasons = duckdb.sql(
        f"select reason from read_parquet('{data}/rejects/shard=00000/stage=source/*.parquet') order by line"
    ).fetchall()
    assert [r[0] for r in reasons] == [
        "line 4: 'tools' must be a list, got dict",
        "line 44: message 1 calls 'deploy', a tool not in the line's tools "
        "(['git_log', 'read_file', 'run_tests', 'search_code'])",
        "line 84: message 1 tool call 0 (read_file): arguments are not a JSON object",
        "line 124: message 1 is a tool result, but message 0 calls no tool",
        "line 164: message 2: 1 tool result(s) for 2 tool call(s)",
    ]
    # the tool schemas are in every prompt's count: what the server counts for the request with its tools
    prompts = duckdb.sql(
        f"select prompt_id, prompt_tokens, tools_json, messages_json from read_parquet('{data}/prompt_shards/**/*.parquet')"
    ).fetchall()
    assert len(prompts) == CONVERSATIONS and all(tools for _, _, tools, _ in prompts)
    first = prompts[0]
    request = last_turn_request(json.loads(first[3]))
    text = tok.apply_chat_template(request, tools=[tool_calls.tool_dump(t) for t in json.loads(first[2])])
    assert first[1] == len(tok.encode(text)) > len(tok.encode(tok.apply_chat_template(request))) + 300


def test_every_turn_is_the_targets_own_with_the_sources_results_spliced_after_its_calls(clean, fleet_urls):
    data, records, _, run, rows = clean
    assert (run.prompts, run.completed, run.rejected, run.failed) == (CONVERSATIONS, CONVERSATIONS, 0, 0)
    by_id: dict[str, list[tuple]] = {}
    for r in rows:
        by_id.setdefault(r[0], []).append(r)
    assert set(by_id) == {r["id"] for r in records}  # every good line regenerated
    calls = [r[6] for r in rows if r[6]]
    assert len(calls) > 50 and any(len(c) == 2 for c in calls)  # tool-call turns, parallel ones kept whole
    assert all(r[3] == "stop" for r in rows if r[6])  # a tool-call stop is a stop
    # calls_differ: the target's calls (name, arguments) against the source turn's; null where neither called
    sources = dict(
        duckdb.sql(f"select prompt_id, messages_json from read_parquet('{data}/prompt_shards/**/*.parquet')").fetchall()
    )

    def key(functions: list[dict]) -> list[tuple]:
        return [(f["name"], json.loads(f["arguments"])) for f in functions]

    differ = {None: 0, True: 0, False: 0}
    for r in rows:
        said = [m.get("tool_calls") or [] for m in json.loads(sources[r[0]]) if m["role"] == "assistant"]
        source_calls = [c["function"] for c in said[r[1] - 1]] if r[1] <= len(said) else []
        expected = None if not r[6] and not source_calls else key(r[6]) != key(source_calls)
        assert r[7] == expected, (r, source_calls)
        differ[r[7]] += 1
    # the stand-in model's arguments are its own words, never the source's paths: each of its calls differs
    assert differ[True] > 50 and differ[None] > 0 and differ[False] == 0, differ
    assert all("source model's answer" not in r[5] for r in rows)
    source = {r["id"]: r for r in records}
    went_on = [rs for rs in by_id.values() if len(rs) > 1 and rs[0][6]]
    assert went_on, "some conversation should go on after a tool-call turn, on the source's results"
    ended = [rs for rs in by_id.values() if len(rs) < rs[0][2] and rs[-1][3] == "stop"]
    assert ended and run.by_turn[1].get("diverged", 0) > 0  # calls the source had no results for end it there
    for rs in by_id.values():
        assert [r[1] for r in rs] == list(range(1, len(rs) + 1))

    # turn k was sent on the history with the target's turns before it and the source's results after their calls
    async def recount(rs, record) -> list[tuple[int, int]]:
        messages, answers, out = record_messages(record), iter(rs), []
        history: list[dict] = []
        async with connected(fleet_urls) as fleet:
            pending_ids: list[str] = []
            for m in messages:
                if m["role"] == "assistant":
                    r = next(answers, None)
                    if r is None:
                        break
                    count = await fleet.clients[0].count_prompt_tokens(
                        history, {"enable_thinking": True}, record_tools(record)
                    )
                    out.append((count, r[4]))
                    made = [{"id": f"t{r[1]}_{j}", "type": "function", "function": c} for j, c in enumerate(r[6])]
                    history.append({"role": "assistant", "content": r[5], **({"tool_calls": made} if made else {})})
                    pending_ids = [c["id"] for c in made]
                    if r is rs[-1]:
                        break
                elif m["role"] == "tool":
                    history.append({**m, "tool_call_id": pending_ids.pop(0)})
                else:
                    history.append(m)
        return out

    sample = went_on[:8]
    counted = [pair for rs in sample for pair in asyncio.run(recount(rs, source[rs[0][0]]))]
    assert counted and all(expected == served for expected, served in counted)


def record_messages(record: dict) -> list[dict]:
    """A source record's messages as OpenAI messages (its ShareGPT form read back)."""
    if "messages" in record:
        return [{k: v for k, v in m.items() if k != "tool_calls" or v} for m in record["messages"]]
    role = {
        "system": "system",
        "human": "user",
        "gpt": "assistant",
        "observation": "tool",
        "function_call": "assistant",
    }
    return [{"role": role[t["from"]], "content": t["value"]} for t in record["conversations"]]


def record_tools(record: dict) -> list[dict]:
    tools = record["tools"]
    return json.loads(tools) if isinstance(tools, str) else tools


def generate_command(data, urls) -> tuple[str, ...]:
    return (
        "generate",
        "--shard",
        "00000",
        "--urls",
        ",".join(urls),
        "--data-dir",
        str(data),
        "--max-output-tokens",
        str(CAP),
        "--regenerate",
        "all_turns",
        "--commit-rows",
        "3",
        "--commit-seconds",
        "0.2",
        "--load-sample-s",
        "0",
    )


def test_kill_9_mid_conversation_keeps_every_turn_exactly_once_tool_turns_included(tmp_path, clean, fleet_urls):
    data = tmp_path / "data"
    build(data, fleet_urls)
    rng = random.Random(56)
    committed, mid_conversation = [], 0
    for _ in range(3):
        before = len(turn_rows(data))
        proc = start(*generate_command(data, fleet_urls), out=tmp_path / "killed.txt")
        while len(turn_rows(data)) == before and proc.poll() is None:  # killed after it committed something
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        keys = [(r[0], r[1]) for r in turn_rows(data)]
        assert len(keys) == len(set(keys)), "a kill -9 left a turn twice"
        turns: dict[str, list[int]] = {}
        for pid, turn in keys:
            turns.setdefault(pid, []).append(turn)
        assert all(ts == list(range(1, len(ts) + 1)) for ts in turns.values())
        mid_conversation += sum(1 for pid, ts in turns.items() if len(ts) < max(r[2] for r in clean[4] if r[0] == pid))
        committed.append(len(keys))
    assert committed == sorted(committed) and committed[-1] < len(clean[4]), "the kills should interrupt the work"
    assert mid_conversation > 0
    final = dflash(*generate_command(data, fleet_urls))
    assert final.returncode == 0, final.stdout + final.stderr
    assert f"{CONVERSATIONS} prompts = {CONVERSATIONS} completed + 0 rejected + 0 failed" in final.stdout
    assert turn_rows(data) == clean[4]  # the same turns, calls and histories as the uninterrupted run


def trained(export, event: dict) -> tuple[str, int]:
    """What SpecForge's preprocess_conversations puts loss on in one row, its tools read from the row's `tools`
    column as build_eagle3_dataset reads it (json.loads), with the settings written beside the export."""
    data = yaml.safe_load((export.manifest_path.parent / "specforge_data.yaml").read_text())["data"]
    tokenizer = specforge_preprocessing.CharTokenizer()
    out = specforge_preprocessing.preprocess_conversations(
        tokenizer,
        [event["conversations"]],
        specforge_preprocessing.TEMPLATES[data["chat_template"]],
        max_length=10**9,
        train_only_last_turn=data.get("train_only_last_turn", False),
        tools=[json.loads(event["tools"])],
    )
    ids, mask = out["input_ids"][0][0], out["loss_mask"][0][0]
    return tokenizer.decode([i for i, m in zip(ids, mask) if m]), tokenizer.decode(ids).count("<tool_response>")


def test_specforge_trains_each_regenerated_turn_once_and_no_tool_result(clean, tmp_path):
    data, _, _, _, rows = clean
    export = export_training_set(data, tmp_path / "out", max_length=None)
    assert export.manifest["form"] == "per_turn"
    events = [json.loads(line) for line in export.jsonl_path.read_text().splitlines()]
    row_of = {(r[0], r[1]): r for r in rows}
    seen, results_in_prompts = set(), 0
    for event in events:
        pid, turn = event["source_id"].split("@")[0], event["assistant_turn_index"] + 1
        assert (pid, turn) not in seen
        seen.add((pid, turn))
        text, results = trained(export, event)
        results_in_prompts += results
        message = event["conversations"][-1]
        assert "<tool_response>" not in text  # a tool result is never trained
        calls = tool_calls.rendered_calls(message["content"], message.get("tool_calls") or [])
        reasoning = message.get("reasoning_content") or ""
        assert (
            text == f"{reasoning.strip(chr(10))}\n</think>\n\n{message['content'].lstrip(chr(10))}{calls}<|im_end|>\n"
        )
        assert [c["function"] for c in message.get("tool_calls") or []] == row_of[(pid, turn)][6]  # the target's
    assert results_in_prompts > 0  # the source's results are there, in the prompts, unsupervised
    assert len(seen) >= 0.9 * len(rows) and any(row_of[k][6] for k in seen)


def test_the_pretokenized_form_supervises_the_servers_output_ids_only(clean, tmp_path):
    data, _, _, _, _ = clean
    export = export_training_set(data, tmp_path / "out", max_length=None, form="pretokenized")
    samples = [json.loads(line) for line in export.jsonl_path.read_text().splitlines()]
    outputs = dict(
        duckdb.sql(
            f"select prompt_id || '@' || config_hash || '#' || turn, output_ids "
            f"from read_parquet('{data}/completions/**/*.parquet')"
        ).fetchall()
    )
    calls = 0
    for s in samples:
        supervised = [i for i, m in zip(s["input_ids"], s["loss_mask"]) if m]
        assert supervised == list(outputs[s["id"]])
        assert "<tool_response>" not in tok.decode(supervised)
        calls += "<tool_call>" in tok.decode(supervised)
    assert calls > 0 and any("<tool_response>" in tok.decode(s["input_ids"]) for s in samples)


def test_the_tool_calls_check_counts_the_tool_turns_of_the_config_and_passes_well_formed_calls(clean):
    from dflash_assets.quality import run_checks

    data, _, _, run, rows = clean
    (outcome,) = run_checks(data, config_hash=run.config_hash, names=["tool_calls"])
    calls = [c for r in rows for c in r[6]]
    assert outcome.passed and outcome.metadata["tool_call_turns"] == sum(1 for r in rows if r[6])
    assert outcome.metadata["calls"] == len(calls) and outcome.metadata["unknown_tool"] == 0
    assert f"{outcome.metadata['tool_call_turns']:,} turns called {len(calls):,} tools" in outcome.summary_md


def test_a_run_without_streaming_writes_the_same_turns_and_calls(tmp_path, clean, fleet_urls):
    """The calls of a non-streamed reply (message.tool_calls) and of a stream (its deltas) are recorded alike."""
    data = tmp_path / "data"
    data.mkdir()
    src = tmp_path / "data.jsonl"
    src.write_text("\n".join(lines(CONVERSATIONS)[:30]) + "\n")

    async def go():
        async with connected(fleet_urls) as fleet:
            await build_prompt_shard(src, 0, "00000", 1000, data, fleet, {"enable_thinking": True})
            dispatch = DispatchSettings(load_sample_s=0, stream=False)
            return await generate_shard(data, "00000", fleet, GENERATION, dispatch, log=lambda m: None)

    run = asyncio.run(go())
    rows = turn_rows(data)
    ids = {r[0] for r in rows}
    assert run.completed == len(ids) == 29 and any(r[6] for r in rows)  # 30 lines, line 4 malformed
    assert rows == [r for r in clean[4] if r[0] in ids]
