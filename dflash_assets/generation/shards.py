"""Build one prompt shard: validated prompts with stable ids and exact chat-template token counts."""

from __future__ import annotations

import asyncio
import itertools
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from dflash_assets.fleet.client import ServerError
from dflash_assets.fleet.fleet import Fleet
from dflash_assets.generation.prompts import (
    FieldMapping,
    Prompt,
    SourceReject,
    canonical_json,
    format_counts,
    read_shard,
)
from dflash_assets.store.stores import ids_in_other_shards, prompt_store, reject_store


@dataclass(frozen=True)
class ShardBuild:
    shard: str
    lines: int
    prompts: int
    rejected: int
    max_prompt_tokens: int
    reasons: dict[str, int]  # reject reason kind -> count
    formats: dict[str, int]  # prompts of each source format (prompts.FORMATS), most first


def reason_kind(reason: str) -> str:
    """'line 7: message 0 has unknown role 'x'' -> "message N has unknown role '…'": what counts alike."""
    text = re.sub(r" \(.*\)$", "", reason.split(": ", 1)[-1])
    text = re.sub(r"'[^']*'", "'…'", text)
    return re.sub(r"(?<![-\w])\d+", "N", text.split(": ", 1)[0] if text.startswith("invalid JSON") else text)


async def build_prompt_shard(
    source: Path,
    index: int,
    shard: str,
    shard_size: int,
    data_dir: str | Path,
    fleet: Fleet,
    template_kwargs: dict,
    concurrency: int = 64,
    mapping: FieldMapping | None = None,
) -> ShardBuild:
    items = list(read_shard(source, index, shard_size, mapping))
    elsewhere = ids_in_other_shards(data_dir, shard)
    context = min(i.context_length for i in fleet.infos)
    clients = itertools.cycle(fleet.clients)
    gate = asyncio.Semaphore(concurrency)

    async def admit(item: Prompt | SourceReject) -> tuple[Prompt, int] | SourceReject:
        if isinstance(item, SourceReject):
            return item
        if item.prompt_id in elsewhere:
            return SourceReject(
                item.line,
                f"line {item.line}: duplicate id {item.prompt_id!r} (already in shard {elsewhere[item.prompt_id]})",
                item.prompt_id,
            )
        async with gate:
            try:
                n = await next(clients).count_prompt_tokens(item.request, template_kwargs)
            except ServerError as e:
                if e.retryable:  # the server's trouble, retried already: fail the build, never a permanent reject
                    raise
                return SourceReject(item.line, f"line {item.line}: tokenize failed: {e.message}", item.prompt_id)
        if n >= context:
            return SourceReject(
                item.line,
                f"line {item.line}: prompt of {n} tokens is longer than the model's context length ({context} tokens)",
                item.prompt_id,
            )
        return item, n

    results = await asyncio.gather(*(admit(i) for i in items))
    kwargs_json = canonical_json(template_kwargs)
    prompts = [
        {
            "prompt_id": p.prompt_id,
            "shard": shard,
            "line": p.line,
            "source": p.source,
            "messages_json": p.messages_json,
            "prompt_tokens": n,
            "template_kwargs_json": kwargs_json,
        }
        for r in results
        if not isinstance(r, SourceReject)
        for p, n in [r]
    ]
    now = datetime.now(UTC)
    rejects = [
        {
            "shard": shard,
            "stage": "source",
            "line": r.line,
            "prompt_id": r.prompt_id,
            "config_hash": None,
            "reason": r.reason,
            "prompt_tokens": None,
            "max_output_tokens": None,
            "server_context_length": context,
            "created_at": now,
        }
        for r in results
        if isinstance(r, SourceReject)
    ]
    prompt_store(data_dir, shard).replace(prompts, "prompts.parquet")
    reject_store(data_dir, shard, "source").replace(rejects, "rejects.parquet")
    reasons: dict[str, int] = {}
    for r in rejects:
        kind = reason_kind(str(r["reason"]))
        reasons[kind] = reasons.get(kind, 0) + 1
    return ShardBuild(
        shard,
        len(items),
        len(prompts),
        len(rejects),
        max((int(p["prompt_tokens"]) for p in prompts), default=0),
        reasons,
        format_counts([r[0] for r in results if not isinstance(r, SourceReject)]),
    )
