"""Every field the client reads or sends, on every route, against SGLang 0.5.23's own source in the wheel.

The shapes are read from the wheel at test time, by AST (no sglang import: it pulls torch): the pydantic models
of entrypoints/openai/protocol.py, the LoadSnapshot struct, the scheduler's handshake dict, the server-args
fields /server_info serialises, the /model_info dict, the internal-state keys, the Prometheus metric names.
A field in CLIENT_READS that 0.5.23 does not define fails here; so does a body the client builds with a field
0.5.23 does not take, and an emulator answer carrying a field 0.5.23 would not send.
"""

from __future__ import annotations

import ast
import asyncio
import functools

import pytest

from dflash_assets.fleet.client import ChatResult, ServerClient, error_message
from dflash_assets.fleet.fleet import open_session
from dflash_assets.fleet.tuning import MAMBA_USAGE_METRIC
from dflash_assets.generation.request import chat_body
from dflash_assets.settings import GenerationSettings
from tests.support.sglang_wheel import class_fields, function, sglang_dir, sglang_verdict, tree

pytestmark = pytest.mark.timeout(120)

# What dflash_assets reads from each answer (fleet/client.py and its ChatResult, fleet/status.py, fleet/tuning.py,
# generation/continuation.py): route -> {where: fields}.
CLIENT_READS = {
    "/v1/models": {"ModelList": {"data"}, "ModelCard": {"id", "max_model_len"}},
    "/v1/chat/completions": {
        "ChatCompletionResponse": {"choices", "usage"},
        "ChatCompletionResponseChoice": {"index", "message", "finish_reason", "prompt_token_ids", "response_token_ids"},
        "ChatMessage": {"content", "reasoning_content"},
        "UsageInfo": {"prompt_tokens", "completion_tokens", "reasoning_tokens", "completion_tokens_details"},
        "CompletionTokensDetails": {"reasoning_tokens"},
    },
    "/v1/tokenize": {"TokenizeResponse": {"tokens", "count"}},
    "/v1/detokenize": {"DetokenizeResponse": {"text"}},
    "/v1/loads": {
        "loads": {
            "num_running_reqs",
            "num_waiting_reqs",
            "max_total_num_tokens",
            "num_used_tokens",
            "max_running_requests",
            "token_usage",
            "gen_throughput",
        }
    },
    "/server_info": {
        "top": {
            "internal_states",
            "max_req_input_len",
            "max_total_num_tokens",
            "max_running_requests",
            "reasoning_parser",
            "max_mamba_cache_size",
            "disable_radix_cache",
            "mamba_radix_cache_strategy",
            "disable_overlap_schedule",
        },
        "internal_states[*]": {"effective_max_running_requests_per_dp"},
    },
    "/model_info": {"top": {"reasoning_parser"}},
    "/generate": {"GenerateResponse": {"output_ids", "meta_info"}, "GenerateMetaInfo": {"finish_reason"}},
    "/metrics": {
        "names": {
            MAMBA_USAGE_METRIC,
            "sglang:num_requests_total",
            "sglang:prompt_tokens_total",
            "sglang:generation_tokens_total",
            "sglang:num_aborted_requests_total",
        }
    },
}
# What the client sends (besides the chat body GenerationSettings builds, checked whole below)
TOKENIZE_SENDS = {"prompt", "add_special_tokens", "messages", "chat_template_kwargs"}
DETOKENIZE_SENDS = {"tokens", "skip_special_tokens"}


def dict_keys(node: ast.AST) -> set[str]:
    """String keys of the dict literals in a function, and of `x["key"] = ...` assignments in it."""
    keys = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Dict):
            keys |= {k.value for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant):
                    keys.add(t.slice.value)
    return keys


