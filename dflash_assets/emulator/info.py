"""Read-only routes: health, model and server info, /v1/models, /v1/loads (v1_loads.py, load_snapshot.py) and
/metrics (metrics_collector.py), with 0.5.23's keys. GPU figures are plausible constants, read only by humans.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from aiohttp import web

from .config import EmulatorSetup, mamba_ratio, server_args_dict
from .engine import Engine
from .responses import http_exception, json_response
from .state import STATE


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if not st.ready or st.faults.unhealthy:
        return web.Response(status=503)  # ServerStatus.Starting answers at once
    # a healthy answer waits for the one-token health generation: at least its first asyncio.sleep(1)
    delay = st.cfg.health_delay if request.path == "/health" else max(1.0, st.cfg.health_delay)
    if delay:
        await asyncio.sleep(delay)
    return web.Response(status=200)


async def ready(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[STATE].ready else 503)


async def model_info(request: web.Request) -> web.Response:
    cfg = request.app[STATE].cfg
    a = cfg.args
    return json_response(
        {
            "model_path": a.model_path,
            "served_model_name": cfg.served_model_name,
            "tokenizer_path": a.tokenizer_path or a.model_path,
            "is_generation": True,
            "preferred_sampling_params": a.preferred_sampling_params,
            "weight_version": a.weight_version or "default",
            "load_format": a.load_format or "auto",
            # config_value("reasoning_parser"): `auto` already resolved by template detection (entrypoints/engine.py)
            "reasoning_parser": cfg.reasoning_parser,
            "tool_call_parser": a.tool_call_parser,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForCausalLM" if not a.dense_model else "Qwen3ForCausalLM"],
        }
    )


def _internal_state(cfg: EmulatorSetup, engine: Engine, rank: int, args: dict, startup: float) -> dict:
    sched = engine.schedulers[rank]
    return {
        **args,
        "world_size": cfg.args.tp_size * max(1, cfg.args.dp_size),
        "startup_time": startup,
        "effective_max_running_requests_per_dp": cfg.max_running_requests,
        "last_gen_throughput": sched.gen_throughput(time.monotonic()),
        "memory_usage": {
            "weight": 51.2,
            "kvcache": round(cfg.max_total_num_tokens * 16 / 1024**2, 3),
            "startup_available": 79.1,
            "token_capacity": cfg.max_total_num_tokens,
            "token_capacity_swa": None,
            "graph": {"decode": 0.412},
        },
        "disaggregation_mode": "null",
        "decode_cuda_graph_bs": list(range(1, min(cfg.max_running_requests, 256) + 1)),
        "decode_cuda_graph_memory_gb": 0.412,
    }


async def server_info(request: web.Request) -> web.Response:
    cfg, engine = request.app[STATE].cfg, request.app[STATE].engine
    args = server_args_dict(cfg)
    startup = round(time.monotonic() - request.app[STATE].started, 3)
    body = {
        **args,
        # the scheduler handshake (Scheduler.get_init_info)
        "status": "ready",
        "max_total_num_tokens": cfg.max_total_num_tokens,
        "max_req_input_len": cfg.max_req_input_len,
        "hicache_object_layout": None,
        "kv_events": None,
        "startup_time": request.app[STATE].startup_time,
        "internal_states": [
            _internal_state(cfg, engine, rank, args, startup) for rank in range(len(engine.schedulers))
        ],
        "version": cfg.args.reported_version,
        "frontend": "python",
    }
    return json_response(body)


async def models(request: web.Request) -> web.Response:
    cfg = request.app[STATE].cfg
    return json_response({"object": "list", "data": [_card(cfg, cfg.served_model_name)]})


def _card(cfg: EmulatorSetup, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": name,
        "parent": None,
        "max_model_len": cfg.context_len,
    }


async def model_card(request: web.Request) -> web.Response:
    cfg = request.app[STATE].cfg
    name = request.match_info["model"]
    if name != cfg.served_model_name:
        missing = {"message": f"The model '{name}' does not exist", "type": "invalid_request_error", "param": "model"}
        return json_response({"error": {**missing, "code": "model_not_found"}}, 404)
    return json_response(_card(cfg, name))


_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}


async def loads(request: web.Request) -> web.Response:
    """/v1/loads (entrypoints/v1_loads.py): per-DP-rank LoadSnapshot.to_dict."""
    cfg, engine = request.app[STATE].cfg, request.app[STATE].engine
    include = request.query.get("include")
    include_set = {s.strip() for s in include.split(",")} if include else None
    if include_set is not None and not include_set <= _SECTIONS:
        msg = f"Invalid include sections: {include_set - _SECTIONS}. Valid options: {sorted(_SECTIONS)}"
        return http_exception(msg, 400)
    rows = engine.loads()
    if "dp_rank" in request.query:
        rows = [r for r in rows if str(r["dp_rank"]) == request.query["dp_rank"]]

    def wants(section: str) -> bool:  # LoadSnapshot.to_dict: core always, sections on request
        return include_set is None or "all" in include_set or section in include_set

    for row in rows:
        if wants("memory"):
            row["memory"] = {
                "weight_gb": 51.2,
                "kv_cache_gb": round(cfg.max_total_num_tokens * 16 / 1024**2, 3),
                "graph_gb": 0.412,
                "token_capacity": cfg.max_total_num_tokens,
            }
        if wants("disagg"):
            row["disaggregation"] = {
                "mode": "null",
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            }
        if wants("queues"):
            row["queues"] = {
                "waiting": row["num_waiting_reqs"],
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            }
    out = rows
    if request.query.get("format") == "prometheus":
        lines = []
        for key in out[0] if out else ():
            if isinstance(out[0][key], (int, float)) and not isinstance(out[0][key], bool) and key != "dp_rank":
                lines.append(f"# TYPE sglang_{key} gauge")
                lines += [f'sglang_{key}{{dp_rank="{r["dp_rank"]}"}} {r[key]}' for r in out]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")
    return json_response(
        {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": cfg.args.reported_version,
            "accelerator": "NVIDIA H100 80GB HBM3 (emulated)",
            "num_accelerators": cfg.args.tp_size,
            "loads": out,
        }
    )


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text: scheduler gauges per DP rank, tokenizer counters."""
    cfg, engine = request.app[STATE].cfg, request.app[STATE].engine
    base = f'model_name="{cfg.served_model_name}",engine_type="unified"'
    lines: list[str] = []

    def family(name, kind, doc, samples):
        lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{{{labels}}} {value}" for labels, value in samples)

    now = time.monotonic()
    scheds = engine.schedulers
    ranks = [
        (f'{base},tp_rank="0",pp_rank="0",moe_ep_rank="0"' + (f',dp_rank="{s.dp_rank}"' if len(scheds) > 1 else ""), s)
        for s in scheds
    ]
    gauges = [
        ("sglang:num_running_reqs", "The number of running requests.", lambda s: len(s.running)),
        ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", lambda s: len(s.waiting)),
        ("sglang:num_retracted_reqs", "The number of retracted requests.", lambda s: 0),
        ("sglang:num_paused_reqs", "The number of paused requests.", lambda s: 0),
        ("sglang:gen_throughput", "The generation throughput (token/s).", lambda s: round(s.gen_throughput(now), 2)),
        ("sglang:cache_hit_rate", "The prefix cache hit rate.", lambda s: 0.0),
        ("sglang:token_usage", "The token usage.", lambda s: round(s.used_tokens(now) / s.max_total_num_tokens, 4)),
        ("sglang:num_used_tokens", "The number of used tokens.", lambda s: s.used_tokens(now)),
        ("sglang:utilization", "The utilization.", lambda s: round(len(s.running) / s.max_running_requests, 4)),
        (
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            lambda s: s.max_total_num_tokens,
        ),
        ("sglang:context_len", "The context length of the model.", lambda s: cfg.context_len),
    ]
    if mamba := cfg.max_mamba_cache_size:  # a hybrid model: its state slots, held per running request (no prefix reuse)
        slots = mamba_ratio(cfg.args)
        gauges.append(
            (
                "sglang:mamba_usage",
                "The token usage for Mamba layers.",
                lambda s: round(min(1.0, len(s.running) * slots / mamba), 4),
            )
        )
    for name, doc, fn in gauges:
        family(name, "gauge", doc, [(labels, fn(s)) for labels, s in ranks])
    for key, name, doc in (
        ("prompt_tokens", "sglang:prompt_tokens_total", "Number of prefill tokens processed."),
        ("generation_tokens", "sglang:generation_tokens_total", "Number of generation tokens processed."),
        ("requests", "sglang:num_requests_total", "Number of requests processed."),
    ):
        samples = [(f'{base},is_streaming="{k}"', float(v)) for k, v in sorted(engine.counters[key].items())]
        family(name, "counter", doc, samples or [(f'{base},is_streaming="false"', 0.0)])
    family(
        "sglang:num_aborted_requests_total",
        "counter",
        "Number of requests aborted.",
        [(base, float(engine.num_aborted))],
    )
    lines += [
        "# HELP sglang:e2e_request_latency_seconds Histogram of End-to-end request latency in seconds",
        "# TYPE sglang:e2e_request_latency_seconds histogram",
        f'sglang:e2e_request_latency_seconds_bucket{{{base},le="+Inf"}} {float(engine.e2e_count)}',
        f"sglang:e2e_request_latency_seconds_count{{{base}}} {float(engine.e2e_count)}",
        f"sglang:e2e_request_latency_seconds_sum{{{base}}} {engine.e2e_sum}",
    ]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")
