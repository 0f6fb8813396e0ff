"""The emulator over real HTTP: SGLang 0.5.23's routes, shapes, context rules,
error bodies, auth and reasoning split."""

from __future__ import annotations

import pytest

from dflash_assets.emulator import tokenizer as tok

pytestmark = pytest.mark.timeout(60)

MSGS = [{"role": "user", "content": "Explain the water cycle."}]


def chat(http, **extra):
    return http.post("/v1/chat/completions", {"model": "m", "messages": MSGS, **extra})


def prompt_of_length(http, n: int) -> list[int]:
    """Chat-template ids padded with filler words to exactly n tokens."""
    base = http.post("/v1/tokenize", {"messages": MSGS})[1]["tokens"]
    head, tail = base[:-6], base[-6:]
    return head + [tok.VOCAB[" the"]] * (n - len(base)) + tail


# ---- health, info, models, loads ----


def test_health_ready_and_health_generate_answer_200(emulator):
    http = emulator()
    for path in ("/health", "/health_generate", "/ready"):
        assert http.get(path) == (200, "")


def test_v1_models_reports_the_effective_context_length(emulator):
    http = emulator("--context-length", "8k", "--served-model-name", "qwen-emu")
    status, body = http.get("/v1/models")
    assert status == 200 and body["object"] == "list"
    card = body["data"][0]
    assert card["id"] == "qwen-emu" and card["root"] == "qwen-emu" and card["owned_by"] == "sglang"
    assert card["max_model_len"] == 8000 and card["parent"] is None


def test_unknown_model_card_is_404_model_not_found(emulator):
    status, body = emulator().get("/v1/models/other")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert body["error"]["message"] == "The model 'other' does not exist"


def test_model_info_has_no_context_length(emulator):
    status, body = emulator("--reasoning-parser", "qwen3").get("/model_info")
    assert status == 200 and body["model_path"] == "emulated/qwen3-27b" and body["is_generation"] is True
    assert body["reasoning_parser"] == "qwen3" and "context_length" not in body


def test_server_info_reports_configured_args_and_the_scheduler_handshake(emulator):
    http = emulator("--max-running-requests", "16", "--max-total-tokens", "100000", "--tp", "2")
    status, info = http.get("/server_info")
    assert status == 200 and info["version"] == "0.5.23"
    assert info["context_length"] is None  # configured value: null unless passed
    assert info["max_running_requests"] == 16 and info["tp_size"] == 2
    assert info["max_total_num_tokens"] == 100000
    assert info["max_req_input_len"] == min(32768 - 1, 100000 - 1) - 5
    state = info["internal_states"][0]
    assert state["effective_max_running_requests_per_dp"] == 16 and "last_gen_throughput" in state
    assert info["launch_command"].startswith("--model-path emulated/qwen3-27b")


def test_max_running_requests_is_capped_by_the_mamba_state_cache(emulator):
    http = emulator("--max-running-requests", "40", "--max-mamba-cache-size", "80")
    info = http.get("/server_info")[1]
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 80 // 3
    assert http.get("/v1/loads")[1]["loads"][0]["max_running_requests"] == 26


def test_v1_loads_has_sglang_core_keys_and_sections(emulator):
    http = emulator()
    status, body = http.get("/v1/loads")
    assert status == 200 and body["version"] == "0.5.23" and body["num_accelerators"] == 1
    load = body["loads"][0]
    for key in (
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "max_total_num_tokens",
        "max_running_requests",
        "token_usage",
        "gen_throughput",
        "utilization",
    ):
        assert key in load
    assert {"memory", "disaggregation", "queues"} <= set(load)
    core = http.get("/v1/loads?include=core")[1]["loads"][0]
    assert "memory" not in core and "num_running_reqs" in core
    status, body = http.get("/v1/loads?include=bogus")
    assert status == 400 and body["object"] == "error" and "Invalid include sections" in body["message"]


# ---- tokenize ----


