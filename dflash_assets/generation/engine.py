"""Generate the completions of one shard: resume from committed parts, preflight, dispatch, commit.

Restart-safe by construction: the remaining work is recomputed from the committed Parquet parts on
every start (prompts of the shard minus rows of this config minus rejects of this config), so a
`kill -9` loses at most the requests in flight and the rows not yet committed, and never duplicates.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_assets.fleet.client import ServerError
from dflash_assets.fleet.fleet import Fleet
from dflash_assets.fleet.tuning import LoadSampler
from dflash_assets.generation.config import DispatchSettings, GenerationConfig
from dflash_assets.generation.dispatch import Dispatcher, Slot
from dflash_assets.generation.prompts import canonical_json
from dflash_assets.generation.preflight import Budget, check_fleet, overflow_error
from dflash_assets.generation.schema import COMPLETION_SCHEMA, FAILURE_SCHEMA
from dflash_assets.generation.shards import prompt_store, reject_store
from dflash_assets.generation.store import PartStore

OVERFLOW_FAIL_SHARE = 0.9  # when this share of a shard overflows, the config is wrong, not the prompts


@dataclass
class ShardRun:
    """What a run of one shard did; `prompts == completed + rejected + failed` once it has finished."""

    shard: str
    config_hash: str
    model: str
    prompts: int = 0
    already_done: int = 0
    completed: int = 0  # rows of this config in committed parts, this run's and earlier ones
    length: int = 0  # of this run's new rows, finish_reason == "length"
    rejected_preflight: int = 0
    rejected_server: int = 0
    failed: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    servers: dict[str, dict] = field(default_factory=dict)
    infos: list = field(default_factory=list)  # the ServerInfo of each server the run used
    load_samples: list = field(default_factory=list)  # fleet.tuning.LoadSample, for the tuning report

    @property
    def rejected(self) -> int:
        return self.rejected_preflight + self.rejected_server


def completion_store(data_dir: Path, shard: str) -> PartStore:
    return PartStore(data_dir, "completions", shard, COMPLETION_SCHEMA)


def failure_store(data_dir: Path, shard: str) -> PartStore:
    return PartStore(data_dir, "failures", shard, FAILURE_SCHEMA)


def _ids(store: PartStore, config_hash: str) -> set[str]:
    table = store.read(["prompt_id", "config_hash"])
    return set(table.filter(pc.equal(table["config_hash"], config_hash))["prompt_id"].to_pylist())


def _row(prompt: dict, resp: dict, slot: Slot, config: GenerationConfig, config_hash: str, shard: str,
         attempt: int, latency: float) -> dict:
    choice, usage = resp["choices"][0], resp.get("usage") or {}
    reasoning_tokens = usage.get("reasoning_tokens")
    if reasoning_tokens is None:
        reasoning_tokens = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {
        "prompt_id": prompt["prompt_id"], "shard": shard, "source": prompt["source"], "config_hash": config_hash,
        "finish_reason": choice["finish_reason"], "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"), "reasoning_tokens": reasoning_tokens or 0,
        "max_output_tokens": config.max_output_tokens, "server_context_length": slot.info.context_length,
        "server_url": slot.url, "model": slot.info.model, "temperature": config.temperature, "top_p": config.top_p,
        "top_k": config.top_k, "enable_thinking": config.enable_thinking,
        "content": choice["message"].get("content") or "", "reasoning_content": choice["message"].get("reasoning_content"),
        "latency_s": latency, "attempt": attempt, "created_at": datetime.now(timezone.utc),
        "prompt_token_ids": choice.get("prompt_token_ids"), "output_ids": choice.get("response_token_ids"),
    }


def _reject(prompt: dict, stage: str, reason: str, config: GenerationConfig, config_hash: str, shard: str,
            context: int) -> dict:
    return {"shard": shard, "stage": stage, "line": prompt["line"], "prompt_id": prompt["prompt_id"],
            "config_hash": config_hash, "reason": reason, "prompt_tokens": prompt["prompt_tokens"],
            "max_output_tokens": config.max_output_tokens, "server_context_length": context,
            "created_at": datetime.now(timezone.utc)}


PLAN_COLUMNS = ["prompt_id", "line", "prompt_tokens", "template_kwargs_json"]


def _batches(store: PartStore, columns: list[str] | None = None, size: int = 2048) -> Iterator[list[dict]]:
    """The shard's prompts a batch at a time, so a large shard is never all in memory."""
    for part in store.parts():
        for batch in pq.ParquetFile(part).iter_batches(batch_size=size, columns=columns):
            yield batch.to_pylist()


