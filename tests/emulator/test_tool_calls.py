"""Tool calls on the emulator as SGLang 0.5.23 serves them, against the wheel's own source (protocol.py,
serving_chat.py, function_call/): the `--tool-call-parser` names, the template's tools, `message.tool_calls`,
`finish_reason: "tool_calls"`, the stream's tool-call deltas, and /v1/tokenize counting the tools."""

from __future__ import annotations

import json
import re

import pytest

from dflash_assets.demo.make_agentic import TOOLS
from dflash_assets.emulator import tokenizer as tok
from dflash_assets.emulator import tool_calls
from tests.support.sglang_wheel import class_fields, sglang_srt

pytestmark = pytest.mark.timeout(60)

TASK = [{"role": "system", "content": "You are a coding agent."}]
PARSER = ("--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25", "--length-median", "80")


def test_the_emulated_parsers_are_sglangs_names_for_qwens_tool_call_blocks():
    srt = sglang_srt()
    names = (srt / "function_call" / "parser_names.py").read_text()
    enum = (srt / "function_call" / "function_call_parser.py").read_text()
    for name in tool_calls.PARSERS:
        assert f'"{name}",' in names
    assert (
        '"qwen": Qwen25Detector' in enum and '"qwen25": Qwen25Detector' in enum and '"hermes": HermesDetector' in enum
    )
    detector = (srt / "function_call" / "qwen25_detector.py").read_text()
    assert 'self.bot_token = "<tool_call>\\n"' in detector and tool_calls.CALL_OPEN == "<tool_call>\n"
    assert 'self.eot_token = "\\n</tool_call>"' in detector and tool_calls.CALL_CLOSE == "\n</tool_call>"
    assert "normal_text = text[:idx].strip() if idx != -1 else text" in detector  # the content before the call


def test_sglang_renames_a_stop_with_calls_and_gives_each_call_a_random_id():
    chat = (sglang_srt() / "entrypoints" / "openai" / "serving_chat.py").read_text()
    assert 'if finish_reason["type"] == "stop":\n                        finish_reason["type"] = "tool_calls"' in chat
    assert 'tool_call_id = f"call_{uuid.uuid4().hex[:24]}"' in chat
    assert "delta=DeltaMessage(tool_calls=[tool_call])" in chat  # the stream's tool-call deltas
    base = (sglang_srt() / "function_call" / "base_format_detector.py").read_text()
    assert (
        "parameters=json.dumps(\n                        act.get(\"parameters\") or act.get(\"arguments\", {}),\n                        ensure_ascii=False,"
        in base
    )


def test_the_routes_the_pipeline_calls_take_tools():
    relative = "entrypoints/openai/protocol.py"
    assert {"tools", "tool_choice"} <= class_fields(relative, "ChatCompletionRequest")
    assert {"tools", "tool_choice"} <= class_fields(relative, "TokenizeRequest")  # preflight counts the schemas
    assert "tool_calls" in class_fields(relative, "ChatMessage") and "tool_calls" in class_fields(
        relative, "DeltaMessage"
    )
    assert {"id", "index", "type", "function"} <= class_fields(relative, "ToolCall")


def _calling(http, stream: bool = False):
    """A prompt whose answer calls a tool (the stand-in model draws it from the prompt): the first of a few."""
    for k in range(40):
        body = {"messages": TASK + [{"role": "user", "content": f"Task {k}: look at the cache."}], "tools": TOOLS}
        status, reply = http.post("/v1/chat/completions", {**body, "max_tokens": 4000})
        assert status == 200
        if reply["choices"][0]["finish_reason"] == "tool_calls":
            return body, reply
    raise AssertionError("no prompt of 40 made a tool call")


def test_a_call_comes_back_as_message_tool_calls_with_finish_tool_calls(emulator):
    http = emulator(*PARSER)
    body, reply = _calling(http)
    message = reply["choices"][0]["message"]
    assert message["content"] == "" and message["reasoning_content"]
    names = {t["function"]["name"] for t in TOOLS}
    for k, call in enumerate(message["tool_calls"]):
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["index"] == k and call["type"] == "function"
        assert call["function"]["name"] in names and isinstance(json.loads(call["function"]["arguments"]), dict)
    assert reply["choices"][0]["matched_stop"] is None
    # without the parser the same answer is text: the call stays in content
    plain = emulator("--reasoning-parser", "qwen3", "--length-median", "80")
    other = plain.post("/v1/chat/completions", {**body, "max_tokens": 4000})[1]["choices"][0]
    assert other["finish_reason"] == "stop" and other["message"]["content"].lstrip().startswith("<tool_call>\n{")
    assert "tool_calls" not in other["message"]


def test_the_stream_sends_the_calls_as_deltas_that_assemble_to_the_message(emulator):
    http = emulator(*PARSER)
    body, reply = _calling(http)
    status, events = http.sse("/v1/chat/completions", {**body, "max_tokens": 4000, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in events[:-1] if c["choices"]]
    calls: dict[int, dict] = {}
    for d in deltas:
        for call in d.get("tool_calls") or ():
            entry = calls.setdefault(call["index"], {"arguments": ""})
            entry["name"] = call["function"]["name"] or entry.get("name")
            entry["id"] = call["id"] or entry.get("id")
            entry["arguments"] += call["function"]["arguments"]
    whole = reply["choices"][0]["message"]["tool_calls"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole
    ]
    # the call text is not sent as content; the text before it is, as it comes (the reply strips it: the client too)
    assert "".join(d.get("content") or "" for d in deltas).strip() == reply["choices"][0]["message"]["content"] == ""
    assert [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]][-1] == "tool_calls"


def test_tokenize_counts_the_tools_as_the_chat_renders_them(emulator):
    http = emulator(*PARSER)
    messages = TASK + [{"role": "user", "content": "Where is the timeout set?"}]
    without = http.post("/v1/tokenize", {"messages": messages})[1]["count"]
    counted = http.post("/v1/tokenize", {"messages": messages, "tools": TOOLS})[1]["count"]
    served = http.post("/v1/chat/completions", {"messages": messages, "tools": TOOLS, "max_tokens": 4})[1]
    assert counted == served["usage"]["prompt_tokens"] > without
    # the schemas are in the system turn, one JSON a line, as Qwen3's template puts them
    text = tok.apply_chat_template(messages, tools=[tool_calls.tool_dump(t) for t in TOOLS])
    assert len(tok.encode(text)) == counted and text.count("\n{\"type\": \"function\"") == len(TOOLS)
    # tool_choice "none" leaves the tools out of the template
    none = http.post("/v1/tokenize", {"messages": messages, "tools": TOOLS, "tool_choice": "none"})[1]["count"]
    assert none == without


def test_malformed_tools_are_refused_as_a_validation_error(emulator):
    status, body = emulator(*PARSER).post(
        "/v1/chat/completions", {"messages": TASK + [{"role": "user", "content": "x"}], "tools": [{"name": "x"}]}
    )
    assert status == 400 and body["type"] == "Bad Request" and "('body', 'tools')" in body["message"]
