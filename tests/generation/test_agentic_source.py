"""Reading agentic sources (#56): tool schemas, assistant tool calls and tool results, in OpenAI's shape and in
ShareGPT's tool speakers; a malformed line named with its line and reason; a tool-free source unchanged."""

import asyncio
import hashlib
import json

import pytest

from dflash_assets.demo.make_agentic import DEFAULT_PATH, TOOLS, conversation, lines, sharegpt
from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.prompts import Prompt, parse_record, read_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.generation.tools import calls_differ
from dflash_assets.generation.turns import split_turns, turns_of
from dflash_assets.quality.training.export import export_training_set
from dflash_assets.settings import DEMO_PROMPTS, DispatchSettings, GenerationSettings
from tests.support.forks import start_emulator

CALL = {"id": "a", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "src/cache.py"}'}}
LINE = {
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "Why do the cache tests fail?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "b"}]},
        {"role": "tool", "tool_call_id": "a", "content": "def evict(self): ..."},
        {"role": "tool", "tool_call_id": "b", "content": "def evict(self): ..."},
        {"role": "assistant", "content": "The eviction is off by one."},
    ],
}


def test_an_openai_tool_line_keeps_its_schemas_its_parallel_calls_and_their_results():
    prompt = parse_record(LINE, 1, "src")
    assert isinstance(prompt, Prompt) and prompt.tools == TOOLS and json.loads(prompt.tools_json) == TOOLS
    calls = prompt.messages[1]
    assert calls["content"] == "" and [c["id"] for c in calls["tool_calls"]] == ["a", "b"]  # content may be null
    assert [m["tool_call_id"] for m in prompt.messages[2:4]] == ["a", "b"]
    # all_turns: a turn per assistant message, the second requested after the two results
    system, groups = split_turns(prompt.messages)
    assert system == [] and [[m["role"] for m in g] for g in groups] == [["user"], ["tool", "tool"]]
    turns = turns_of(prompt.messages, GenerationSettings(regenerate="all_turns"), prompt.tools)
    answer = {"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": "x"}, {**CALL, "id": "y"}]}
    history = turns.history(2, [answer])
    assert [m.get("tool_call_id") for m in history[2:]] == ["x", "y"]  # the source's results, after the target's calls
    assert not turns.ends_after(1, answer) and turns.ends_after(1, {**answer, "tool_calls": [CALL]})
    assert turns.ends_after(1, "an answer without calls")  # the source has results for calls it did not make


def test_sharegpts_function_call_and_observation_read_as_the_same_conversation():
    record = conversation(7, __import__("random").Random(3))
    openai, shared = parse_record(record, 1, "s"), parse_record(sharegpt(record), 2, "s")
    assert isinstance(openai, Prompt) and isinstance(shared, Prompt) and shared.format == "sharegpt"
    strip = lambda ms: [  # noqa: E731  ids: ShareGPT's calls have none, numbered call_<n> in order
        {k: v for k, v in m.items() if k != "tool_call_id"}
        | ({"tool_calls": [c["function"] for c in m["tool_calls"]]} if m.get("tool_calls") else {})
        for m in ms
    ]
    assert strip(shared.messages) == strip(openai.messages) and shared.tools == openai.tools


def test_malformed_tool_lines_are_named_with_their_line_and_reason_and_the_rest_goes_on():
    items = list(read_shard(DEFAULT_PATH, 0, 1000))  # the bundled agentic set: 40 conversations, 5 malformed
    assert DEFAULT_PATH.read_text().splitlines() == lines(40)  # as make_agentic writes it
    assert sum(isinstance(i, Prompt) for i in items) == 40
    assert [i.reason for i in items if not isinstance(i, Prompt)] == [
        "line 4: 'tools' must be a list, got dict",
        "line 12: message 1 calls 'deploy', a tool not in the line's tools "
        "(['git_log', 'read_file', 'run_tests', 'search_code'])",
        "line 20: message 1 tool call 0 (read_file): arguments are not a JSON object",
        "line 28: message 1 is a tool result, but message 0 calls no tool",
        "line 36: message 2: 1 tool result(s) for 2 tool call(s)",
    ]
    unanswered = {"messages": LINE["messages"][:2] + [{"role": "user", "content": "and?"}]}
    assert parse_record(unanswered, 9, "s").reason == (
        "line 9: message 1 calls tools but message 2 is from the user, not a tool result"
    )
    wrong_id = {"messages": LINE["messages"][:2] + [{**LINE["messages"][2], "tool_call_id": "z"}]}
    assert "tool_call_id 'z' answers none of the calls before it (['a', 'b'])" in parse_record(wrong_id, 9, "s").reason


