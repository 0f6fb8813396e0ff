"""The streams the client reads (fleet/stream.py), against SGLang 0.5.23's own source in the wheel.

The chunk models are read by AST from entrypoints/openai/protocol.py (as test_contract_sglang_routes.py does);
the /generate events are decoded with the wheel's generated decoders (api/v1/api_types.py, loaded by path);
what the server does around them (the usage chunk only with include_usage, token ids only through sglext,
cumulative /generate events, the abort of a client that goes away) is read from the functions that do it.
"""

from __future__ import annotations

import ast

import msgspec
import pytest

from dflash_assets.demo.make_agentic import TOOLS
from dflash_assets.fleet.stream import ChatChunk, Choice, Delta, GenerateChunk, Usage, Watch, chat_stream_body
from dflash_assets.generation.request import chat_body
from dflash_assets.settings import GenerationSettings
from tests.support.sglang_wheel import class_fields, function

pytestmark = pytest.mark.timeout(120)
PROTOCOL = "entrypoints/openai/protocol.py"


def reads(struct: type, *skip: str) -> set[str]:
    """The fields fleet/stream.py decodes of a chunk: its msgspec Struct's, less those of another shape."""
    return {f.name for f in msgspec.structs.fields(struct)} - set(skip)


# What fleet/stream.py reads from each chunk of a streamed chat completion: model -> fields (the error event,
# `{"error": {...}}`, is a shape of its own)
CHAT_STREAM_READS = {
    "ChatCompletionStreamResponse": reads(ChatChunk, "error"),
    "ChatCompletionResponseStreamChoice": reads(Choice),
    "DeltaMessage": reads(Delta),
    "UsageInfo": reads(Usage),
    "SglExt": {"input_ids", "output_ids"},
}
GENERATE_STREAM_READS = {
    "GenerateResponse": reads(GenerateChunk, "error"),
    "GenerateMetaInfo": {"finish_reason", "completion_tokens"},
}


def source(relative: str, name: str) -> str:
    return ast.unparse(function(relative, name))


@pytest.mark.parametrize("model", sorted(CHAT_STREAM_READS))
def test_every_chunk_field_the_client_reads_is_in_0_5_23s_stream_models(model):
    assert CHAT_STREAM_READS[model] <= class_fields(PROTOCOL, model)


def test_the_streamed_chat_body_has_only_fields_0_5_23_takes():
    body = chat_stream_body(
        chat_body(GenerationSettings(), "m", [{"role": "user", "content": "hi"}], token_ids=True),
        Watch(check_every_tokens=64, looping=bool),
    )
    assert set(body) <= class_fields(PROTOCOL, "ChatCompletionRequest")
    assert set(body["stream_options"]) <= class_fields(PROTOCOL, "StreamOptions")
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "return_token_ids" not in body, "0.5.23 refuses return_token_ids with stream"
    assert body["return_input_ids_in_sglext"] and body["return_output_ids_in_sglext"]


def test_0_5_23_sends_the_usage_chunk_only_when_stream_options_include_usage():
    decide = source("entrypoints/openai/utils.py", "should_include_usage")
    assert "stream_options.include_usage or stream_response_default_include_usage" in decide
    assert "bool(stream_options.continuous_usage_stats)" in decide
    stream = source("entrypoints/openai/serving_chat.py", "_generate_chat_stream")
    assert "should_include_usage(request.stream_options" in stream
    # the usage chunk comes after the finish_reason chunks, with no choices, then [DONE]
    assert (
        stream.index("finish_reason=final_finish_reason")
        < stream.index("if include_usage:")
        < stream.index("usage_chunk = ChatCompletionStreamResponse(")
        < stream.index("yield 'data: [DONE]\\n\\n'")
    )
    assert "choices=[], model=request.model, usage=usage" in stream


def test_0_5_23_refuses_return_token_ids_with_stream_and_sends_ids_through_sglext():
    convert = source("entrypoints/openai/serving_chat.py", "_convert_to_internal_request")
    assert "return_token_ids is not supported with streaming" in convert
    assert "return_output_ids_in_sglext" in source("entrypoints/openai/serving_chat.py", "_should_return_output_ids")


def test_0_5_23s_generate_stream_is_data_lines_of_cumulative_answers_then_done():
    serve = source("entrypoints/http_server.py", "serve_generate_request")
    assert "yield (b'data: ' + dumps_json(out) + b'\\n\\n')" in serve
    assert "yield b'data: [DONE]\\n\\n'" in serve
    handle = source("managers/tokenizer_manager.py", "_handle_batch_output")
    # without --incremental-streaming-output every event holds the ids so far (the client replaces, not appends)
    assert "'output_ids': state.output_ids" in handle and "'output_ids': delta_output_ids" not in handle
    assert "output_token_ids = delta_output_ids" in handle  # with it, a delta


def test_0_5_23_aborts_a_streamed_request_whose_client_goes_away():
    wait = source("managers/tokenizer_manager.py", "_stream_one_response")
    assert "await request.is_disconnected()" in wait and "self.abort_request(obj.rid)" in wait
    assert "self.abort_request(rid)" in source("managers/tokenizer_manager.py", "_release_req_states_on_failure")
    assert "create_abort_task(adapted_request)" in source(
        "entrypoints/openai/serving_chat.py", "_handle_streaming_request"
    )


