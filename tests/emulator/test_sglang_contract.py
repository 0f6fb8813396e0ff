"""The emulator against SGLang 0.5.23's own contract, read from the wheel.

`sglang/api/v1/api_types.py` is the generated JSON schema the real server gates
`/generate` with; it needs only msgspec, so it is loaded by file path (importing
`sglang` would pull torch). These tests FAIL, not skip, without the wheel: the
README's test command installs it with `uv pip install --no-deps sglang==0.5.23`.

Run as a script (`uv run python -m tests.emulator.test_sglang_contract`), this prints the flag table of
dflash_assets/emulator/sglang_flags.json.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dflash_assets.emulator import contract
from dflash_assets.emulator import tokenizer as tok
from dflash_assets.emulator.config import FLAGS
from tests.support.sglang_wheel import class_fields, function, sglang_dir, sglang_verdict

pytestmark = pytest.mark.timeout(60)


# Bodies the server should serve (200) and bodies its contract gate must refuse.
VALID = [
    {"text": "hi"},
    {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 4}},
    {
        "input_ids": [300, 301, 302],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "top_p": 0.9, "top_k": 20},
    },
    {"input_ids": [[300, 301], [302]], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}]},
    {
        "text": "x",
        "sampling_params": {
            "max_new_tokens": None,
            "stop": ["\n"],
            "stop_token_ids": [5],
            "ignore_eos": False,
            "sampling_seed": 7,
            "custom_params": {"a": 1},
            "logit_bias": {"5": 1.5},
        },
    },
    {"text": "x", "stream": False, "rid": "abc", "return_logprob": False, "no_such_top_level_key": 1},
    {"text": "x", "sampling_params": {"temperature": 1, "min_p": 0, "repetition_penalty": 1}},
    {"text": "x", "return_prompt_token_ids": True, "require_reasoning": True},
    {"text": "x", "image_data": None, "lora_path": None, "custom_labels": {"team": "a"}, "priority": 1},
    {"text": "x", "sampling_params": {"max_new_tokens": 8, "n": 2, "stop": "."}},
    {"text": "x", "sampling_params": {}, "routing_key": "k", "extra_key": ["a"], "modalities": [None, "text"]},
]
INVALID = [
    {"text": "x", "sampling_params": {"max_tokens": 8}},
    {"text": "x", "sampling_params": {"max_new_tokens": "8"}},
    {"text": "x", "sampling_params": {"max_new_tokens": 8.0}},
    {"text": "x", "sampling_params": {"max_new_tokens": True}},
    {"text": 5},
    {"text": ["a", 1]},
    {"input_ids": "1 2 3"},
    {"input_ids": [1, "2"]},
    {"input_ids": [1.5]},
    {"input_ids": [[1], [2.0]]},
    {"text": "x", "stream": "true"},
    {"text": "x", "sampling_params": "max_new_tokens=8"},
    {"text": "x", "sampling_params": [{"max_new_tokens": 1}, {"bogus": 1}]},
    {"text": "x", "sampling_params": {"stop": 5}},
    {"text": "x", "sampling_params": {"stop": ["a", None]}},
    {"text": "x", "sampling_params": {"watermark": {"enabled": True, "extra": 1}}},
    {"text": "x", "sampling_params": {"logit_bias": {"1": "a"}}},
    {"text": "x", "sampling_params": {"temperature": "hot"}},
    {"text": "x", "max_thinking_tokens": -1},
    {"text": "x", "return_prompt_token_ids": None},
    {"text": "x", "rid": 7},
    {"text": "x", "image_data": {"url": "u", "bogus": 1}},
    {"text": "x", "image_data": 5},
    {"text": "x", "custom_labels": {"a": 1}},
    {"text": "x", "mm_hashes": [["a"], "b"]},
    {"text": "x", "kv_hints": {"protocol_version": 1}},
    {"text": "x", "images_config": {"prefix": None}},
    {"text": "x", "bootstrap_port": "8998"},
]
NOT_OBJECTS = [[], "x", 3, None, True]


def test_the_wheel_is_0_5_23_and_its_gate_is_the_generated_decoder(api):
    gate = (sglang_dir() / "srt" / "entrypoints" / "api_contract.py").read_text()
    assert "GenerateRequest.from_json_value(body)" in gate


@pytest.mark.parametrize("body", VALID + INVALID + NOT_OBJECTS, ids=repr)
def test_the_emulator_gate_agrees_with_sglangs_decoder_word_for_word(api, body):
    assert contract.generate_contract_error(body) == sglang_verdict(api, body)


def test_the_corpus_has_both_kinds(api):
    assert all(sglang_verdict(api, b) is None for b in VALID)
    assert all(sglang_verdict(api, b) is not None for b in INVALID + NOT_OBJECTS)


def test_over_http_refused_bodies_get_400_with_the_decoders_text_and_valid_ones_are_served(api, emulator):
    http = emulator()
    for body in INVALID:
        assert http.post("/generate", body) == (400, {"error": sglang_verdict(api, body)}), body
    for body in VALID:
        status, reply = http.post("/generate", body)
        assert status == 200, (body, reply)


def collect_generate_replies(http) -> list:
    replies = []
    for body in VALID:
        reply = http.post("/generate", body)[1]
        replies += reply if isinstance(reply, list) else [reply]
    chat_prompt = tok.apply_chat_template([{"role": "user", "content": "stop please"}])
    replies.append(http.post("/generate", {"text": chat_prompt, "sampling_params": {"max_new_tokens": 5000}})[1])
    _, events = http.sse("/generate", {"text": "s", "stream": True, "sampling_params": {"max_new_tokens": 70}})
    replies += events[:-1]
    return replies


def test_every_generate_reply_decodes_as_sglangs_generate_response(api, emulator):
    http = emulator("--length-median", "60", "--length-sigma", "0.2")
    replies = collect_generate_replies(http)
    kinds = set()
    for reply in replies:
        decoded = api.GenerateResponse.from_json_value(reply)
        assert decoded.meta_info is not None and decoded.meta_info.id
        assert decoded.meta_info.completion_tokens == len(decoded.output_ids)
        if reply["meta_info"]["finish_reason"] is not None:
            kinds.add(type(decoded.meta_info.finish_reason).__name__)  # a dict here would mean a shape mismatch
    assert kinds == {"FinishStop", "FinishLength"}


def test_stream_aborts_and_errors_decode_as_sglangs_types(api, emulator):
    http = emulator("--max-queued-requests", "0")  # every arrival finds the queue full
    status, events = http.sse("/generate", {"text": "x", "stream": True})
    assert status == 200
    abort = api.GenerateResponse.from_json_value(events[0])
    assert isinstance(abort.meta_info.finish_reason, api.FinishAbort)
    assert abort.meta_info.finish_reason.status_code == 503
    http = emulator("--context-length", "16")
    _, events = http.sse("/generate", {"input_ids": list(range(300, 340)), "stream": True})
    err = api.GenerateStreamError.from_json_value(events[0])
    assert err.error.code == 400 and err.error.message.startswith("The input (40 tokens) is longer")


# ---- POST /abort_request: what a stalled stream's client sends ----


def test_abort_request_is_an_admin_optional_route_whose_body_is_an_abort_req_and_requests_take_a_rid(emulator):
    route = function("entrypoints/http_server.py", "abort_request")
    decorators = [ast.unparse(d) for d in route.decorator_list]
    assert decorators == ["app.post('/abort_request')", "auth_level(AuthLevel.ADMIN_OPTIONAL)"]
    assert "rid=obj.rid" in ast.unparse(route) and "status_code=200" in ast.unparse(route)
    sent = {"rid"}  # fleet/client.py ServerClient.abort
    assert sent <= class_fields("managers/io_struct.py", "AbortReq") >= {"rid", "abort_all"}
    assert "rid" in class_fields("entrypoints/openai/protocol.py", "ChatCompletionRequest")
    assert "rid" in class_fields("managers/io_struct.py", "GenerateReqInput")
    http = emulator()
    assert http.post("/abort_request", {"rid": "not-running"}) == (200, "")
    assert http.post("/abort_request", {"rid": "", "abort_all": True}) == (200, "")


# ---- the `sglang serve` flag table ----


def _const(node):
    return node.value if isinstance(node, ast.Constant) else None


def _kind(t) -> str:
    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in ("Optional", "Union"):
        elts = t.slice.elts if isinstance(t.slice, ast.Tuple) else [t.slice]
        rest = [e for e in elts if not (isinstance(e, ast.Constant) and e.value is None)]
        return _kind(rest[0]) if len(rest) == 1 else "value"
    if isinstance(t, ast.Name) and t.id == "bool":
        return "bool"
    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in ("List", "list"):
        return "list"
    return "value"


def extract_sglang_flags(root: Path) -> list[tuple[tuple[str, ...], object, str]]:
    """Every CLI flag of `sglang serve` 0.5.23, read by AST as arg_utils.add_cli_args_from_dataclass
    and ServerArgs.add_cli_args register them."""
    flags = []
    for path in sorted((root / "srt" / "arg_groups" / "fields").glob("*.py")):
        for cls in [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)]:
            for st in cls.body:
                ann = getattr(st, "annotation", None)
                if not (
                    isinstance(st, ast.AnnAssign)
                    and isinstance(ann, ast.Subscript)
                    and getattr(ann.value, "id", "") == "A"
                ):
                    continue
                tp, meta = ann.slice.elts[0], ann.slice.elts[1]
                kw = {k.arg: k.value for k in meta.keywords} if isinstance(meta, ast.Call) else {}
                if _const(kw.get("no_cli")) is True:
                    continue
                name = st.target.id
                names = [_const(kw["cli_name"]) if "cli_name" in kw else "--" + name.replace("_", "-")]
                names += [_const(e) for e in kw["aliases"].elts] if "aliases" in kw else []
                nargs = _const(kw.get("nargs"))
                if "action" in kw:
                    if ast.unparse(kw["action"]) == "argparse.BooleanOptionalAction":
                        flags.append((tuple(names + ["--no-" + n[2:] for n in names]), 0, name))
                        continue
                    if "action_kwargs" in kw:
                        ak = {
                            _const(k): _const(v) for k, v in zip(kw["action_kwargs"].keys, kw["action_kwargs"].values)
                        }
                        nargs = ak.get("nargs", nargs)
                    flags.append((tuple(names), nargs, name))
                elif _kind(tp) == "bool":
                    flags.append((tuple(names), 0, name))
                elif _kind(tp) == "list" and "type_parser" not in kw:
                    flags.append((tuple(names), nargs or "+", name))
                else:
                    flags.append((tuple(names), nargs, name))
    for node in ast.walk(ast.parse((root / "srt" / "server_args.py").read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "add_cli_args":
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument":
                    names = tuple(_const(a) for a in call.args)
                    kw = {k.arg: k.value for k in call.keywords}
                    dest = _const(kw["dest"]) if "dest" in kw else names[0][2:].replace("-", "_")
                    switch = "action" in kw and ast.unparse(kw["action"]) in (
                        "'store_true'",
                        "DeprecatedStoreTrueAction",
                    )
                    flags.append((names, 0 if switch else _const(kw.get("nargs")), dest))
    return flags


def test_the_emulator_accepts_exactly_the_0_5_23_flags():
    assert list(FLAGS) == extract_sglang_flags(sglang_dir())


def test_the_emulator_help_starts_with_the_emulator_and_lists_sglangs_flags_after_it_for_compatibility():
    from dflash_assets.emulator.config import build_parser

    text = build_parser().format_help()
    usage, emulator, sglang = text.index("usage:"), text.index("emulator options:"), text.index("SGLang 0.5.23 flags:")
    assert usage < emulator < sglang
    assert text.splitlines()[0] == "usage: sglang serve --model-path PATH [emulator options] [SGLang 0.5.23 flags]"
    assert "Accepted for compatibility" in text[sglang:]
    own, theirs = text[emulator:sglang], text[sglang:]
    assert "--fault-crash-after" in own and "--length-median" in own and "--mem-fraction-static" not in own
    assert all(names[0] in theirs for names, _, _ in FLAGS)  # every accepted SGLang flag is still listed


if __name__ == "__main__":
    import json

    rows = [json.dumps([list(names), nargs, dest]) for names, nargs, dest in extract_sglang_flags(sglang_dir())]
    print("[\n" + ",\n".join("  " + row for row in rows) + "\n]")
