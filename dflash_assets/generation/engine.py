"""Generate the completions of shards: resume from committed parts, preflight, dispatch, commit.

Restart-safe by construction: the remaining work is recomputed from the committed Parquet parts on
every start (prompts of the shard minus rows of this config minus rejects of this config), so a
`kill -9` loses at most the requests in flight and the rows not yet committed, and never duplicates.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.compute as pc

from dflash_assets.fleet.client import ServerError
from dflash_assets.fleet.fleet import Fleet
from dflash_assets.fleet.tuning import LoadSampler
from dflash_assets.generation.config import DispatchSettings, GenerationConfig
from dflash_assets.generation.dispatch import Dispatcher, Slot
from dflash_assets.generation.prompts import canonical_json
from dflash_assets.generation.preflight import Budget, check_fleet, overflow_error
from dflash_assets.generation.schema import COMPLETION_SCHEMA, FAILURE_SCHEMA
from dflash_assets.generation.shards import prompt_store, reject_store
from dflash_assets.generation.storage import Storage, open_storage
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
    first_sent_at: float | None = None  # monotonic time the first prompt was handed to the dispatcher
    last_sent_at: float | None = None  # monotonic time the last prompt was handed to the dispatcher
    answered_at: float | None = None  # monotonic time the last answer of this shard arrived
    infos: list = field(default_factory=list)  # the ServerInfo of each server the run used
    load_samples: list = field(default_factory=list)  # fleet.tuning.LoadSample, for the tuning report

    @property
    def rejected(self) -> int:
        return self.rejected_preflight + self.rejected_server


def completion_store(data_dir: str | Path | Storage, shard: str) -> PartStore:
    return PartStore(data_dir, "completions", shard, COMPLETION_SCHEMA)


def failure_store(data_dir: str | Path | Storage, shard: str) -> PartStore:
    return PartStore(data_dir, "failures", shard, FAILURE_SCHEMA)


def committed_ids(store: PartStore, config_hash: str) -> set[str]:
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
        for batch in store.storage.parquet_file(part).iter_batches(batch_size=size, columns=columns):
            yield batch.to_pylist()


def plan_remaining(prompts: PartStore, finished: set[str]) -> tuple[int, dict[str, dict]]:
    """(prompts in the shard, {prompt_id: plan row} of those not finished), from the small columns only."""
    total, todo = 0, {}
    for batch in _batches(prompts, PLAN_COLUMNS):
        total += len(batch)
        todo.update((r["prompt_id"], r) for r in batch if r["prompt_id"] not in finished)
    return total, todo


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


@dataclass
class _Plan:
    """One shard, prepared under its lock: what is left to send, and where its results go."""

    target: "Target"
    prompts: PartStore
    todo: dict[str, dict]

    def to_send(self) -> Iterator[dict]:
        for batch in _batches(self.prompts):
            for row in batch:
                if (plan := self.todo.get(row["prompt_id"])) is not None:
                    row["prompt_tokens"] = plan["prompt_tokens"]
                    yield row


async def _prepare(data_dir: Storage, shard: str, fleet: Fleet, config: GenerationConfig, settings: DispatchSettings,
                   preflight_policy: str, notes: list[str], log: Callable[[str], None]) -> _Plan:
    """Resume and preflight one shard (its lock is already held): the done set comes from committed parts."""
    config_hash = config.config_hash(fleet.model)
    run = ShardRun(shard, config_hash, fleet.model, notes=notes, infos=list(fleet.infos))
    prompts = prompt_store(data_dir, shard)
    store, server_rejects = completion_store(data_dir, shard), reject_store(data_dir, shard, "server")
    store.recover()
    server_rejects.recover()
    done = committed_ids(store, config_hash)
    refused = committed_ids(server_rejects, config_hash)
    run.already_done, run.rejected_server = len(done), len(refused)
    run.prompts, todo = plan_remaining(prompts, done | refused)
    kwargs_json = canonical_json(config.template_kwargs())
    stale = {i: r for i, r in todo.items() if r["template_kwargs_json"] != kwargs_json}
    if stale:
        await _recount(fleet, prompts, stale, config.template_kwargs())
    budget = Budget.of(fleet.infos)
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
    return _Plan(Target(run, store, server_rejects), prompts, todo)


async def generate_shards(data_dir: str | Path, shards: list[str], fleet: Fleet, config: GenerationConfig,
                          settings: DispatchSettings = DispatchSettings(), *, preflight_policy: str = "reject",
                          log: Callable[[str], None] = print,
                          on_answer: Callable[[int, int], None] | None = None) -> list[ShardRun]:
    """Generate several shards (a backfill's range) through ONE dispatcher, in order.

    The prompts of the next shard start as soon as the last ones of the previous shard are sent, so the
    servers' slots do not drain at shard boundaries; each shard still has its own lock, parts, rejects,
    failures, compaction and figures. `data_dir` is a local path or an `s3://bucket/prefix` URI.
    """
    data_dir = open_storage(data_dir)
    config.validate()
    settings.validate()
    if preflight_policy not in ("reject", "fail"):
        raise ValueError(f"preflight_policy must be 'reject' or 'fail', got {preflight_policy!r}")
    notes = check_fleet(fleet.infos, config.enable_thinking)
    started = time.monotonic()
    missing = [s for s in shards if not prompt_store(data_dir, s).parts()]
    if missing:
        raise FileNotFoundError(f"shard(s) {', '.join(missing)} have no prompt_shards file under {data_dir}; "
                                f"materialise prompt_shards for them first")
    with ExitStack() as locks:
        plans = []
        for shard in shards:  # every shard is planned (and preflighted) before anything is sent
            locks.enter_context(completion_store(data_dir, shard).lock())
            plans.append(await _prepare(data_dir, shard, fleet, config, settings, preflight_policy, notes, log))
        model, config_hash = fleet.model, config.config_hash(fleet.model)

        async def send(prompt: dict, slot: Slot, attempt: int) -> dict:
            body = config.chat_body(model, json.loads(prompt["messages_json"]), settings.store_token_ids)
            t0 = time.monotonic()
            resp = await slot.client.chat(body)
            return _row(prompt, resp, slot, config, config_hash, prompt["shard"], attempt, time.monotonic() - t0)

        def refuse(prompt: dict, reason: str, context: int) -> dict:
            return _reject(prompt, "server", reason, config, config_hash, prompt["shard"], context)

        items = itertools.chain.from_iterable(plan.to_send() for plan in plans)
        await dispatch_many(items, sum(len(p.todo) for p in plans), fleet, settings,
                            {p.target.run.shard: p.target for p in plans}, log, started, send, refuse, on_answer)
        for plan in plans:
            target, run = plan.target, plan.target.run
            failure_store(data_dir, run.shard).replace(target.failed, f"{run.config_hash}.parquet")
            run.failed = len(target.failed)
            target.store.compact()
            run.completed = len(committed_ids(target.store, run.config_hash))
            run.elapsed_s = (target.finished_at or time.monotonic()) - started
    return [p.target.run for p in plans]


async def generate_shard(data_dir: str | Path, shard: str, fleet: Fleet, config: GenerationConfig,
                         settings: DispatchSettings = DispatchSettings(), *, preflight_policy: str = "reject",
                         log: Callable[[str], None] = print,
                         on_answer: Callable[[int, int], None] | None = None) -> ShardRun:
    """Generate the completions of one shard (see generate_shards)."""
    [run] = await generate_shards(data_dir, [shard], fleet, config, settings, preflight_policy=preflight_policy,
                                  log=log, on_answer=on_answer)
    return run


Send = Callable[[dict, Slot, int], Awaitable[dict]]  # (item, slot, attempt) -> the row; raises ServerError
Refuse = Callable[[dict, str, int], dict]  # (item, reason, server context length) -> the server-stage reject row


def generated_tokens(row: dict) -> int:
    """Tokens a server generated for this row: a continued row reuses its parent's first tokens_reused."""
    return (row["completion_tokens"] or 0) - (row.get("tokens_reused") or 0)


@dataclass
class Target:
    """Where one shard's results go, and what has not been committed yet."""

    run: ShardRun
    store: PartStore
    server_rejects: PartStore
    rows: list[dict] = field(default_factory=list)
    refused: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    finished_at: float | None = None

    async def commit(self) -> None:
        batch, rej = self.rows, self.refused
        self.rows, self.refused = [], []
        # rejects first: a crash between the two resends a completed prompt's reject-free row next time,
        # never a rejected prompt twice
        await asyncio.to_thread(self.server_rejects.commit, rej)
        await asyncio.to_thread(self.store.commit, batch)
        self.run.length += sum(r["finish_reason"] == "length" for r in batch)
        self.run.output_tokens += sum(generated_tokens(r) for r in batch)
        self.run.rejected_server += len(rej)


async def dispatch(todo: Iterator[dict], total: int, fleet: Fleet, settings: DispatchSettings, shard: str,
                   config_hash: str, store: PartStore, server_rejects: PartStore, run: ShardRun,
                   log: Callable[[str], None], started: float, send: Send, refuse: Refuse) -> list[dict]:
    """dispatch_many for one shard; returns its failures."""
    target = Target(run, store, server_rejects)
    items = ({**item, "shard": shard} for item in todo)
    await dispatch_many(items, total, fleet, settings, {shard: target}, log, started, send, refuse)
    return target.failed


async def dispatch_many(todo: Iterator[dict], total: int, fleet: Fleet, settings: DispatchSettings,
                        targets: dict[str, Target], log: Callable[[str], None], started: float, send: Send,
                        refuse: Refuse, on_answer: Callable[[int, int], None] | None = None) -> None:
    """Send every item of `todo` (each names its `shard`) through `send` on the fleet and commit the rows.

    The one dispatch loop of the package (fresh generation and continuation, one shard or many): slots and
    ejection by the Dispatcher, retries with backoff on retryable errors, a 400 refused (never resent at the
    same budget), rows and rejects committed every `commit_rows` rows or `commit_seconds`, and on the way out.
    """
    dispatcher = Dispatcher(fleet.clients, fleet.infos, max_in_flight_per_server=settings.max_in_flight_per_server,
                            waiting_margin=settings.waiting_margin, eject_after=settings.eject_after,
                            no_server_timeout_s=settings.no_server_timeout_s)
    last_commit = last_progress = time.monotonic()
    answered = 0
    left = {shard: 0 for shard in targets}

    async def one(item: dict) -> None:
        nonlocal answered
        target = targets[item["shard"]]
        try:
            await attempts(item, target)
        finally:
            answered += 1
            if on_answer:
                on_answer(answered, total)  # (answered, total): a terminal's progress bar
            left[item["shard"]] -= 1
            target.run.answered_at = time.monotonic()
            if left[item["shard"]] == 0 and target.run.last_sent_at is not None:
                target.finished_at = time.monotonic()

    async def attempts(item: dict, target: Target) -> None:
        error: ServerError | None = None
        for attempt in range(1, settings.max_attempts + 1):
            slot = await dispatcher.acquire()
            try:
                row = await send(item, slot, attempt)
            except ServerError as e:
                dispatcher.release(slot, ok=not e.retryable)
                if not e.retryable:  # a 400: the caller's problem, never resent at the same budget
                    target.refused.append(refuse(item, f"HTTP {e.status}: {e.message}", slot.info.context_length))
                    return
                error = e
                delay = min(settings.backoff_max_s, settings.backoff_base_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                continue
            dispatcher.release(slot, ok=True)
            slot.completed += 1
            slot.output_tokens += generated_tokens(row)
            target.rows.append(row)
            return
        target.failed.append({"shard": item["shard"], "prompt_id": item["prompt_id"],
                              "config_hash": target.run.config_hash, "error": str(error),
                              "attempts": settings.max_attempts, "created_at": datetime.now(timezone.utc)})

    async def commit() -> None:
        nonlocal last_commit
        for target in targets.values():
            if target.rows or target.refused:
                await target.commit()
        last_commit = time.monotonic()

    def pending() -> int:
        return sum(len(t.rows) + len(t.refused) for t in targets.values())

    def progress() -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        tokens = sum(s.output_tokens for s in dispatcher.slots)
        failed = sum(len(t.failed) for t in targets.values())
        length = sum(t.run.length for t in targets.values())
        refused = sum(t.run.rejected_server for t in targets.values())
        per_server = ", ".join(f"{s.url}: {s.in_flight} in flight, {s.output_tokens / elapsed:.0f} tok/s"
                               + (" EJECTED" if s.ejected_at else "") for s in dispatcher.slots)
        eta = f", ETA {(total - answered) * elapsed / answered:.0f}s" if answered else ""
        log(f"shards {', '.join(targets)}: {answered}/{total} answered, {length} length, {failed} failed, "
            f"{refused} rejected by a server, {tokens / elapsed:.0f} tok/s{eta} [{per_server}]")

    tasks: set[asyncio.Task] = set()
    exhausted = False
    sampler = LoadSampler(fleet.clients, settings.load_sample_s) if settings.load_sample_s > 0 else None
    if sampler:
        await sampler.start()
    try:
        while not exhausted or tasks:
            while not exhausted and len(tasks) < dispatcher.capacity:
                if (item := next(todo, None)) is None:
                    exhausted = True
                    for shard, target in targets.items():
                        target.run.last_sent_at = target.run.last_sent_at or time.monotonic()
                        if left[shard] == 0:
                            target.finished_at = target.finished_at or time.monotonic()
                else:
                    previous = [t for s, t in targets.items() if s != item["shard"] and t.run.last_sent_at is None
                                and left[s] > 0]
                    for t in previous:  # the stream moved past those shards: all their prompts are sent
                        t.run.last_sent_at = time.monotonic()
                    left[item["shard"]] += 1
                    run = targets[item["shard"]].run
                    run.first_sent_at = run.first_sent_at or time.monotonic()
                    tasks.add(asyncio.create_task(one(item)))
            if not tasks:
                break
            finished, tasks = await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            errors = [e for t in finished if (e := t.exception()) is not None]  # retrieves every one
            if errors:
                raise errors[0]  # FleetDown propagates; everything committed stays committed
            now = time.monotonic()
            if pending() >= settings.commit_rows or (pending() and now - last_commit >= settings.commit_seconds):
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
        samples = await sampler.stop() if sampler else []
        servers = {s.url: {"completed": s.completed, "output_tokens": s.output_tokens, "in_flight_limit": s.limit}
                   for s in dispatcher.slots}
        for target in targets.values():
            target.run.load_samples, target.run.servers = samples, servers