async def _recount(fleet: Fleet, prompts: PartStore, stale: dict[str, dict], kwargs: dict) -> None:
    """Exact token counts for prompts whose shard count was made with other chat_template_kwargs."""
    gate = asyncio.Semaphore(64)

    async def count(i: int, row: dict) -> None:
        async with gate:
            client = fleet.clients[i % len(fleet.clients)]
            n = await client.count_prompt_tokens(json.loads(row["messages_json"]), kwargs)
            stale[row["prompt_id"]]["prompt_tokens"] = n

    for batch in _batches(prompts, ["prompt_id", "messages_json"]):
        await asyncio.gather(*(count(i, r) for i, r in enumerate(batch) if r["prompt_id"] in stale))


async def generate_shard(data_dir: Path, shard: str, fleet: Fleet, config: GenerationConfig,
                         settings: DispatchSettings = DispatchSettings(), *, preflight_policy: str = "reject",
                         log: Callable[[str], None] = print) -> ShardRun:
    config.validate()
    settings.validate()
    if preflight_policy not in ("reject", "fail"):
        raise ValueError(f"preflight_policy must be 'reject' or 'fail', got {preflight_policy!r}")
    notes = check_fleet(fleet.infos, config.enable_thinking)
    config_hash = config.config_hash(fleet.model)
    run = ShardRun(shard, config_hash, fleet.model, notes=notes, infos=list(fleet.infos))
    started = time.monotonic()
    prompts = prompt_store(data_dir, shard)
    store, failures = completion_store(data_dir, shard), failure_store(data_dir, shard)
    server_rejects = reject_store(data_dir, shard, "server")
    if not prompts.parts():
        raise FileNotFoundError(f"shard {shard} has no prompt_shards file under {data_dir}; materialise "
                                f"prompt_shards for it first")
    with store.lock():
        store.recover()
        server_rejects.recover()
        done = _ids(store, config_hash)
        refused = _ids(server_rejects, config_hash)
        run.already_done, run.rejected_server = len(done), len(refused)

        # Plan from the small columns only: what is left, and does it fit the context?
        kwargs_json = canonical_json(config.template_kwargs())
        todo: dict[str, dict] = {}
        for batch in _batches(prompts, PLAN_COLUMNS):
            run.prompts += len(batch)
            todo.update((r["prompt_id"], r) for r in batch
                        if r["prompt_id"] not in done and r["prompt_id"] not in refused)
        stale = {i: r for i, r in todo.items() if r["template_kwargs_json"] != kwargs_json}
        if stale:
            await _recount(fleet, prompts, stale, config.template_kwargs())
        budget = Budget.of(fleet.infos, settings.context_margin)
        cap = config.max_output_tokens
        over = [(r, problem) for r in todo.values() if (problem := budget.problem(r["prompt_tokens"], cap))]
        if over and (preflight_policy == "fail" or len(over) >= OVERFLOW_FAIL_SHARE * len(todo)):
            raise overflow_error(budget, cap, len(over), len(todo), max(r["prompt_tokens"] for r, _ in over))
        reject_store(data_dir, shard, "preflight").replace(
            [_reject(r, "preflight", problem, config, config_hash, shard, budget.context_length) for r, problem in over],
            f"{config_hash}.parquet")
        run.rejected_preflight = len(over)
        for r, _ in over:
            del todo[r["prompt_id"]]
        log(f"shard {shard} config {config_hash} (cap {cap}): {run.prompts} prompts, {len(done)} already done, "
            f"{run.rejected_server} rejected earlier by a server, {len(over)} rejected in preflight, "
            f"{len(todo)} to generate on {len(fleet.clients)} servers")

        def to_send() -> Iterator[dict]:
            for batch in _batches(prompts):
                for row in batch:
                    if (plan := todo.get(row["prompt_id"])) is not None:
                        row["prompt_tokens"] = plan["prompt_tokens"]
                        yield row

        async def send(prompt: dict, slot: Slot, attempt: int) -> dict:
            body = config.chat_body(fleet.model, json.loads(prompt["messages_json"]), settings.store_token_ids)
            t0 = time.monotonic()
            resp = await slot.client.chat(body)
            return _row(prompt, resp, slot, config, config_hash, shard, attempt, time.monotonic() - t0)

        def refuse(prompt: dict, reason: str, context: int) -> dict:
            return _reject(prompt, "server", reason, config, config_hash, shard, context)

        failed = await dispatch(to_send(), len(todo), fleet, settings, shard, config_hash, store, server_rejects,
                                run, log, started, send, refuse)
        failures.replace(failed, f"{config_hash}.parquet")
        run.failed = len(failed)
        store.compact()
        run.completed = len(_ids(store, config_hash))
    run.elapsed_s = time.monotonic() - started
    return run


Send = Callable[[dict, Slot, int], Awaitable[dict]]  # (item, slot, attempt) -> the row; raises ServerError
Refuse = Callable[[dict, str, int], dict]  # (item, reason, server context length) -> the server-stage reject row