def test_tokenize_messages_counts_exactly_the_chat_prompt(emulator):
    http = emulator()
    for kwargs, thinking in (({}, True), ({"chat_template_kwargs": {"enable_thinking": False}}, False)):
        status, body = http.post("/v1/tokenize", {"model": "m", "messages": MSGS, **kwargs})
        assert status == 200
        assert body["tokens"] == tok.encode(tok.apply_chat_template(MSGS, enable_thinking=thinking))
        assert body["count"] == len(body["tokens"])
        usage = chat(http, max_tokens=5, **kwargs)[1]["usage"]
        assert usage["prompt_tokens"] == body["count"]


def test_tokenize_max_model_len_is_the_tokenizers_not_the_served_context(emulator):
    body = emulator("--context-length", "4096").post("/v1/tokenize", {"prompt": "hi"})[1]
    assert body["max_model_len"] == 32768


def test_tokenize_prompt_string_and_list(emulator):
    http = emulator()
    assert http.post("/v1/tokenize", {"prompt": "hello world"})[1]["count"] == 2
    body = http.post("/v1/tokenize", {"prompt": ["hello", "hello world"]})[1]
    assert body["count"] == [1, 2] and len(body["tokens"]) == 2


def test_tokenize_needs_exactly_one_of_prompt_or_messages(emulator):
    status, body = emulator().post("/v1/tokenize", {"prompt": "a", "messages": MSGS})
    assert status == 400 and body["type"] == "Bad Request"
    assert "Exactly one of 'prompt' or 'messages' must be provided." in body["message"]


def test_detokenize_inverts_tokenize(emulator):
    http = emulator()
    ids = http.post("/v1/tokenize", {"prompt": "Hello there, world."})[1]["tokens"]
    assert http.post("/v1/detokenize", {"tokens": ids}) == (200, {"text": "Hello there, world."})


# ---- /generate ----


def test_generate_returns_text_output_ids_and_meta_info(emulator):
    http = emulator()
    status, body = http.post(
        "/generate", {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 16}, "rid": "r1"}
    )
    assert status == 200 and set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 16}
    assert meta["completion_tokens"] == len(body["output_ids"]) == 16
    assert meta["prompt_tokens"] == len(tok.encode("Once upon a time"))
    assert meta["cached_tokens"] == 0 and meta["reasoning_tokens"] == 0 and meta["e2e_latency"] >= 0
    assert tok.decode(body["output_ids"]) == body["text"]


def test_generate_without_max_new_tokens_stops_at_128(emulator):
    body = emulator("--length-median", "5000", "--length-sigma", "0.01").post("/generate", {"text": "x"})[1]
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 128}


def test_generate_natural_stop_reports_the_im_end_token(emulator):
    http = emulator("--length-median", "40", "--length-sigma", "0.01")
    text = tok.apply_chat_template(MSGS)
    body = http.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 1000}})[1]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok.IM_END_ID}
    assert body["output_ids"][-1] == tok.IM_END_ID and "<|im_end|>" not in body["text"]


def test_generate_unknown_sampling_key_is_400_with_sglangs_message(emulator):
    status, body = emulator().post("/generate", {"text": "x", "sampling_params": {"max_tokens": 8}})
    assert status == 400 and isinstance(body["error"], str)
    assert body["error"].startswith("unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`,")


def test_generate_wrong_type_is_400_with_sglangs_message(emulator):
    status, body = emulator().post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "8"}})
    assert (status, body) == (400, {"error": 'invalid type: string "8", expected i64'})


def test_generate_without_a_prompt_is_400(emulator):
    status, body = emulator().post("/generate", {"sampling_params": {"max_new_tokens": 8}})
    assert (status, body) == (400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}})


