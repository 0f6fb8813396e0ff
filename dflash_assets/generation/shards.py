"""Build one prompt shard: validated prompts with stable ids and exact chat-template token counts."""

from __future__ import annotations

import asyncio
import itertools
import re
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from dflash_assets.fleet.client import ServerError
from dflash_assets.fleet.fleet import Fleet
from dflash_assets.generation.dedupe import source_repeats
from dflash_assets.generation.prompts import (
    FieldMapping,
    Prompt,
    SourceReject,
    canonical_json,
    format_counts,
    read_shard,
    shard_fingerprint,
    shard_keys,
)
from dflash_assets.generation.quotas import source_draws
from dflash_assets.rules import prompt_over_context
from dflash_assets.settings import Deployment, QuotaSettings, RepeatSettings
from dflash_assets.store.schema import PromptRow, RejectRow
from dflash_assets.store.source import ShardSource, has_completions, recorded_sources
from dflash_assets.store.storage import open_storage
from dflash_assets.store.stores import ids_in_other_shards, prompt_store, reject_store


def source_refusal(source: Path, shard_size: int, data_dir: str | Path, shards: list[str] | None = None) -> str | None:
    """Why `source` cut at `shard_size` may not write into `data_dir` (one line, with the fix), or None: another
    source than its shards record, or a shard with completions that would change under them. `shards`: only these.
    """
    source, where = Path(source).resolve(), open_storage(data_dir)
    recorded = recorded_sources(where)
    data_dir_var, shard_size_var = Deployment.DATA_DIR.name, Deployment.SHARD_SIZE.name
    fix = f"set {data_dir_var} to a new directory for {source}"
    others = sorted({r.path for r in recorded.values()} - {str(source)})
    if others:
        return (
            f"data dir {where} holds the prompt shards of {others[0]}, not of {source}: a data dir belongs to one "
            f"prompt source; {fix} (or give --prompts {others[0]} to go on with it)"
        )
    keys = set(shard_keys(source, shard_size))
    for shard, record in recorded.items():
        if (shards is not None and shard not in shards) or not has_completions(where, shard):
            continue  # a shard without completions is rebuilt from the source as it is now
        if record.shard_size != shard_size:
            return (
                f"data dir {where}: its shards of {source} were cut at {shard_size_var} {record.shard_size}, not "
                f"{shard_size}, and shard {shard} has completions; set {shard_size_var}={record.shard_size}, or "
                f"{fix} cut at {shard_size}"
            )
        now = shard_fingerprint(source, int(shard), shard_size, record.lines) if shard in keys else (0, "none")
        if now != (record.lines, record.fingerprint):
            return (
                f"data dir {where}: the lines of shard {shard} changed under its completions: {source} as recorded "
                f"({record.lines} lines, fingerprint {record.fingerprint}) is not {source} as it is now ({now[0]} of "
                f"them, fingerprint {now[1]}); restore the file, or {fix} as it is now"
            )
    return None


@dataclass(frozen=True)
class ShardBuild:
    shard: str
    lines: int
    prompts: int
    rejected: int
    max_prompt_tokens: int
    reasons: dict[str, int]  # reject reason kind -> count
    formats: dict[str, int]  # prompts of each source format (prompts.FORMATS), most first
    repeats: int = 0  # lines that repeat an earlier line of the source (generation/dedupe.py), rejected or kept


def reason_kind(reason: str) -> str:
    """'line 7: message 0 has unknown role 'x'' -> "message N has unknown role '…'": what counts alike."""
    text = re.sub(r" \(.*\)$", "", reason.split(": ", 1)[-1])
    text = re.sub(r"'[^']*'", "'…'", text)
    return re.sub(r"(?<![-\w])\d+", "N", text.split(": ", 1)[0] if text.startswith("invalid JSON") else text)


@dataclass(frozen=True)
class SourceRules:
    """How a source's lines become a shard's prompts besides their format: the field mapping of a source that fits no
    known format, what a repeat is (generation/dedupe.py) and the quotas of its sources (generation/quotas.py)."""

    mapping: FieldMapping | None = None
    repeats: RepeatSettings = RepeatSettings()
    quotas: QuotaSettings = QuotaSettings()


TOKENIZE_CONCURRENCY = 64  # /v1/tokenize requests in flight while a shard's prompts are counted


