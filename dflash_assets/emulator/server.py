"""The HTTP server: the route table, auth, fault route, and serving.

Auth is 0.5.23's (srt/utils/auth.py): with --api-key every route but /health*, /ready* and /metrics* needs
`Authorization: Bearer <key>`, else 401 {"error": "Unauthorized"}. The key is never logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import time
from collections import Counter

from aiohttp import web

from . import model
from . import tokenizer as tok
from .config import EXIT_WITH_PARENT, VERSION, EmulatorSetup
from .engine import Engine
from .faults import Faults, from_args
from .info import health, loads, metrics, model_card, model_info, models, ready, server_info
from .native import handle_generate
from .openai import handle_chat, handle_detokenize, handle_tokenize
from .responses import json_response, read_json, validation_error
from .state import STATE, ServerState

log = logging.getLogger("dflash_assets.emulator")
READY_LINE = "The server is fired up and ready to roll!"
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
_ADMIN_OPTIONAL = frozenset({"/abort_request"})


class InjectedCrash(Exception):
    """Raised by an in-process crash fault: the connection is dropped, not answered."""


@web.middleware
async def auth_middleware(request: web.Request, handler):
    args = request.app[STATE].cfg.args
    key = args.api_key
    if request.path in _ADMIN_OPTIONAL:  # auth.py AuthLevel.ADMIN_OPTIONAL: the admin key alone, when one is set
        key = args.admin_api_key or key
    if key and request.method != "OPTIONS" and not request.path.startswith(_OPEN_PREFIXES):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), key.encode()):
            return json_response({"error": "Unauthorized"}, 401)
    try:
        return await handler(request)
    except InjectedCrash:
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError() from None


ROUTES = web.AppKey("emulator_routes", Counter[str])


@web.middleware
async def route_log(request: web.Request, handler):
    """Counts every request as "METHOD /path STATUS" (unknown routes too), for GET /_emulator/routes."""
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    finally:
        if not request.path.startswith("/_emulator/"):
            request.app[ROUTES][f"{request.method} {request.path} {status}"] += 1


def crash_process() -> None:
    """A GPU server dying mid-flight: no cleanup, connections drop."""
    sys.stderr.write("emulator: injected crash, exiting\n")
    sys.stderr.flush()
    os._exit(70)


def create_app(cfg: EmulatorSetup, *, faults: Faults | None = None, on_crash=crash_process) -> web.Application:
    app = web.Application(middlewares=[route_log, auth_middleware], client_max_size=256 * 1024**2)
    app[ROUTES] = Counter()
    faults = faults or from_args(cfg.args)

    def judge(prompt: str):
        verdict = faults.judge(prompt)
        if verdict.crash:
            on_crash()
        return verdict

    app[STATE] = ServerState(cfg, Engine(cfg, faults), faults, judge, ready=cfg.args.startup_delay <= 0)
    model._stream()  # build the text stream now, not on the first request
    r = app.router
    r.add_get("/health", health)
    r.add_get("/health_generate", health)
    r.add_get("/ready", ready)
    r.add_get("/model_info", model_info)
    r.add_get("/get_model_info", model_info)
    r.add_get("/server_info", server_info)
    r.add_get("/get_server_info", server_info)
    r.add_get("/v1/models", models)
    r.add_get("/v1/models/{model:.+}", model_card)
    r.add_get("/v1/loads", loads)
    r.add_post("/generate", handle_generate)
    r.add_put("/generate", handle_generate)
    r.add_post("/v1/chat/completions", handle_chat)
    for path in ("/v1/tokenize", "/tokenize"):
        r.add_post(path, handle_tokenize)
    for path in ("/v1/detokenize", "/detokenize"):
        r.add_post(path, handle_detokenize)
    if cfg.args.enable_metrics:  # without --enable-metrics there is no /metrics route (404)
        r.add_get("/metrics", metrics)
    r.add_post("/abort_request", abort_request)
    r.add_route("*", "/_emulator/faults", fault_route)
    r.add_get("/_emulator/stats", stats_route)
    r.add_get("/_emulator/routes", routes_route)
    return app


async def abort_request(request: web.Request) -> web.Response:
    """http_server.abort_request: an AbortReq (`rid`, `abort_all`); 200 with an empty body, known rid or not."""
    body = await read_json(request, require_json_content_type=False)
    if isinstance(body, web.Response):
        return body
    rid, abort_all = (body.get("rid"), body.get("abort_all", False)) if isinstance(body, dict) else (None, None)
    if not isinstance(body, dict) or not isinstance(rid, str | None) or not isinstance(abort_all, bool):
        return validation_error([{"type": "model_type", "loc": ["body"], "msg": "Input should be an AbortReq"}])
    request.app[STATE].engine.abort_request(rid or "", abort_all)
    return web.Response(status=200)


async def routes_route(request: web.Request) -> web.Response:
    """Emulator-only: {"METHOD /path STATUS": count} of every request served so far (see route_log)."""
    routes: Counter[str] = request.app[ROUTES]
    return web.json_response(dict(routes))


async def stats_route(request: web.Request) -> web.Response:
    """Emulator-only: each DP rank's running count at every change as (monotonic s, running) and
    max_running_requests; the last requests' sampling parameters; the stalled rids, the aborts asked and counted."""
    engine = request.app[STATE].engine
    return web.json_response(
        {
            "now": time.monotonic(),
            "ranks": [
                {"max_running_requests": s.max_running_requests, "timeline": list(s.timeline)}
                for s in engine.schedulers
            ],
            "sampled": list(engine.sampled),
            "stalled_rids": engine.stalled_rids,
            "abort_requests": engine.abort_requests,
            "num_aborted": engine.num_aborted,
        }
    )