def test_generate_batch_and_n_return_lists(emulator):
    http = emulator()
    body = http.post("/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 4}})[1]
    assert isinstance(body, list) and len(body) == 2
    body = http.post("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 4, "n": 3}})[1]
    assert len(body) == 3 and body[0]["output_ids"] != body[1]["output_ids"]


# ---- context-length rules (reference §3) ----


def test_prompt_longer_than_context_is_400_on_generate_and_chat(emulator):
    http = emulator("--context-length", "256")
    ids = prompt_of_length(http, 300)
    msg = "The input (300 tokens) is longer than the model's context length (256 tokens)."
    assert http.post("/generate", {"input_ids": ids}) == (400, {"error": {"message": msg}})
    status, body = http.post("/v1/chat/completions", {"messages": MSGS, "input_ids": ids})
    assert status == 400
    assert body == {"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": 400}


def test_prompt_plus_max_new_tokens_over_context_is_400(emulator):
    http = emulator("--context-length", "1024")
    n = len(http.post("/v1/tokenize", {"messages": MSGS})[1]["tokens"])
    msg = (
        "Requested token count exceeds the model's maximum context length of 1024 tokens. "
        f"You requested a total of {n + 1020} tokens: {n} tokens from the input messages and 1020 tokens "
        "for the completion. Please reduce the number of tokens in the input messages or the completion "
        "to fit within the limit."
    )
    ids = http.post("/v1/tokenize", {"messages": MSGS})[1]["tokens"]
    assert http.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1020}}) == (
        400,
        {"error": {"message": msg}},
    )
    status, body = chat(http, max_tokens=1020)
    assert status == 400 and body["message"] == msg and body["type"] == "BadRequestError"
    status, body = http.post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1020, "stream": True})
    assert status == 400 and body["message"] == msg  # kick-started: a real 400 before any SSE


def test_streaming_generate_reports_context_errors_inside_a_200_stream(emulator):
    http = emulator("--context-length", "256")
    status, events = http.sse("/generate", {"input_ids": prompt_of_length(http, 300), "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert events[0] == {
        "error": {
            "message": "The input (300 tokens) is longer than the model's context length (256 tokens).",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }


def test_max_completion_tokens_above_context_is_refused_only_when_context_length_is_configured(emulator):
    status, body = chat(emulator("--context-length", "2048"), max_completion_tokens=4096)
    assert status == 400 and body["type"] == "BadRequestError"
    assert (
        body["message"]
        == "max_completion_tokens is too large: 4096.This model supports at most 2048 completion tokens."
    )
    status, body = chat(emulator(), max_completion_tokens=40000)  # context from the model config: tokenizer check
    assert status == 400 and body["message"].startswith("Requested token count exceeds")


def test_the_scheduler_silently_clamps_the_last_tokens_of_the_context(emulator):
    http = emulator("--context-length", "1024", "--length-median", "5000", "--length-sigma", "0.01")
    ids = prompt_of_length(http, 500)
    status, body = http.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 524}})
    assert status == 200  # prompt + max_new == context passes the tokenizer check (>)...
    max_req_len = 1024 - 1
    assert body["meta_info"]["completion_tokens"] == max_req_len - 500 - 1  # ...then 2 tokens go silently
    assert body["meta_info"]["finish_reason"]["type"] == "length"


def test_prompt_in_the_reserved_tail_of_the_context_is_an_input_length_400(emulator):
    http = emulator("--context-length", "1024")
    max_req_input_len = 1024 - 1 - 5
    msg = (
        f"Input length ({max_req_input_len + 2} tokens) exceeds the maximum allowed length "
        f"({max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
    )
    ids = prompt_of_length(http, max_req_input_len + 2)
    assert http.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}) == (
        400,
        {"error": {"message": msg}},
    )
    status, body = http.post("/v1/chat/completions", {"messages": MSGS, "input_ids": ids, "max_tokens": 1})
    assert status == 400 and body["message"] == msg and body["type"] == "BadRequestError"


def test_a_small_kv_pool_shrinks_max_req_input_len(emulator):
    http = emulator("--max-total-tokens", "600")
    assert http.get("/server_info")[1]["max_req_input_len"] == 600 - 1 - 5
    status, body = http.post("/generate", {"input_ids": prompt_of_length(http, 700)})
    assert status == 400 and body["error"]["message"].startswith("Input length (700 tokens) exceeds")


def test_auto_truncate_keeps_the_prompt_head_and_cuts_max_new_tokens(emulator):
    http = emulator(
        "--context-length", "1024", "--allow-auto-truncate", "--length-median", "5000", "--length-sigma", "0.01"
    )
    ids = prompt_of_length(http, 1100)
    body = http.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 50}})[1]
    # tokenizer keeps the first 1024, the scheduler the first max_req_input_len; no room to generate
    assert body["meta_info"]["prompt_tokens"] == 1024 - 1 - 5
    status, body = chat(http, max_tokens=2000)
    assert status == 200 and body["usage"]["completion_tokens"] == 1024 - 1 - body["usage"]["prompt_tokens"] - 1