def test_calls_differ_by_name_and_arguments_in_order_and_is_null_where_neither_calls():
    other = {**CALL, "id": "x", "function": {"name": "read_file", "arguments": '{"path":"src/cache.py"}'}}
    assert calls_differ([other], [CALL]) is False  # the same call, whatever its id and spacing
    assert calls_differ([CALL], [{**CALL, "function": {"name": "run_tests", "arguments": "{}"}}]) is True
    assert calls_differ([], [CALL]) is True and calls_differ([CALL, CALL], [CALL]) is True
    assert calls_differ([], []) is None


# measured on the code before agentic sources existed (fabfae7): the same config hash, the same bytes in every form
TOOL_FREE = {
    "config": "03ecd2d21956",
    "per_turn": ("66dd91c8f4ec9c50", "a05c592ca6988fc7"),
    "conversations": ("5bcb2106e3c85b01", "ccd8b09885849dad"),
    "pretokenized": ("fcf69b1f955e3391", "2ac4a921d81660ff"),
}


@pytest.mark.timeout(120)
def test_a_tool_free_source_keeps_its_config_hash_and_the_bytes_of_every_export_form(tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(DEMO_PROMPTS.read_text().splitlines(keepends=True)[:60]))
    data = tmp_path / "data"
    flags = ["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25", "--length-median", "150"]
    with start_emulator([*flags, "--decode-tokens-per-s", "5000", "--random-seed", "7"]) as emu:

        async def go():
            async with connected([emu.url]) as fleet:
                await build_prompt_shard(src, 0, "00000", 60, data, fleet, {"enable_thinking": True})
                generation = GenerationSettings(max_output_tokens=400, cap_policy="fixed", regenerate="all_turns")
                dispatch = DispatchSettings(load_sample_s=0, store_token_ids=True)
                return await generate_shard(data, "00000", fleet, generation, dispatch, log=lambda m: None)

        run = asyncio.run(go())
    assert run.config_hash == TOOL_FREE["config"]
    for form in ("per_turn", "conversations", "pretokenized"):
        export = export_training_set(data, tmp_path / form, max_length=2048, form=form)
        assert "tools" not in export.jsonl_path.read_text()
        digests = tuple(
            hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in (export.jsonl_path, export.parquet_path)
        )
        assert digests == TOOL_FREE[form], form


def test_the_tool_calls_check_fails_on_a_call_to_an_unknown_tool_or_arguments_that_are_not_json(tmp_path):
    from tests.support.quality_data import CONFIG_A, check, completion, prompt, write

    prompts = [prompt("s0", i, 50, "agent") | {"tools_json": json.dumps(TOOLS)} for i in range(4)]
    deploy = {**CALL, "function": {"name": "deploy", "arguments": "{}"}}
    broken = {**CALL, "function": {"name": "read_file", "arguments": "{path: x"}}
    calls = [[CALL], [CALL, deploy], [broken], None]
    rows = [
        completion(p, CONFIG_A, 20, content="" if c else "An answer.", tool_calls_json=json.dumps(c) if c else None)
        for p, c in zip(prompts, calls)
    ]
    write(tmp_path, "prompt_shards", "s0", prompts)
    write(tmp_path, "completions", "s0", rows)
    outcome = check(tmp_path, "tool_calls")
    assert not outcome.passed and outcome.severity == "WARN"
    assert {k: outcome.metadata[k] for k in ("tool_call_turns", "calls", "unknown_tool", "arguments_not_json")} == {
        "tool_call_turns": 3,
        "calls": 4,
        "unknown_tool": 1,
        "arguments_not_json": 1,
    }
    assert outcome.summary_md.splitlines()[0] == "2 of 4 tool calls are malformed."
    assert check(tmp_path, "empty_content").passed  # a turn of calls answers with its calls, not its content
    write(tmp_path, "completions", "s0", rows[3:])
    assert check(tmp_path, "tool_calls").summary_md == "Not applicable: no row called a tool."


def test_a_fleet_without_a_tool_call_parser_is_refused_before_anything_is_sent(tmp_path):
    from dflash_assets.generation.preflight import PreflightError

    src = tmp_path / "src.jsonl"
    src.write_text("\n".join(lines(6)) + "\n")
    data = tmp_path / "data"
    with start_emulator(["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "5000"]) as emu:

        async def go():
            async with connected([emu.url]) as fleet:
                await build_prompt_shard(src, 0, "00000", 100, data, fleet, {"enable_thinking": True})
                generation = GenerationSettings(max_output_tokens=400, regenerate="all_turns")
                await generate_shard(data, "00000", fleet, generation, DispatchSettings(), log=lambda m: None)

        with pytest.raises(PreflightError) as refused:
            asyncio.run(go())
    assert str(refused.value) == (
        f"the prompts carry tool schemas but {emu.url} run without --tool-call-parser: their tool calls would stay "
        "text in `content`. Nothing was sent. Start the servers with --tool-call-parser (qwen25 for Qwen models) and "
        "run again."
    )
    assert not list((data / "completions").glob("**/*.parquet"))
