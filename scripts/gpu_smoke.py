"""A real-GPU smoke run: one server launched through `launch` mode, every branch of the pipeline, and what the
client recorded compared with what the server itself says. Run through scripts/gpu_smoke.sh.

Branches: a cap small enough to truncate, a prompt too long for the context (a preflight reject), a context 400
forced past preflight (a prompt whose stored token count lies), continuation by token ids, the quality checks
and the training export. The comparison: /metrics counters (requests, prompt and generation tokens, as deltas
over the run) against the rows, /v1/models and /server_info against what the rows and rejects record. Exit 1 on
any disagreement, 2 when the run itself could not be made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import duckdb
from rich.console import Console
from rich.table import Table

from dflash_assets.fleet import launcher
from dflash_assets.fleet.client import ServerClient
from dflash_assets.fleet.fleet import on_fleet, open_session
from dflash_assets.fleet.launcher import build_spec
from dflash_assets.generation.continuation import continue_shard
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import SourceRules, build_prompt_shard
from dflash_assets.quality import run_checks
from dflash_assets.quality.training.export import export_training_set
from dflash_assets.settings import (
    Deployment,
    DispatchSettings,
    GenerationSettings,
    LaunchSettings,
    RepeatSettings,
)
from dflash_assets.store.stores import prompt_store

SHARD = "00000"
COUNTERS = ("sglang:num_requests_total", "sglang:prompt_tokens_total", "sglang:generation_tokens_total")
QUESTIONS = [
    "What is 17 times 23? Show the steps.",
    "Name three prime numbers above 100.",
    "Explain recursion briefly.",
    "Write a haiku about rain.",
    "What is the capital of Australia?",
    "Sort 5, 2, 9, 1 in ascending order.",
    "Why is the sky blue?",
    "Give a one-line Python function that reverses a string.",
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_smoke.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="a small model the GPU holds (e.g. Qwen/Qwen3-0.6B)")
    p.add_argument("--gpu", default="0")
    p.add_argument("--port", type=int, default=30555)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--cap", type=int, default=48, help="small enough that thinking answers are cut")
    p.add_argument("--continue-to", type=int, default=512, help="the cap truncated rows are continued to")
    p.add_argument("--reasoning-parser", default="qwen3")
    p.add_argument("--work-dir", default="gpu_smoke_work", help="fleet registry, data and export go here")
    p.add_argument("--extra-args", default="", help="more server flags, quoted as one string")
    p.add_argument("--keep-server", action="store_true", help="leave the server up afterwards (it is reusable)")
    return p.parse_args(argv)


def counters(text: str) -> dict[str, float]:
    """Each counter summed over its label sets (is_streaming, dp_rank ...)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


async def server_view(url: str, key: str | None) -> dict:
    async with open_session() as session:
        client = ServerClient(session, url, key)
        text = await client.metrics()
        if text is None:
            raise SystemExit(f"{url}/metrics answered 404: the server must run with --enable-metrics")
        return {"counters": counters(text), "info": await client.info()}


UNIT = " the river runs past the old mill"


async def long_prompt(url: str, key: str | None, tokens: int) -> str:
    """A prompt of about `tokens` chat-template tokens, measured with the server's own tokenizer."""
    async with open_session() as session:
        client = ServerClient(session, url, key)

        async def count(units: int) -> int:
            text = "Summarise this text:" + UNIT * units
            return await client.count_prompt_tokens([{"role": "user", "content": text}], {"enable_thinking": True})

        base, per = await count(0), (await count(100) - await count(0)) / 100
        units = max(0, int((tokens - base) / per))
        while await count(units) > tokens:  # per-unit merges at the edges: step down to the target
            units -= 1
        return "Summarise this text:" + UNIT * units


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 140)
    work = Path(args.work_dir).resolve()
    data, fleet_dir = work / "data", work / "fleet"
    command = Deployment.SGLANG_COMMAND.value()
    spec = build_spec(
        LaunchSettings(
            model_path=args.model_path,
            gpus=args.gpu,
            command=command,
            base_port=args.port - int(args.gpu.split(",")[0]),
            context_length=args.context_length,
            reasoning_parser=args.reasoning_parser,
            enable_metrics=True,
            extra_args=args.extra_args,
        )
    )
    key = os.environ.get(spec.api_key_env) or None
    console.print(f"launching {command} with {args.model_path} on GPU {args.gpu} (registry {fleet_dir})")
    [record] = launcher.up(spec, fleet_dir, on_event=console.print)
    url = [record.url]
    try:
        return run(args, console, data, work, url, key)
    finally:
        if not args.keep_server:
            launcher.down(fleet_dir, on_event=console.print)


