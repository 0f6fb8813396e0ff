"""OpenAI-compatible routes: `/v1/chat/completions` (serving_chat.py), `/v1/tokenize` and `/v1/detokenize`
(serving_tokenize.py), with 0.5.23's order of checks, reasoning split and error types.

Reasoning (the template pre-opens `<think>\\n` unless enable_thinking is false): with --reasoning-parser qwen3 and
separate_reasoning, text before `</think>` is reasoning_content (all of it when cut before `</think>`, content "");
without a parser the raw `...</think>` stays in content.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from . import tokenizer as tok
from . import tool_calls
from .engine import Output, Request, TokenizerError, unseen_disconnect
from .faults import QUEUE_FULL, prompt_text
from .native import meta_info
from .responses import (
    HTTP_STATUS_NAMES,
    SSE_DONE,
    dumps,
    field_error,
    http_exception,
    json_response,
    openai_error,
    openai_error_body,
    read_json,
    sse,
    validation_error,
)
from .state import STATE

_INT = ("max_tokens", "max_completion_tokens", "n", "top_k", "seed", "min_tokens", "top_logprobs", "priority")
_FLOAT = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_BOOL = (
    "stream",
    "separate_reasoning",
    "stream_reasoning",
    "return_token_ids",
    "return_prompt_token_ids",
    "return_meta_info",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "continue_final_message",
    "logprobs",
    "return_input_ids_in_sglext",
    "return_output_ids_in_sglext",
)
_DICT, _IDS = ("chat_template_kwargs", "stream_options"), ("input_ids",)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ChatCompletionRequest's pydantic checks that matter here, in report order: (error type, message, check, fields)
_FIELD_CHECKS = (
    ("int_type", "Input should be a valid integer", _is_int, _INT),
    ("float_type", "Input should be a valid number", lambda v: _is_int(v) or isinstance(v, float), _FLOAT),
    ("bool_type", "Input should be a valid boolean", lambda v: isinstance(v, bool), _BOOL),
    ("dict_type", "Input should be a valid dictionary", lambda v: isinstance(v, dict), _DICT),
    ("string_type", "Input should be a valid string", lambda v: isinstance(v, str) or _all(v, str), ("stop",)),
    (
        "list_type",
        "Input should be a valid list of integers",
        lambda v: isinstance(v, list) and all(map(_is_int, v)),
        _IDS,
    ),
)


def _all(v, kind: type) -> bool:
    return isinstance(v, list) and all(isinstance(x, kind) for x in v)


def _field_errors(body: dict) -> list[dict]:
    return [
        field_error(kind, ("body", name), msg, body[name])
        for kind, msg, ok, names in _FIELD_CHECKS
        for name in names
        if body.get(name) is not None and not ok(body[name])
    ]


def _messages_errors(body) -> list[dict]:
    if not isinstance(body, dict):
        return [field_error("model_attributes_type", ("body",), "Input should be a valid dictionary", body)]
    if "messages" not in body:
        return [field_error("missing", ("body", "messages"), "Field required", body)]
    msgs = body["messages"]
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
        return [field_error("list_type", ("body", "messages"), "Input should be a valid list of messages", msgs)]
    return []


def _tools_errors(body: dict) -> list[dict]:
    problem = tool_calls.tools_error(body.get("tools"))
    return [field_error("list_type", ("body", "tools"), problem, body["tools"])] if problem else []


class CallStream:
    """The streamed side of the tool-call parser: content before the first call goes on, the calls are held and
    sent whole, a delta with id and name, then one with the arguments (SGLang's order)."""

    def __init__(self, chat: ChatContext):
        self.tools, self.active, self.held, self.calls = chat.tools or [], chat.parses_calls, "", 0

    def feed(self, content: str) -> str:
        if not self.active:
            return content
        self.held += content
        at = self.held.find(tool_calls.CALL_OPEN)
        if at == -1:  # all but a possible start of the marker goes on
            keep = next(
                (
                    k
                    for k in range(len(tool_calls.CALL_OPEN) - 1, 0, -1)
                    if self.held.endswith(tool_calls.CALL_OPEN[:k])
                ),
                0,
            )
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
            return out
        out, self.held = self.held[:at], self.held[at:]
        return out

    def deltas(self) -> tuple[str, list[dict]]:
        """(content still held, the tool-call deltas) at the end of the stream."""
        _, calls = tool_calls.parse(self.held, self.tools) if self.active else ("", [])
        self.calls = len(calls)
        if not calls:
            return self.held, []
        out = []
        for call in calls:
            fn = call["function"]
            head = {"id": call["id"], "index": call["index"], "type": "function"}
            out.append({"tool_calls": [head | {"function": {"name": fn["name"], "arguments": ""}}]})
            tail = {"id": None, "index": call["index"], "type": "function"}
            out.append({"tool_calls": [tail | {"function": {"name": None, "arguments": fn["arguments"]}}]})
        return "", out


# ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS: when neither the request nor generation_config.json says
OPENAI_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


class ChatContext:
    """What serving_chat derives from a request before generating."""

    def __init__(self, cfg, body: dict):
        self.cfg, self.body = cfg, body
        ctk = dict(body.get("chat_template_kwargs") or {})
        if body.get("reasoning_effort") is not None:  # normalize_reasoning_inputs: 'none' turns thinking off
            thinking = body["reasoning_effort"] != "none"
            ctk.setdefault("thinking", thinking)
            ctk.setdefault("enable_thinking", thinking)
        ctk.pop("reasoning_effort", None)
        for k, v in (cfg.args.default_chat_template_kwargs or {}).items():
            ctk.setdefault(k, v)
        self.chat_template_kwargs = ctk
        # the template's default is on; an always-think template has no toggle and opens <think> regardless
        self.enable_thinking = cfg.args.always_think or ctk.get("enable_thinking", True) is not False
        parser = cfg.reasoning_parser
        # _get_reasoning_from_request: qwen3 follows enable_thinking, qwen3-thinking always reasons, and a template
        # that always opens <think> forces it for any parser (template_manager.force_reasoning)
        self.reasoning = parser == "qwen3-thinking" or (parser is not None and self.enable_thinking)
        self.separate = parser is not None and body.get("separate_reasoning", True) is not False
        # tools reach the template unless tool_choice is "none" (serving_chat._tool_call_parsing_active)
        offered = body.get("tools") if body.get("tool_choice") != "none" else None
        self.tools = [tool_calls.tool_dump(t) for t in offered] if offered else None
        self.parses_calls = bool(self.tools) and cfg.args.tool_call_parser in tool_calls.PARSERS

    def prompt_ids(self, add_generation_prompt: bool = True) -> list[int]:
        if self.body.get("input_ids") is not None:
            return list(self.body["input_ids"])
        messages, prefix = self.body["messages"], None
        last = messages[-1] if messages else {}
        if (
            self.body.get("continue_final_message")
            and last.get("role") == "assistant"
            and isinstance(last.get("content"), str)
        ):
            # serving_chat._handle_last_assistant_message: the rest rendered, the last assistant's text appended
            messages, prefix = messages[:-1], last["content"]
        text = tok.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=self.enable_thinking,
            variant=self.cfg.args.template_variant,
            tools=self.tools,
        )
        return tok.encode(text) + (tok.encode(prefix) if prefix else [])

    def validate(self) -> str | None:
        """serving_chat._validate_request (type BadRequestError)."""
        if not self.body["messages"]:
            return "Messages cannot be empty."
        max_out = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        configured = self.cfg.args.context_length  # get_model().context_length: null unless passed
        if max_out and configured and max_out > configured and not self.cfg.args.allow_auto_truncate:
            return (
                f"max_completion_tokens is too large: {max_out}."
                f"This model supports at most {configured} completion tokens."
            )
        return None

    def sampling(self) -> dict:
        b = self.body
        stop = b.get("stop")
        model = self.cfg.model_sampling_defaults

        def get_param(name: str):  # to_sampling_params: user value > generation_config > OpenAI default
            return b[name] if b.get(name) is not None else model.get(name, OPENAI_SAMPLING_DEFAULTS[name])

        return {
            "temperature": get_param("temperature"),
            "max_new_tokens": b.get("max_completion_tokens") or b.get("max_tokens"),
            "min_new_tokens": b.get("min_tokens", 0),
            "stop": [stop] if isinstance(stop, str) else (stop or []),
            "stop_token_ids": b.get("stop_token_ids"),
            "top_p": get_param("top_p"),
            "top_k": get_param("top_k"),
            "min_p": get_param("min_p"),
            "presence_penalty": b.get("presence_penalty", 0.0),
            "frequency_penalty": b.get("frequency_penalty", 0.0),
            "repetition_penalty": get_param("repetition_penalty"),
            "n": b.get("n", 1),
            "no_stop_trim": b.get("no_stop_trim", False),
            "ignore_eos": b.get("ignore_eos", False),
            "skip_special_tokens": b.get("skip_special_tokens", True),
            "sampling_seed": b.get("seed"),
        }