# ---- chat completions ----


def test_chat_response_shape(emulator):
    status, body = chat(emulator("--reasoning-parser", "qwen3"), max_tokens=64, rid="abc")
    assert status == 200 and body["object"] == "chat.completion" and body["model"] == "m" and body["id"] == "abc"
    choice = body["choices"][0]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason", "matched_stop"}
    assert set(choice["message"]) == {"role", "content", "reasoning_content"}
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert set(usage) == {
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "reasoning_tokens",
        "completion_tokens_details",
    }
    assert body["metadata"] == {"weight_version": "default"}


def test_reasoning_parser_splits_at_think_end(emulator):
    http = emulator("--reasoning-parser", "qwen3", "--length-median", "300", "--length-sigma", "0.01")
    body = chat(http, max_tokens=2000)[1]
    choice, usage = body["choices"][0], body["usage"]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == tok.IM_END_ID
    msg = choice["message"]
    assert msg["reasoning_content"] and msg["content"].startswith("\n\n") and "</think>" not in msg["content"]
    assert usage["reasoning_tokens"] == len(tok.encode(msg["reasoning_content"])) + 1  # + </think>
    assert usage["completion_tokens_details"] == {"reasoning_tokens": usage["reasoning_tokens"]}


def test_without_a_reasoning_parser_the_think_block_stays_in_content(emulator):
    body = chat(emulator("--length-median", "300", "--length-sigma", "0.01"), max_tokens=2000)[1]
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] is None and "</think>\n\n" in msg["content"]
    assert "<think>" not in msg["content"]  # the template pre-opened it
    assert body["usage"]["reasoning_tokens"] == 0 and body["usage"]["completion_tokens_details"] is None


def test_separate_reasoning_false_keeps_raw_text(emulator):
    body = chat(
        emulator("--reasoning-parser", "qwen3", "--length-median", "300", "--length-sigma", "0.01"),
        max_tokens=2000,
        separate_reasoning=False,
    )[1]
    assert body["choices"][0]["message"]["reasoning_content"] is None
    assert "</think>" in body["choices"][0]["message"]["content"]


def test_enable_thinking_false_gives_content_only(emulator):
    http = emulator("--reasoning-parser", "qwen3", "--length-median", "300", "--length-sigma", "0.01")
    body = chat(http, max_tokens=2000, chat_template_kwargs={"enable_thinking": False})[1]
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"] and "</think>" not in msg["content"]
    assert body["usage"]["reasoning_tokens"] == 0


def test_truncated_thinking_is_all_reasoning_and_empty_content(emulator):
    http = emulator("--reasoning-parser", "qwen3", "--length-median", "3000", "--length-sigma", "0.01")
    body = chat(http, max_tokens=100)[1]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None
    assert choice["message"]["content"] == "" and choice["message"]["reasoning_content"]
    assert body["usage"]["reasoning_tokens"] == body["usage"]["completion_tokens"] == 100