def generated_tokens(row: dict) -> int:
    """Tokens a server generated for this row: a continued row reuses its parent's first tokens_reused."""
    return (row["completion_tokens"] or 0) - (row.get("tokens_reused") or 0)


async def dispatch(todo: Iterator[dict], total: int, fleet: Fleet, settings: DispatchSettings, shard: str,
                   config_hash: str, store: PartStore, server_rejects: PartStore, run: ShardRun,
                   log: Callable[[str], None], started: float, send: Send, refuse: Refuse) -> list[dict]:
    """Send every item of `todo` through `send` on the fleet and commit the rows; return the failures.

    The one dispatch loop of the package (fresh generation and continuation): slots and ejection by the
    Dispatcher, retries with backoff on retryable errors, a 400 refused (never resent at the same budget),
    rows and rejects committed every `commit_rows` rows or `commit_seconds`, and on the way out.
    """
    dispatcher = Dispatcher(fleet.clients, fleet.infos, max_in_flight_per_server=settings.max_in_flight_per_server,
                            waiting_margin=settings.waiting_margin, eject_after=settings.eject_after,
                            no_server_timeout_s=settings.no_server_timeout_s)
    rows: list[dict] = []
    refused: list[dict] = []
    failed: list[dict] = []
    last_commit = last_progress = time.monotonic()
    answered = 0

    async def one(prompt: dict) -> None:
        nonlocal answered
        try:
            await attempts(prompt)
        finally:
            answered += 1

    async def attempts(prompt: dict) -> None:
        error: ServerError | None = None
        for attempt in range(1, settings.max_attempts + 1):
            slot = await dispatcher.acquire()
            try:
                row = await send(prompt, slot, attempt)
            except ServerError as e:
                dispatcher.release(slot, ok=not e.retryable)
                if not e.retryable:  # a 400: the caller's problem, never resent at the same budget
                    refused.append(refuse(prompt, f"HTTP {e.status}: {e.message}", slot.info.context_length))
                    return
                error = e
                delay = min(settings.backoff_max_s, settings.backoff_base_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                continue
            dispatcher.release(slot, ok=True)
            slot.completed += 1
            slot.output_tokens += generated_tokens(row)
            rows.append(row)
            return
        failed.append({"shard": shard, "prompt_id": prompt["prompt_id"], "config_hash": config_hash,
                       "error": str(error), "attempts": settings.max_attempts,
                       "created_at": datetime.now(timezone.utc)})

    async def commit() -> None:
        nonlocal rows, refused, last_commit
        batch, rej = rows, refused
        rows, refused = [], []
        # rejects first: a crash between the two resends a completed prompt's reject-free row next time,
        # never a rejected prompt twice
        await asyncio.to_thread(server_rejects.commit, rej)
        await asyncio.to_thread(store.commit, batch)
        run.length += sum(r["finish_reason"] == "length" for r in batch)
        run.output_tokens += sum(generated_tokens(r) for r in batch)
        run.rejected_server += len(rej)
        last_commit = time.monotonic()

    def progress() -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        sent = answered
        tokens = sum(s.output_tokens for s in dispatcher.slots)
        per_server = ", ".join(f"{s.url}: {s.in_flight} in flight, {s.output_tokens / elapsed:.0f} tok/s"
                               + (" EJECTED" if s.ejected_at else "") for s in dispatcher.slots)
        eta = f", ETA {(total - sent) * elapsed / sent:.0f}s" if sent else ""
        log(f"shard {shard}: {sent}/{total} answered, {run.length} length, {len(failed)} failed, "
            f"{run.rejected_server} rejected by a server, {tokens / elapsed:.0f} tok/s{eta} [{per_server}]")

    tasks: set[asyncio.Task] = set()
    exhausted = False
    sampler = LoadSampler(fleet.clients, settings.load_sample_s) if settings.load_sample_s > 0 else None
    if sampler:
        await sampler.start()
    try:
        while not exhausted or tasks:
            while not exhausted and len(tasks) < dispatcher.capacity:
                if (prompt := next(todo, None)) is None:
                    exhausted = True
                else:
                    tasks.add(asyncio.create_task(one(prompt)))
            if not tasks:
                break
            finished, tasks = await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            errors = [e for t in finished if (e := t.exception()) is not None]  # retrieves every one
            if errors:
                raise errors[0]  # FleetDown propagates; everything committed stays committed
            now = time.monotonic()
            if len(rows) + len(refused) >= settings.commit_rows or (
                    (rows or refused) and now - last_commit >= settings.commit_seconds):
                await commit()
            if now - last_progress >= settings.progress_seconds:
                progress()
                last_progress = now
        await commit()
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await commit()
        raise
    finally:
        await dispatcher.close()
        if sampler:
            run.load_samples = await sampler.stop()
        run.servers = {s.url: {"completed": s.completed, "output_tokens": s.output_tokens, "in_flight_limit": s.limit}
                       for s in dispatcher.slots}
    return failed