def run(args, console: Console, data: Path, work: Path, url: list[str], key: str | None) -> int:
    before = asyncio.run(server_view(url[0], key))
    context = before["info"].context_length
    # two prompts too long for prompt + cap: the first is rejected by preflight; the second's stored count is
    # made to lie below, so it goes past preflight and the server answers 400
    src = work / "prompts.jsonl"
    lines = [{"id": f"q{i}", "prompt": q} for i, q in enumerate(QUESTIONS)]
    # between the preflight limit (context - 2 - cap) and the server's input limit (max_req_input_len)
    target = min(context - 2 - args.cap // 2, (before["info"].max_req_input_len or context) - 1)
    too_long = asyncio.run(long_prompt(url[0], key, target))
    lines += [{"id": "too_long_preflight", "prompt": too_long}, {"id": "too_long_server", "prompt": too_long + " ."}]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    keep = RepeatSettings(keep_repeats=True)  # the two long prompts are near repeats on purpose: both reach preflight
    built = on_fleet(
        url,
        lambda f: build_prompt_shard(
            src, 0, SHARD, len(lines), data, f, {"enable_thinking": True}, SourceRules(repeats=keep)
        ),
        key,
    )
    store = prompt_store(data, SHARD)
    rows = store.read().to_pylist()
    for row in rows:
        if row["prompt_id"] == "too_long_server":
            row["prompt_tokens"] = 10  # a stale count: preflight believes it fits
    store.replace(rows, "prompts.parquet")

    settings = DispatchSettings(store_token_ids=True, load_sample_s=0, commit_rows=4, commit_seconds=1.0)
    config = GenerationSettings(max_output_tokens=args.cap, cap_policy="fixed")
    fresh = on_fleet(url, lambda f: generate_shard(data, SHARD, f, config, settings, log=console.print), key)
    cont = on_fleet(
        url,
        lambda f: continue_shard(data, SHARD, f, fresh.config_hash, args.continue_to, settings, log=console.print),
        key,
    )
    outcomes = run_checks(data)
    export = export_training_set(data, work / "export", config_hash=cont.config_hash, max_length=None)
    after = asyncio.run(server_view(url[0], key))

    rec = recorded(data, fresh.config_hash, cont.config_hash)
    delta = {k: int(after["counters"][k] - before["counters"][k]) for k in COUNTERS}
    info = after["info"]
    exported = export.manifest["rows"] + sum(export.manifest["excluded_by_config"].get(cont.config_hash, {}).values())
    checks = [
        ("prompts admitted to the shard", built.prompts, len(lines), "lines written (all fit the context)"),
        ("generation requests", rec["requests"], delta["sglang:num_requests_total"], "/metrics num_requests_total"),
        ("prompt tokens", rec["prompt_tokens"], delta["sglang:prompt_tokens_total"], "/metrics prompt_tokens_total"),
        (
            "generated tokens",
            rec["generated"],
            delta["sglang:generation_tokens_total"],
            "/metrics generation_tokens_total",
        ),
        ("server context length", rec["contexts"], [context], "/v1/models max_model_len"),
        ("model", rec["models"], [info.model], "/v1/models id"),
        ("rows truncated at the cap", rec["truncated"] > 0, True, f"rows 'length' at cap {args.cap}"),
        (
            "'length' rows below their cap",
            rec["clamped"],
            0,
            f"/server_info max_req_input_len {info.max_req_input_len}, KV pool {info.max_total_num_tokens}",
        ),
        ("preflight rejects", rec["preflight"], ["too_long_preflight"], "prompt + cap over the context"),
        ("server rejects (HTTP 400)", rec["server"], ["too_long_server"], "the server's context check"),
        ("rows continued by token ids", cont.continued, rec["continued"], "rows with tokens_reused"),
        ("continued rows keep the parent's prompt ids", rec["continued_ok"], True, "prompt_token_ids vs prompt_tokens"),
        (
            "accounting (completed+rejected+failed)",
            fresh.completed + fresh.rejected + fresh.failed,
            fresh.prompts,
            "prompts of the shard",
        ),
        ("export: kept + excluded rows", exported, rec["new_config_rows"], "rows of the new config"),
    ]
    table = Table(title=f"gpu smoke: {url[0]} ({info.model})")
    for col in ("what", "client recorded", "server / expected", "from", "agree"):
        table.add_column(col)
    bad = 0
    for what, client, server, source in checks:
        ok = client == server
        bad += not ok
        table.add_row(what, str(client), str(server), source, "[green]yes[/]" if ok else "[red]NO[/]")
    console.print(table)
    for o in outcomes:
        console.print(f"check {o.name}: {'passed' if o.passed else o.severity}")
    console.print(f"{bad} disagreement(s)" if bad else "client and server agree")
    return 1 if bad else 0


def recorded(data: Path, fresh: str, cont: str) -> dict:
    """What the client's Parquet files say, recounted with DuckDB."""
    comp = f"read_parquet('{data}/completions/**/*.parquet', union_by_name = true, hive_partitioning = false)"
    rej = f"read_parquet('{data}/rejects/**/*.parquet', union_by_name = true, hive_partitioning = false)"
    q = lambda sql: duckdb.sql(sql).fetchall()  # noqa: E731
    [(n_fresh, p_fresh, g_fresh, truncated)] = q(
        f"select count(*), sum(prompt_tokens), sum(completion_tokens), count(*) filter (where finish_reason = "
        f"'length') from {comp} where config_hash = '{fresh}'"
    )
    # continued rows: the request's prompt was the parent's prompt + its output ids; only the rest was generated
    [(n_cont, p_cont, g_cont, ok)] = q(
        f"select count(*), coalesce(sum(prompt_tokens + tokens_reused), 0), "
        f"coalesce(sum(completion_tokens - tokens_reused), 0), coalesce(bool_and(len(prompt_token_ids) = "
        f"prompt_tokens), true) from {comp} where config_hash = '{cont}' and parent_config_hash is not null "
        f"and tokens_reused < completion_tokens"
    )
    return {
        "requests": n_fresh + n_cont,
        "prompt_tokens": p_fresh + p_cont,
        "generated": g_fresh + g_cont,
        "truncated": truncated,
        "continued": n_cont,
        "continued_ok": ok,
        "contexts": [r[0] for r in q(f"select distinct server_context_length from {comp}")],
        "models": [r[0] for r in q(f"select distinct model from {comp}")],
        "clamped": q(
            f"select count(*) from {comp} where finish_reason = 'length' and completion_tokens < max_output_tokens"
        )[0][0],
        "preflight": [
            r[0]
            for r in q(f"select prompt_id from {rej} where stage = 'preflight' and config_hash = '{fresh}' order by 1")
        ],
        "server": [
            r[0]
            for r in q(
                f"select prompt_id from {rej} where stage = 'server' and config_hash = '{fresh}' "
                f"and reason like 'HTTP 400:%' order by 1"
            )
        ],
        "new_config_rows": q(f"select count(*) from {comp} where config_hash = '{cont}'")[0][0],
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
