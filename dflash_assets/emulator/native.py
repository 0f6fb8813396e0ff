"""`POST|PUT /generate`, SGLang's native API (http_server.generate_request): contract gate, then the request, then
`{text, output_ids, meta_info}` (a list for a batch or n > 1). A stream sends cumulative text and ids and has no
kick-start: even a context-length error is HTTP 200 with an SSE error chunk.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from . import tokenizer as tok
from .contract import generate_contract_error
from .engine import Engine, Output, Request, TokenizerError, unseen_disconnect
from .faults import Verdict, prompt_text
from .responses import (
    SSE_DONE,
    contract_error,
    dumps,
    generate_error,
    http_exception,
    raw_json_response,
    read_json,
    sse,
    validation_error,
)
from .state import STATE

GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams default; /generate has no generation_config defaults


def meta_info(req: Request, out: Output, *, stamp: bool) -> dict:
    m: dict[str, object] = {
        "id": req.rid,
        "finish_reason": out.finish,
        "prompt_tokens": out.prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": out.reasoning_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
    }
    if out.finish is not None:
        m["e2e_latency"] = out.e2e_latency
    if stamp:  # set once: on the first streamed chunk, or on the finished reply
        m["response_sent_to_client_ts"] = time.time()
    return m


def out_json(text: str, output_ids: list[int], meta: dict, prompt_ids: list[int] | None) -> str:
    """One `{text, output_ids, meta_info[, prompt_token_ids]}` as JSON, by hand (faster than json for ids)."""
    parts = ['{"text":', dumps(text), ',"output_ids":[', tok.ids_csv(output_ids), '],"meta_info":', dumps(meta)]
    if prompt_ids is not None:
        parts += [',"prompt_token_ids":', dumps(prompt_ids)]
    parts.append("}")
    return "".join(parts)


def build_requests(body: dict, preferred: dict | None) -> tuple[list[Request], bool]:
    """GenerateReqInput.normalize_batch_and_arguments; and whether the reply is a single object."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise TokenizerError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:  # text wins over input_ids, as in _determine_batch_size
        prompts = [tok.encode(text)] if isinstance(text, str) else [tok.encode(t) for t in text]
        single = isinstance(text, str)
    else:
        ids = input_ids or []  # not None here: one of text and input_ids is given
        if len(ids) == 0:
            raise TokenizerError("input_ids cannot be empty.")
        single = isinstance(ids[0], int)
        prompts = [list(ids)] if single else [list(x) for x in ids]
    sps = body.get("sampling_params") or {}
    sps = sps if isinstance(sps, list) else [sps] * len(prompts)
    n = (sps[0].get("n") or 1) if sps else 1
    if any((sp.get("n") or 1) != n for sp in sps):
        raise TokenizerError("The parallel_sample_num should be the same for all samples in sample params.")
    rid = body.get("rid")
    reqs = []
    for i in range(len(prompts) * n):  # parallel samples repeat the batch: [p0, p1, p0, p1, ...]
        p = i % len(prompts)
        sp = {**(preferred or {}), **sps[p]}
        r = Request(
            input_ids=list(prompts[p]),
            sampling=sp,
            stream=bool(body.get("stream")),
            require_reasoning=bool(body.get("require_reasoning")),
            sample_index=i // len(prompts),
            default_max_new_tokens=GENERATE_DEFAULT_MAX_NEW_TOKENS,
        )
        if isinstance(rid, str) and single and n == 1:
            r.rid = rid
        elif isinstance(rid, list) and i < len(rid):
            r.rid = rid[i]
        reqs.append(r)
    return reqs, single and n == 1


def _ids_outside_i64(body) -> bool:
    ids = body.get("input_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not ids:
        return False
    rows = ids if isinstance(ids[0], list) else [ids]
    ints = [i for row in rows if isinstance(row, list) for i in row if isinstance(i, int)]
    return bool(ints) and (min(ints) < -(2**63) or max(ints) > 2**63 - 1)


async def handle_generate(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    engine = st.engine
    body = await read_json(request, require_json_content_type=False)
    if isinstance(body, web.Response):
        return body
    if _ids_outside_i64(body):  # FastAPI's dataclass parse runs before the contract gate
        return validation_error(
            [{"type": "value_error", "loc": ("body", "input_ids"), "msg": "token ids must fit in int64"}]
        )
    err = generate_contract_error(body)
    if err is not None:
        return contract_error(err)
    verdict = st.judge(prompt_text(body))
    if body.get("stream"):
        serving = _stream(request, engine, body, verdict)
        return await (unseen_disconnect(engine, serving) if verdict.half_open else serving)
    try:
        reqs, single = build_requests(body, st.cfg.args.preferred_sampling_params)
        for r in reqs:
            engine.validate(r)
    except TokenizerError as e:
        return generate_error(str(e))
    outs = await asyncio.gather(*(engine.final(r, verdict) for r in reqs))
    for out in outs:
        if out.aborted and out.done["status_code"] is not None:  # tokenizer_manager._handle_abort_finish_reason
            status, message = out.done["status_code"], out.done["message"]
            return generate_error(message) if status == 400 else http_exception(message, status)
    results = [
        out_json(
            o.text,
            o.output_ids,
            meta_info(r, o, stamp=True),
            r.input_ids if body.get("return_prompt_token_ids") else None,
        )
        for r, o in zip(reqs, outs)
    ]
    return raw_json_response(results[0] if single else "[" + ",".join(results) + "]")


async def _stream(request: web.Request, engine: Engine, body: dict, verdict: Verdict) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    cfg = request.app[STATE].cfg
    incremental = bool(cfg.args.incremental_streaming_output)
    try:
        reqs, single = build_requests(body, cfg.args.preferred_sampling_params)
        if not single:
            raise TokenizerError("emulator: streaming a batch or n > 1 on /generate is not emulated")
        req = reqs[0]
        engine.validate(req)
    except TokenizerError as e:
        await resp.write(
            sse({"error": {"message": str(e), "type": "invalid_request_error", "code": 400, "retryable": False}})
        )
        await resp.write(SSE_DONE)
        return resp
    prompt_ids = req.input_ids if body.get("return_prompt_token_ids") else None
    outputs = engine.run(req, verdict)
    try:
        sent_ids = sent_chars = 0
        first = True
        async for out in outputs:
            text, ids = out.text, out.output_ids
            if incremental:
                text, ids = text[sent_chars:], ids[sent_ids:]
                sent_chars, sent_ids = len(out.text), len(out.output_ids)
            payload = out_json(text, ids, meta_info(req, out, stamp=first), prompt_ids)
            first = False
            await resp.write(b"data: " + payload.encode() + b"\n\n")
    finally:
        await outputs.aclose()  # a client gone mid-stream frees its slot
    await resp.write(SSE_DONE)
    return resp