async def _announce_when_ready(app: web.Application) -> None:
    """Warmup: /health answers 503 for --startup-delay seconds, then the ready line."""
    await asyncio.sleep(app[STATE].cfg.args.startup_delay)
    app[STATE].ready = True
    log.info(READY_LINE)


async def fault_route(request: web.Request) -> web.Response:
    """Emulator-only (not SGLang): see faults.py for the settings."""
    faults = request.app[STATE].faults
    if request.method == "POST":
        try:
            faults.update(await request.json())
        except (ValueError, TypeError, AttributeError) as e:
            return json_response({"error": str(e)}, 400)
    elif request.method == "DELETE":
        faults.clear()
    elif request.method != "GET":
        return web.Response(status=405)
    return json_response(faults.to_dict())


# ---- serving ----


async def serve(
    cfg: EmulatorSetup, *, stop: asyncio.Event | None = None, on_crash=crash_process, on_bound=None
) -> None:
    """Run until `stop` is set (or forever). `on_bound(port)` fires once listening."""
    model.build_streams(bool(cfg.args.non_ascii))
    app = create_app(cfg, on_crash=on_crash)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, cfg.args.host, cfg.args.port, backlog=1024, reuse_address=True)
    await site.start()
    port = runner.addresses[0][1]  # the real port when --port 0
    for w in cfg.warnings:
        log.warning(w)
    log.info(
        "emulated SGLang %s serving %s on http://%s:%d (context %d, max_running_requests %d, KV %d tokens, vocab %d)",
        VERSION,
        cfg.served_model_name,
        cfg.args.host,
        port,
        cfg.context_len,
        cfg.max_running_requests,
        cfg.max_total_num_tokens,
        tok.VOCAB_SIZE,
    )
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_announce_when_ready(app))]
    if parent := os.environ.get(EXIT_WITH_PARENT):
        tasks.append(loop.create_task(_stop_when_orphaned(stop, int(parent))))
    if on_bound:
        on_bound(port)
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await runner.cleanup()


async def _stop_when_orphaned(stop: asyncio.Event, parent: int, every_s: float = 1.0) -> None:
    """Set `stop` once process `parent` is gone (a pidfd on Linux, else polling the parent pid)."""
    try:
        pidfd = os.pidfd_open(parent)
    except ProcessLookupError:
        pass  # gone already
    except (AttributeError, OSError):  # no pidfds here
        while os.getppid() == parent:
            await asyncio.sleep(every_s)
    else:
        gone = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(pidfd, gone.set)  # readable when the process exits
        try:
            await gone.wait()
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
    log.warning("emulator: the process that started it (pid %d) is gone; stopping", parent)
    stop.set()