def split_reasoning(text: str, force: bool) -> tuple[str | None, str]:
    """BaseReasoningFormatDetector.detect_and_parse for Qwen3 (no stripping)."""
    if not (force or tok.THINK in text):
        return None, text
    while text.startswith(tok.THINK):
        text = text[len(tok.THINK) :]
    if tok.THINK_END not in text:
        cut = text.find("<tool_call>")  # Qwen3.5 may open a tool call without </think>
        return (text[:cut], text[cut:]) if cut != -1 else (text, "")
    reasoning, _, content = text.partition(tok.THINK_END)
    return reasoning, content


class StreamSplitter:
    """The streaming side of the same parser: deltas in, (reasoning, content) out."""

    def __init__(self, force: bool):
        self.in_reasoning = force

    def feed(self, delta: str) -> tuple[str, str]:
        if not self.in_reasoning and tok.THINK in delta:
            self.in_reasoning = True
        if self.in_reasoning:
            delta = delta.replace(tok.THINK, "", 1)
            if tok.THINK_END in delta:
                reasoning, _, content = delta.partition(tok.THINK_END)
                self.in_reasoning = False
                return reasoning, content
            return delta, ""
        return "", delta


def usage(outs: list[Output], cache_report: bool) -> dict:
    prompt = outs[0].prompt_tokens
    completion = sum(o.completion_tokens for o in outs)
    reasoning = sum(o.reasoning_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": outs[0].cached_tokens} if cache_report else None,
        "reasoning_tokens": reasoning,
        "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None,
    }