@functools.cache
def server_arg_fields() -> set[str]:
    """The fields ServerArgs.resolved_dict serialises: every annotated field of the arg groups."""
    fields = set()
    for path in sorted((sglang_dir() / "srt" / "arg_groups" / "fields").glob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ClassDef):
                fields |= {
                    s.target.id for s in n.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
    return fields


def server_info_keys() -> set[str]:
    """http_server.server_info: build_server_info (resolved args, launch_command, the scheduler's handshake,
    kv_events) plus startup_time, internal_states, version, frontend."""
    handshake = dict_keys(function("managers/scheduler.py", "get_init_info"))
    built = dict_keys(function("utils/common.py", "build_server_info"))
    added = dict_keys(function("entrypoints/http_server.py", "server_info"))
    return server_arg_fields() | handshake | built | added


def internal_state_keys() -> set[str]:
    return dict_keys(tree("managers/scheduler_components/internal_state.py")) | server_arg_fields()


def metric_names() -> set[str]:
    names = set()
    for n in ast.walk(tree("observability/metrics_collector.py")):
        if isinstance(n, ast.keyword) and n.arg == "name" and isinstance(n.value, ast.Constant):
            names.add(n.value.value)
    return names


# ---- what the client reads, against the wheel ------------------------------------------------------------


@pytest.mark.parametrize("route", ["/v1/models", "/v1/chat/completions", "/v1/tokenize", "/v1/detokenize"])
def test_every_field_the_client_reads_from_an_openai_route_is_in_0_5_23s_models(route):
    for model, fields in CLIENT_READS[route].items():
        missing = fields - class_fields("entrypoints/openai/protocol.py", model)
        assert not missing, f"{route}: the client reads {sorted(missing)} which 0.5.23's {model} does not have"


def test_every_field_the_client_reads_from_v1_loads_is_a_load_snapshot_field():
    assert "loads" in dict_keys(tree("entrypoints/v1_loads.py"))
    missing = CLIENT_READS["/v1/loads"]["loads"] - class_fields("managers/load_snapshot.py", "LoadSnapshot")
    assert not missing


def test_every_field_the_client_reads_from_server_info_is_sent_by_0_5_23():
    assert not CLIENT_READS["/server_info"]["top"] - server_info_keys()
    assert not CLIENT_READS["/server_info"]["internal_states[*]"] - internal_state_keys()


def test_the_field_the_client_reads_from_model_info_is_sent_by_0_5_23():
    sent = dict_keys(function("entrypoints/http_server.py", "model_info"))
    assert not CLIENT_READS["/model_info"]["top"] - sent


def test_every_metric_the_client_reads_is_exported_by_0_5_23():
    assert not CLIENT_READS["/metrics"]["names"] - metric_names()


# ---- what the client sends, against the wheel -----------------------------------------------------------


def test_the_chat_body_the_client_sends_has_only_fields_0_5_23_takes():
    accepted = class_fields("entrypoints/openai/protocol.py", "ChatCompletionRequest")
    body = chat_body(GenerationSettings(), "m", [{"role": "user", "content": "hi"}], token_ids=True)
    # the model accepts extra fields silently: a misspelt one would be ignored, so every name must be known
    assert not set(body) - accepted, sorted(set(body) - accepted)


def test_tokenize_and_detokenize_bodies_have_only_fields_0_5_23_takes():
    assert not TOKENIZE_SENDS - class_fields("entrypoints/openai/protocol.py", "TokenizeRequest")
    assert not DETOKENIZE_SENDS - class_fields("entrypoints/openai/protocol.py", "DetokenizeRequest")


def test_the_continuation_body_passes_0_5_23s_generate_contract(api):
    config = GenerationSettings()
    body = {"input_ids": [300, 301, 302], "sampling_params": {"max_new_tokens": 100, **config.sampling()}}
    assert sglang_verdict(api, body) is None


def test_every_field_the_client_reads_from_generate_is_in_0_5_23s_generated_schema(api):
    for struct, fields in CLIENT_READS["/generate"].items():
        assert fields <= set(getattr(api, struct).__struct_fields__), struct
    # finish_reason is read by its "type": stop / length / abort, the tags 0.5.23's decoder switches on
    decoded = [api.decode_FinishReason({"type": t}) for t in ("stop", "length", "abort")]
    assert [type(d).__name__ for d in decoded] == ["FinishStop", "FinishLength", "FinishAbort"]


def test_the_error_bodies_the_client_reads_are_0_5_23s():
    assert class_fields("entrypoints/openai/protocol.py", "ErrorResponse") >= {"message"}
    assert error_message({"object": "error", "message": "too long", "type": "BadRequestError"}) == "too long"
    assert error_message({"error": {"message": "queue full"}}) == "queue full"
    assert error_message({"detail": "Not Found"}) == "Not Found"


# ---- the emulator sends what 0.5.23 sends ---------------------------------------------------------------


def test_the_emulators_answers_carry_only_0_5_23s_fields_and_every_one_the_client_reads(emulator):
    server = emulator("--reasoning-parser", "qwen3", "--enable-metrics", "--dp-size", "2", "--length-median", "20")
    protocol = "entrypoints/openai/protocol.py"

    _, models = server.get("/v1/models")
    assert set(models) <= class_fields(protocol, "ModelList")
    assert CLIENT_READS["/v1/models"]["ModelCard"] <= set(models["data"][0]) <= class_fields(protocol, "ModelCard")

    _, chat = server.post(
        "/v1/chat/completions",
        chat_body(GenerationSettings(max_output_tokens=32), "m", [{"role": "user", "content": "hi"}], token_ids=True),
    )
    choice, usage = chat["choices"][0], chat["usage"]
    assert set(chat) <= class_fields(protocol, "ChatCompletionResponse")
    assert set(choice) <= class_fields(protocol, "ChatCompletionResponseChoice")
    assert set(choice["message"]) <= class_fields(protocol, "ChatMessage")
    assert set(usage) <= class_fields(protocol, "UsageInfo")
    reads = CLIENT_READS["/v1/chat/completions"]
    assert reads["ChatCompletionResponseChoice"] <= set(choice)
    assert reads["ChatMessage"] <= set(choice["message"])
    assert reads["UsageInfo"] - {"completion_tokens_details"} <= set(usage)
    answer = ChatResult.of(chat)  # what the pipeline reads of it, typed
    assert (answer.finish_reason, answer.content, answer.reasoning_content) == (
        choice["finish_reason"],
        choice["message"]["content"],
        choice["message"]["reasoning_content"],
    )
    assert (answer.prompt_tokens, answer.completion_tokens, answer.reasoning_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["reasoning_tokens"],
    )
    assert answer.output_ids == choice["response_token_ids"] and answer.prompt_token_ids == choice["prompt_token_ids"]
    assert len(answer.output_ids) == answer.completion_tokens

    _, tokens = server.post("/v1/tokenize", {"prompt": "hello there", "add_special_tokens": False})
    assert reads_ok(tokens, "TokenizeResponse", "/v1/tokenize")
    _, text = server.post("/v1/detokenize", {"tokens": tokens["tokens"], "skip_special_tokens": True})
    assert reads_ok(text, "DetokenizeResponse", "/v1/detokenize")

    _, loads = server.get("/v1/loads")
    snapshot = class_fields("managers/load_snapshot.py", "LoadSnapshot")
    for row in loads["loads"]:
        assert CLIENT_READS["/v1/loads"]["loads"] <= set(row) <= snapshot

    _, info = server.get("/server_info")
    assert CLIENT_READS["/server_info"]["top"] <= set(info)
    unknown = set(info) - server_info_keys()
    assert not unknown, f"the emulator's /server_info sends {sorted(unknown)}, which 0.5.23's does not"
    assert len(info["internal_states"]) == 2
    for state in info["internal_states"]:
        assert CLIENT_READS["/server_info"]["internal_states[*]"] <= set(state)

    _, model_info = server.get("/model_info")
    assert set(model_info) <= dict_keys(function("entrypoints/http_server.py", "model_info"))

    _, metrics = server.get("/metrics")
    exported = {line.split("{")[0].split(" ")[0] for line in metrics.splitlines() if line and line[0] != "#"}
    exported = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in exported}
    assert exported <= metric_names(), sorted(exported - metric_names())
    assert {MAMBA_USAGE_METRIC, "sglang:num_requests_total"} <= exported


def reads_ok(body: dict, model: str, route: str) -> bool:
    fields = class_fields("entrypoints/openai/protocol.py", model)
    return CLIENT_READS[route][model] <= set(body) <= fields


def test_the_client_reads_the_detected_parser_all_dp_slots_and_metrics_off_from_an_emulator(emulator):
    server = emulator("--reasoning-parser", "auto", "--dp-size", "2")

    async def read():
        async with open_session() as session:
            client = ServerClient(session, server.emu.url)
            return await client.info(), await client.metrics()

    info, metrics = asyncio.run(read())
    assert (info.reasoning_parser, info.max_running_requests, metrics) == ("qwen3", 2 * 48, None)