@dataclass
class _Admission:
    """Who is let into a shard: not a duplicate id of another shard, not a repeat (unless kept), drawn by its
    source's quota, counted by the fleet and no longer than the context."""

    fleet: Fleet
    template_kwargs: dict
    rules: SourceRules
    elsewhere: dict[str, str]  # prompt_id -> the other shard that holds it
    repeats: dict
    left_out: dict

    def __post_init__(self) -> None:
        self.context = min(i.context_length for i in self.fleet.infos)
        self.clients = itertools.cycle(self.fleet.clients)
        self.gate = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

    def refused(self, item: Prompt) -> SourceReject | None:
        """Why a prompt is refused before it is counted, or None."""
        if item.prompt_id in self.elsewhere:
            where = f"already in shard {self.elsewhere[item.prompt_id]}"
            return SourceReject(
                item.line, f"line {item.line}: duplicate id {item.prompt_id!r} ({where})", item.prompt_id
            )
        if item.line in self.repeats and not self.rules.repeats.keep_repeats:
            return SourceReject(item.line, self.repeats[item.line].reason, item.prompt_id)
        if item.line in self.left_out:
            reason = self.left_out[item.line].reason(item.line, self.rules.quotas.quota_seed)
            return SourceReject(item.line, reason, item.prompt_id)
        return None

    async def admit(self, item: Prompt | SourceReject) -> tuple[Prompt, int] | SourceReject:
        if isinstance(item, SourceReject):
            return item
        if (refused := self.refused(item)) is not None:
            return refused
        async with self.gate:
            try:
                n = await next(self.clients).count_prompt_tokens(item.request, self.template_kwargs, item.tools)
            except ServerError as e:
                if e.retryable:  # the server's trouble, retried already: fail the build, never a permanent reject
                    raise
                return SourceReject(item.line, f"line {item.line}: tokenize failed: {e.message}", item.prompt_id)
        if prompt_over_context(n, self.context):
            why = f"line {item.line}: prompt of {n} tokens is longer than the model's context length ({self.context} tokens)"
            return SourceReject(item.line, why, item.prompt_id, n)
        return item, n


async def build_prompt_shard(
    source: Path,
    index: int,
    shard: str,
    shard_size: int,
    data_dir: str | Path,
    fleet: Fleet,
    template_kwargs: dict,
    rules: SourceRules = SourceRules(),
) -> ShardBuild:
    """Validate, count and write one shard's prompts; a line that repeats an earlier line of the source (exactly, or
    nearly: generation/dedupe.py) is rejected, or kept and counted with `keep_repeats`; a prompt the quota of its
    source does not draw (generation/quotas.py) is rejected."""
    items = list(read_shard(source, index, shard_size, rules.mapping))
    # every repeat for the quotas' draw (it leaves them out), else only the shard's own lines' (1-based)
    own = None if rules.quotas.quotas else range(index * shard_size + 1, (index + 1) * shard_size + 1)
    repeats = source_repeats(source, data_dir, rules.mapping, rules.repeats, own)
    kept = () if rules.repeats.keep_repeats else repeats
    left_out = source_draws(source, data_dir, rules.mapping, rules.quotas, kept)
    elsewhere = ids_in_other_shards(data_dir, shard, [i.prompt_id for i in items if isinstance(i, Prompt)])
    admission = _Admission(fleet, template_kwargs, rules, elsewhere, repeats, left_out)
    results = await asyncio.gather(*(admission.admit(i) for i in items))
    kwargs_json = canonical_json(template_kwargs)
    prompts = [
        PromptRow(
            prompt_id=p.prompt_id,
            shard=shard,
            line=p.line,
            source=p.source,
            messages_json=p.messages_json,
            prompt_tokens=n,
            template_kwargs_json=kwargs_json,
            tools_json=p.tools_json,
        )
        for r in results
        if not isinstance(r, SourceReject)
        for p, n in [r]
    ]
    now, refused = datetime.now(UTC), [r for r in results if isinstance(r, SourceReject)]
    rejects = [
        RejectRow(
            shard=shard,
            stage="source",
            line=r.line,
            prompt_id=r.prompt_id,
            config_hash=None,
            reason=r.reason,
            prompt_tokens=r.prompt_tokens,
            max_output_tokens=None,
            server_context_length=admission.context,
            created_at=now,
        )
        for r in refused
    ]
    lines, fingerprint = shard_fingerprint(source, index, shard_size)
    record = ShardSource(str(Path(source).resolve()), shard_size, lines, fingerprint)
    prompt_store(data_dir, shard).replace(prompts, "prompts.parquet", record.metadata())
    reject_store(data_dir, shard, "source").replace(rejects, "rejects.parquet")
    return ShardBuild(
        shard,
        len(items),
        len(prompts),
        len(rejects),
        max((p.prompt_tokens or 0 for p in prompts), default=0),
        dict(Counter(reason_kind(r.reason) for r in refused)),
        format_counts([r[0] for r in results if not isinstance(r, SourceReject)]),
        sum(1 for i in items if isinstance(i, Prompt) and i.line in repeats),
    )