def test_default_chat_template_kwargs_apply_unless_the_request_overrides(emulator):
    http = emulator("--default-chat-template-kwargs", '{"enable_thinking": false}')
    off = http.post("/v1/tokenize", {"messages": MSGS})[1]["tokens"]
    on = http.post("/v1/tokenize", {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": True}})[1]["tokens"]
    assert off[-4:] == list(tok.THINK_SKIPPED_IDS) and on[-2:] == list(tok.THINK_OPEN_IDS)
    assert http.get("/server_info")[1]["default_chat_template_kwargs"] == {"enable_thinking": False}


def test_return_token_ids_lets_a_client_continue_a_truncated_row(emulator):
    http = emulator("--reasoning-parser", "qwen3", "--length-median", "1500", "--length-sigma", "0.01")
    short = chat(http, max_tokens=300, return_token_ids=True)[1]["choices"][0]
    longer = chat(http, max_tokens=900, return_token_ids=True)[1]["choices"][0]
    assert short["finish_reason"] == "length"
    cont = http.post(
        "/generate",
        {
            "input_ids": short["prompt_token_ids"] + short["response_token_ids"],
            "sampling_params": {"max_new_tokens": 600},
        },
    )[1]
    assert short["response_token_ids"] + cont["output_ids"] == longer["response_token_ids"]


def test_chat_streaming_reassembles_to_the_non_streamed_reply(emulator):
    http = emulator("--reasoning-parser", "qwen3", "--length-median", "400", "--length-sigma", "0.01")
    whole = chat(http, max_tokens=2000)[1]
    status, events = http.sse(
        "/v1/chat/completions",
        {"messages": MSGS, "max_tokens": 2000, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-2]]
    assert (
        "".join(d.get("reasoning_content") or "" for d in deltas) == whole["choices"][0]["message"]["reasoning_content"]
    )
    assert "".join(d.get("content") or "" for d in deltas) == whole["choices"][0]["message"]["content"]
    assert (
        chunks[-2]["choices"][0]["finish_reason"] == "stop"
        and chunks[-2]["choices"][0]["matched_stop"] == tok.IM_END_ID
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_chat_stream_refuses_return_token_ids(emulator):
    status, body = chat(emulator(), stream=True, return_token_ids=True)
    assert status == 400 and body["type"] == "BadRequest"
    assert body["message"].startswith("return_token_ids is not supported with streaming")


def test_generate_stream_is_cumulative(emulator):
    status, events = emulator().sse(
        "/generate", {"text": "go", "stream": True, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
    )
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 2
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 600}
    assert len(chunks[-1]["output_ids"]) == 600


def test_chat_validation_errors_are_fastapi_400s(emulator):
    http = emulator()
    status, body = http.post("/v1/chat/completions", {"model": "m"})
    assert status == 400 and body["type"] == "Bad Request" and "messages" in body["message"]
    status, body = http.post("/v1/chat/completions", {"messages": []})
    assert (status, body["message"], body["type"]) == (400, "Messages cannot be empty.", "BadRequestError")
    status, body = http.post("/v1/chat/completions", raw=b"{}", headers={"Content-Type": "text/plain"})
    assert status == 400 and "Only 'application/json' is allowed" in body["message"]


# ---- auth and metrics ----


def test_api_key_guards_every_route_but_health_ready_and_metrics(emulator):
    http = emulator("--enable-metrics", key="sekrit")
    anon = type(http)(http.base)
    for path in ("/v1/models", "/server_info", "/v1/loads", "/model_info", "/_emulator/faults"):
        assert anon.get(path) == (401, {"error": "Unauthorized"})
    assert anon.post("/generate", {"text": "x"}) == (401, {"error": "Unauthorized"})
    wrong = type(http)(http.base, "nope")
    assert wrong.get("/v1/models")[0] == 401
    for path in ("/health", "/health_generate", "/ready", "/metrics"):
        assert anon.get(path)[0] == 200
    assert http.get("/v1/models")[0] == 200


def test_metrics_route_exists_only_with_enable_metrics(emulator):
    assert emulator().get("/metrics")[0] == 404
    http = emulator("--enable-metrics")
    http.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 3}})
    status, text = http.get("/metrics")
    assert status == 200
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:token_usage",
        "sglang:max_total_num_tokens",
        "sglang:context_len",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
    ):
        assert f"\n{name}{{" in text or text.startswith(f"{name}{{")
    assert (
        'sglang:generation_tokens_total{model_name="emulated/qwen3-27b",engine_type="unified",is_streaming="false"} 3.0'
        in text
    )


def test_sglext_carries_input_and_output_ids_when_asked(emulator):
    http = emulator()
    body = chat(http, max_tokens=20, return_input_ids_in_sglext=True, return_output_ids_in_sglext=True)[1]
    prompt = http.post("/v1/tokenize", {"messages": MSGS})[1]["tokens"]
    assert body["sglext"]["input_ids"] == prompt and len(body["sglext"]["output_ids"][0]) == 20
    status, events = http.sse(
        "/v1/chat/completions",
        {"messages": MSGS, "max_tokens": 20, "stream": True},
        headers={"x-sglext-return-output-ids": "1"},
    )
    ext = [e for e in events[:-1] if "sglext" in e]
    assert status == 200 and ext[0]["sglext"] == {"output_ids": body["sglext"]["output_ids"]}