def sglext_ids(headers, cfg, body: dict, reqs: list[Request], outs: list[Output]) -> dict:
    """`sglext.input_ids` / `sglext.output_ids`, asked for by the request, its headers or the server's flags."""
    ext: dict[str, list] = {}
    for side, ids in (("input", reqs[0].input_ids), ("output", [o.output_ids for o in outs])):
        asked = body.get(f"return_{side}_ids_in_sglext") or headers.get(f"x-sglext-return-{side}-ids") == "1"
        if asked or getattr(cfg.args, f"return_{side}_ids"):
            ext[f"{side}_ids"] = ids
    return ext


_STREAM_REFUSALS = {
    flag: f"{flag} is not supported with streaming{where}. Please set stream=false when using {flag}=true."
    for flag, where in (
        ("return_prompt_token_ids", ""),
        ("return_token_ids", " on /v1/chat/completions"),
        ("return_meta_info", ""),
    )
}


async def handle_chat(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    cfg, engine = st.cfg, st.engine
    body = await read_json(request, require_json_content_type=True)
    if isinstance(body, web.Response):
        return body
    errs = _messages_errors(body) or _field_errors(body) or _tools_errors(body)
    if errs:
        return validation_error(errs)
    verdict = st.judge(prompt_text(body))
    chat = ChatContext(cfg, body)
    problem = chat.validate()
    if problem:
        return openai_error(problem)
    stream = bool(body.get("stream"))
    try:  # _convert_to_internal_request: its ValueErrors are type "BadRequest"
        if stream:
            for flag, refusal in _STREAM_REFUSALS.items():
                if body.get(flag):
                    raise ValueError(refusal)
        prompt = chat.prompt_ids()
    except ValueError as e:
        return openai_error(str(e), "BadRequest")
    n = body.get("n") or 1
    reqs = [
        Request(
            input_ids=list(prompt),
            sampling=chat.sampling(),
            stream=stream,
            require_reasoning=chat.reasoning,
            tools=chat.tools,
            sample_index=i,
            rid=body["rid"] if isinstance(body.get("rid"), str) and n == 1 else uuid.uuid4().hex,
        )
        for i in range(n)
    ]
    try:  # generate_request: its ValueErrors are type "BadRequestError"
        for r in reqs:
            engine.validate(r)
    except TokenizerError as e:
        return openai_error(str(e))
    if stream:
        if n != 1:
            return openai_error("emulator: streaming with n > 1 is not emulated", "BadRequest")
        serving = _stream(request, chat, reqs[0], verdict)
        return await (unseen_disconnect(engine, serving) if verdict.half_open else serving)
    outs = await asyncio.gather(*(engine.final(r, verdict) for r in reqs))
    for out in outs:
        if out.aborted and (status := out.done["status_code"]) is not None:  # a status-less abort is an HTTP 200
            message = out.done["message"]
            return openai_error(message) if status == 400 else http_exception(message, status)
    reply = _response(cfg, chat, reqs, outs)
    ext = sglext_ids(request.headers, cfg, body, reqs, outs)
    if ext:
        reply["sglext"] = ext
    return json_response(reply)


def _response(cfg, chat: ChatContext, reqs: list[Request], outs: list[Output]) -> dict:
    body = chat.body
    choices = []
    for i, (req, out) in enumerate(zip(reqs, outs)):
        reasoning, text = split_reasoning(out.text, chat.reasoning) if chat.separate else (None, out.text)
        text, calls = tool_calls.parse(text, chat.tools or []) if chat.parses_calls else (text, [])
        finish, matched = out.done["type"], out.done.get("matched")
        if calls and finish == "stop":  # serving_chat._process_tool_calls
            finish, matched = "tool_calls", None
        message = {"role": "assistant", "content": text or "", "reasoning_content": reasoning or None}
        choice = {
            "index": i,
            "message": message | ({"tool_calls": calls} if calls else {}),
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": matched,
        }
        if body.get("return_prompt_token_ids") or body.get("return_token_ids"):
            choice["prompt_token_ids"] = req.input_ids
        if body.get("return_token_ids"):
            choice["response_token_ids"] = out.output_ids
        if body.get("return_meta_info"):
            choice["meta_info"] = meta_info(req, out, stamp=True)
        choices.append(choice)
    return {
        "id": reqs[0].rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "default"),
        "choices": choices,
        "usage": usage(outs, bool(cfg.args.enable_cache_report)),
        "metadata": {"weight_version": "default"},
    }