def streamed_bodies(server) -> list[dict]:
    """A tool-free request, and one with tools whose answer calls them (the stand-in model draws it per prompt)."""
    bodies = []
    for k in range(40):
        messages = [{"role": "user", "content": "hi" if k == 0 else f"task {k}: read the cache module"}]
        generation = GenerationSettings(max_output_tokens=1024)
        body = chat_body(generation, "m", messages, token_ids=True, tools=None if k == 0 else TOOLS)
        if k == 0 or server.post("/v1/chat/completions", body)[1]["choices"][0]["finish_reason"] == "tool_calls":
            bodies.append(chat_stream_body(body, Watch(check_every_tokens=8, looping=bool)))
        if len(bodies) == 2:
            return bodies
    raise AssertionError("no prompt of 40 made a tool call")


def test_the_emulators_chat_stream_is_0_5_23s_chunks_with_every_field_the_client_reads(emulator):
    server = emulator(
        "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25", "--length-median", "40", "--stream-interval", "4"
    )
    seen: dict[str, set] = {m: set() for m in CHAT_STREAM_READS}
    finishes = []
    for body in streamed_bodies(server):
        status, events = server.sse("/v1/chat/completions", body)
        assert status == 200 and events[-1] == "[DONE]"
        chunks = events[:-1]
        for c in chunks:
            assert (
                set(c) <= class_fields(PROTOCOL, "ChatCompletionStreamResponse")
                and c["object"] == "chat.completion.chunk"
            )
            seen["ChatCompletionStreamResponse"] |= {k for k, v in c.items() if v is not None}
            for choice in c["choices"]:
                assert set(choice) <= class_fields(PROTOCOL, "ChatCompletionResponseStreamChoice")
                assert set(choice["delta"]) <= class_fields(PROTOCOL, "DeltaMessage")
                seen["ChatCompletionResponseStreamChoice"] |= set(choice)
                seen["DeltaMessage"] |= {k for k, v in choice["delta"].items() if v}
                for call in choice["delta"].get("tool_calls") or ():
                    assert set(call) <= class_fields(PROTOCOL, "ToolCall")
                    assert set(call["function"]) <= class_fields(PROTOCOL, "FunctionResponse")
            if c.get("usage"):
                assert set(c["usage"]) <= class_fields(PROTOCOL, "UsageInfo")
                seen["UsageInfo"] |= set(c["usage"])
            if c.get("sglext"):
                assert set(c["sglext"]) <= class_fields(PROTOCOL, "SglExt")
                seen["SglExt"] |= set(c["sglext"])
        # the first chunk carries the role; usage (continuous) on content chunks; the last one is the usage chunk
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
        finish = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert len(finish) == 1
        finishes.append(finish[0]["finish_reason"])
    for model, fields in CHAT_STREAM_READS.items():
        assert fields <= seen[model], (model, fields - seen[model])
    assert finishes[0] in ("stop", "length") and finishes[1] == "tool_calls"


def test_without_include_usage_no_usage_chunk_comes(emulator):
    server = emulator("--reasoning-parser", "qwen3", "--length-median", "20")
    body = {
        **chat_body(GenerationSettings(max_output_tokens=32), "m", [{"role": "user", "content": "hi"}]),
        "stream": True,
    }
    _, events = server.sse("/v1/chat/completions", body)
    assert all(e == "[DONE]" or e.get("usage") is None for e in events)


def test_the_emulators_generate_stream_decodes_with_0_5_23s_own_decoder(api, emulator):  # noqa: F811
    server = emulator("--length-median", "40", "--stream-interval", "3")
    body = {
        "input_ids": [300, 301, 302],
        "sampling_params": {"max_new_tokens": 48, **GenerationSettings().sampling()},
        "stream": True,
    }
    status, events = server.sse("/generate", body)
    assert status == 200 and events[-1] == "[DONE]"
    decoded = [api.GenerateResponse.from_json_value(e) for e in events[:-1]]
    for e, d in zip(events[:-1], decoded):
        assert GENERATE_STREAM_READS["GenerateResponse"] <= set(e)
        assert GENERATE_STREAM_READS["GenerateMetaInfo"] <= set(e["meta_info"])
        assert len(d.output_ids) == d.meta_info.completion_tokens, "cumulative: every event holds the ids so far"
    assert [d.meta_info.finish_reason is None for d in decoded] == [True] * (len(decoded) - 1) + [False]
    # the first token alone, then one event every --stream-interval tokens
    counts = [d.meta_info.completion_tokens for d in decoded]
    assert counts[:3] == [1, 4, 7]


def test_a_generate_stream_error_decodes_with_0_5_23s_own_decoder(api, emulator):  # noqa: F811
    server = emulator("--context-length", "64")
    _, events = server.sse("/generate", {"input_ids": [300] * 80, "stream": True})
    error = api.GenerateStreamError.from_json_value(events[0])
    assert error.error.code == 400 and "longer than the model's context length" in error.error.message