def _chunk(req: Request, model: str, created: int, delta: dict, finish=None, matched=None, usage_=None) -> bytes:
    c = {
        "id": req.rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": matched}],
        "usage": usage_,  # ChatCompletionStreamResponse.model_dump_json: null unless continuous_usage_stats
    }
    return sse(c)


async def _stream(request: web.Request, chat: ChatContext, req: Request, verdict) -> web.StreamResponse:
    """SSE chunks as _generate_chat_stream builds them; the first output is awaited before the 200 goes out."""
    outputs = request.app[STATE].engine.run(req, verdict)
    try:
        return await _write_stream(request, chat, req, outputs)
    finally:
        await outputs.aclose()  # a client gone mid-stream frees its slot


async def _write_stream(request: web.Request, chat: ChatContext, req: Request, outputs) -> web.StreamResponse:
    cfg = request.app[STATE].cfg
    body = chat.body
    model, created = body.get("model", "default"), int(time.time())
    opts = body.get("stream_options") or {}
    include_usage = bool(opts.get("include_usage")) or bool(cfg.args.stream_response_default_include_usage)
    continuous = bool(opts.get("continuous_usage_stats"))
    first = await outputs.__anext__()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    if first.aborted and first.done["status_code"] is not None:  # a scheduler abort with a status: error chunk
        code = first.done["status_code"]
        err = openai_error_body(first.done["message"], HTTP_STATUS_NAMES.get(code, str(code)), code)
        await resp.write(b"data: " + dumps({"error": err}).encode() + b"\n\n")
        await resp.write(SSE_DONE)
        return resp
    await resp.write(_chunk(req, model, created, {"reasoning_content": None, "role": "assistant", "content": ""}))
    splitter = StreamSplitter(chat.reasoning) if chat.separate else None
    calls = CallStream(chat)
    sent, last = 0, first
    out = first
    while True:
        delta, sent = out.text[sent:], len(out.text)
        u = usage([out], False) if continuous else None
        reasoning, content = splitter.feed(delta) if splitter else ("", delta)
        content = calls.feed(content)
        if reasoning:
            await resp.write(_chunk(req, model, created, {"reasoning_content": reasoning}, usage_=u))
        if content:
            await resp.write(_chunk(req, model, created, {"reasoning_content": None, "content": content}, usage_=u))
        last = out
        try:
            out = await outputs.__anext__()
        except StopAsyncIteration:
            break
    held, deltas = calls.deltas()
    if held:
        await resp.write(_chunk(req, model, created, {"reasoning_content": None, "content": held}))
    for call_delta in deltas:
        await resp.write(_chunk(req, model, created, call_delta))
    fin = last.finish
    finish, matched = (
        ("tool_calls", None) if calls.calls and fin["type"] == "stop" else (fin["type"], fin.get("matched"))
    )
    await resp.write(_chunk(req, model, created, {"reasoning_content": None}, finish, matched))
    head = {"id": req.rid, "object": "chat.completion.chunk", "created": created, "model": model}
    ext = sglext_ids(request.headers, cfg, body, [req], [last])
    if ext:
        await resp.write(sse({**head, "choices": [], "usage": None, "sglext": ext}))
    if include_usage:
        final_usage = usage([last], bool(cfg.args.enable_cache_report))
        await resp.write(sse({**head, "choices": [], "usage": final_usage}))
    await resp.write(SSE_DONE)
    return resp


# ---- /v1/tokenize and /v1/detokenize ----


async def handle_tokenize(request: web.Request) -> web.Response:
    cfg = request.app[STATE].cfg
    body = await read_json(request, require_json_content_type=True)
    if isinstance(body, web.Response):
        return body
    if not isinstance(body, dict) or (body.get("prompt") is None) == (body.get("messages") is None):
        exactly_one = "Value error, Exactly one of 'prompt' or 'messages' must be provided."
        return validation_error([field_error("value_error", ("body",), exactly_one, body)])
    if request.app[STATE].faults.tokenize_fails():
        return http_exception(QUEUE_FULL, 503)
    # the tokenizer's model_max_length, NOT the served context length (that is /v1/models')
    max_model_len = cfg.args.native_context_length
    prompt = body.get("prompt")
    if body.get("messages") is not None:
        errs = _messages_errors(body) or _field_errors(body)
        if errs:
            return validation_error(errs)
        chat = ChatContext(cfg, body)
        problem = chat.validate()
        if problem:
            return openai_error(problem)
        agp = body.get("add_generation_prompt")
        ids = chat.prompt_ids(add_generation_prompt=True if agp is None else bool(agp))
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": max_model_len})
    if isinstance(prompt, str):
        ids = tok.encode(prompt)
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": max_model_len})
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        lists = [tok.encode(p) for p in prompt]
        return json_response({"tokens": lists, "count": [len(x) for x in lists], "max_model_len": max_model_len})
    return validation_error([field_error("string_type", ("body", "prompt"), "Input should be a valid string", prompt)])


async def handle_detokenize(request: web.Request) -> web.Response:
    body = await read_json(request, require_json_content_type=True)
    if isinstance(body, web.Response):
        return body
    tokens = body.get("tokens") if isinstance(body, dict) else None
    skip = body.get("skip_special_tokens", True) if isinstance(body, dict) else True
    if not isinstance(tokens, list):
        return validation_error([field_error("missing", ("body", "tokens"), "Field required", body)])
    if not tokens:
        return json_response({"text": ""})
    if isinstance(tokens[0], list):
        return json_response({"text": [tok.decode(t, skip_special_tokens=skip) for t in tokens]})
    if not all(isinstance(t, int) for t in tokens):
        return openai_error("Invalid input: 'tokens' must be a list of integers.")
    return json_response({"text": tok.decode(tokens, skip_special_tokens=skip)})
