"""Step 2 of generating: dispatch with retries. Every item goes to a server, and its answer to its shard.

The one dispatch loop of the package (fresh generation, follow-up turns of a conversation, continuation; one
shard or many): the slot picker chooses the server (least loaded, ejection, re-admission), retryable errors
are retried with exponential backoff and jitter, a 400 is refused and never resent at the same budget, a gateway
with no worker available is waited for like a fleet with no healthy server (no attempt spent), and rows are
committed every `commit_rows` rows or `commit_seconds`, and on the way out whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from functools import partial
from typing import NamedTuple

from dflash_assets.fleet.client import ChatResult, ServerError
from dflash_assets.fleet.fleet import Fleet
from dflash_assets.fleet.membership import Change, follow
from dflash_assets.fleet.stream import Watch
from dflash_assets.fleet.tuning import LoadSampler
from dflash_assets.generation.commit import ShardOutput, generated_tokens
from dflash_assets.generation.plan import reject_row, turn_label
from dflash_assets.generation.preflight import Budget
from dflash_assets.generation.quarantine import QUARANTINE_AFTER_DEATHS, Quarantine, Quarantined, suspect_rows
from dflash_assets.generation.request import chat_body, request_cap, template_kwargs, window_problem
from dflash_assets.generation.runaway import is_runaway, loop_start
from dflash_assets.generation.slots import FleetDown, Slot, SlotPicker
from dflash_assets.generation.stopping import STOP
from dflash_assets.generation.tools import answer_message
from dflash_assets.generation.turns import TurnItem, fills_before
from dflash_assets.rules import fills_window
from dflash_assets.settings import DispatchSettings, GenerationSettings, RunawaySettings
from dflash_assets.store.schema import CompletionRow, FailureRow, RejectRow


class Figures(NamedTuple):
    """A dispatch's progress: what a terminal shows while it runs."""

    answered: int
    total: int
    tokens: int
    cut: int
    elapsed_s: float


RUNNING: list[Dispatch] = []  # the dispatch running in this process, if any (a CLI run's progress reads it)

Send = Callable[[TurnItem, Slot, int], Awaitable[CompletionRow]]  # (item, slot, attempt) -> its row; raises ServerError
Refuse = Callable[[TurnItem, str, int], RejectRow]  # (item, reason, server context length) -> the server-stage reject
FollowUp = Callable[[TurnItem, CompletionRow], "TurnItem | None"]  # (item, its row) -> the next item it makes ready


class Sent(NamedTuple):
    """How an attempt was answered: the server, the attempt, and the seconds it took (what a row records of it)."""

    slot: Slot
    attempt: int
    latency_s: float


TurnRow = Callable[[TurnItem, ChatResult, Sent], CompletionRow]  # (item, chat answer, how it was answered) -> its row


def watch_of(dispatch: DispatchSettings, runaway: RunawaySettings | None = None) -> Watch | None:
    """How every request is watched while it streams (None: `stream` is off, one blocking POST each). The runaway
    rule is the checks' own (`runaway`, the quality resource's; None: the defaults), applied to the text so far."""
    if not dispatch.stream:
        return None
    runaway = runaway or RunawaySettings()
    return Watch(
        dispatch.stall_timeout_s,
        dispatch.first_token_timeout_s,
        dispatch.runaway_check_tokens,
        looping=partial(is_runaway, runaway=runaway),
        loop_start=partial(loop_start, runaway=runaway),
    )


def turn_sender(
    fleet: Fleet, generation: GenerationSettings, token_ids: bool, make_row: TurnRow, watch: Watch | None = None
) -> Send:
    """The Send of a conversation's turn (a plan's item or a follow-up): preflighted when it is sent (a follow-up's
    history is known only then), streamed and watched with `watch` (None: not streamed)."""
    budget = Budget.of(fleet.infos)
    config_hash = generation.config_hash(fleet.model)

    async def send(item: TurnItem, slot: Slot, attempt: int) -> CompletionRow:
        messages = item.conversation.history(item.turn, item.answers)
        if item.prompt_tokens is None:  # a follow-up: its history is known only now
            kwargs = template_kwargs(generation, item.prompt_id)  # the prompt's mode
            item.prompt_tokens = await slot.client.count_prompt_tokens(messages, kwargs, item.conversation.tools)
        if fills_before(item.turn, item.prompt_tokens, generation):
            raise Ended(item.turn)
        cap = request_cap(generation, item.prompt_tokens)
        if problem := window_problem(generation, item.prompt_tokens) or budget.problem(item.prompt_tokens, cap):
            reason = turn_label(item.turn, item.turns) + problem
            context = budget.context_length
            raise Rejected(reject_row(item, "preflight", reason, generation, config_hash, context, item.recorded_turn))
        tools = item.conversation.tools
        body = chat_body(generation, fleet.model, messages, token_ids, cap, item.prompt_id, tools)
        t0 = time.monotonic()
        answer = await slot.client.chat(body, watch)
        return make_row(item, answer, Sent(slot, attempt, time.monotonic() - t0))

    return send


def next_turn(item: TurnItem, row: CompletionRow) -> TurnItem | None:
    """The follow-up of a turn that stopped on its own; a cut (or last) turn ends the conversation, and so does a
    turn that fills the window of the window policy, or whose tool calls the source has no results for (the rules
    `turns.conversation` applies on a restart)."""
    if row.finish_reason != "stop" or item.turn >= item.turns:
        return None
    window = row.trainer_max_length
    if window is not None and fills_window((row.prompt_tokens or 0) + (row.completion_tokens or 0), window):
        return None
    answer = answer_message(row.content or "", row.tool_calls_json) if row.tool_calls_json else row.content or ""
    if item.conversation.ends_after(item.turn, answer):
        return None
    return replace(
        item,
        turn=item.turn + 1,
        answers=[*item.answers, answer],
        prompt_tokens=None,
        prefer_server=row.server_url,  # the server whose prefix cache holds this history
        parent=None,
    )


class Ended(Exception):
    """Raised by a Send whose turn ends its conversation unsent: its history fills the trainer's window."""

    def __init__(self, turn: int):
        super().__init__(f"turn {turn} fills the trainer's window")
        self.turn = turn


class Rejected(Exception):
    """Raised by a Send that refuses its item before sending it; `row` is the reject row to commit."""

    def __init__(self, row: RejectRow):
        super().__init__(row.reason)
        self.row = row


class Dispatch:
    """Send items on the fleet until none is left; each item names its `shard`, a key of `outputs`.

    A `follow_up` item (the next turn of a conversation) is sent before any new item, so a conversation in
    progress is never starved by the stream behind it, while the stream keeps the slots full meanwhile."""

    def __init__(
        self,
        fleet: Fleet,
        dispatch: DispatchSettings,
        outputs: dict[str, ShardOutput],
        send: Send,
        refuse: Refuse,
        log: Callable[[str], None],
        *,
        follow_up: FollowUp | None = None,
        on_answer: Callable[[int, int], None] | None = None,
    ):
        wait = max(dispatch.no_server_timeout_s, fleet.relaunch_s)  # a server the run relaunches: as long as it takes
        dispatch = dispatch.model_copy(update={"no_server_timeout_s": wait})
        self.fleet, self.dispatch, self.outputs = fleet, dispatch, outputs
        self.refuse, self.follow_up, self.log, self.on_answer = refuse, follow_up, log, on_answer
        self.quarantine = Quarantine(log, self._record_suspects)  # a prompt that kills its servers is not sent round
        for output in outputs.values():  # the fleet; the deaths earlier runs saw count
            for row in suspect_rows(output):  # (asked to send the quarantined again: their deaths start again)
                if row.attempts < QUARANTINE_AFTER_DEATHS or not dispatch.retry_quarantined:
                    self.quarantine.carry((row.shard, row.prompt_id, row.turn), row.error.split(" "))
        self.send = self.quarantine.guard(send)
        self._recording = asyncio.Lock()
        self.slots = SlotPicker(fleet.clients, fleet.infos, dispatch, log=log, on_back=self.quarantine.back)
        self.ready: deque[TurnItem] = deque()  # follow-up items, sent first
        self._tasks: set[asyncio.Task] = set()
        self._exhausted = False  # every item of the stream was taken
        self.answered = self.total = 0
        self.started = self.last_commit = self.last_progress = time.monotonic()

    async def run(self, items: Iterator[TurnItem], total: int) -> None:
        """Send `items` (and their follow-ups); `total` is for progress (follow-ups add to it)."""
        self.total = total
        RUNNING[:] = [self]  # a terminal's progress reads it from another thread (figures)
        tasks: set[asyncio.Task] = set()
        finished: deque[asyncio.Task] = deque()  # tasks done and not looked at yet, in the order they ended
        woken = asyncio.Event()

        def ended(task: asyncio.Task) -> None:
            finished.append(task)
            woken.set()

        self._tasks, self._exhausted = tasks, False
        every = self.dispatch.load_sample_s
        sampler = LoadSampler(self.fleet.clients, every) if every > 0 else None
        if sampler:
            await sampler.start()
        membership = asyncio.create_task(
            follow(self.fleet.clients, self.slots.probe_interval_s, self._resized, self.log)
        )
        try:
            while not self._exhausted or tasks or self.ready:  # suspects parked till the end take no slot:
                while len(tasks) - self.quarantine.parked < self.slots.capacity and (self.ready or not self._exhausted):
                    now = time.monotonic()
                    if self.ready:  # a follow-up: its shard counted it in flight when it was queued
                        item = self.ready.popleft()
                    elif (queued := next(items, None)) is None:
                        self._exhausted = True
                        for output in self.outputs.values():
                            output.close_sending(now)
                        continue
                    else:
                        item = queued
                        self._moved_to(item.shard, now)
                        self.outputs[item.shard].sent(now)
                    task = asyncio.create_task(self._one(item))
                    task.add_done_callback(ended)
                    tasks.add(task)
                if not tasks:
                    continue
                # one callback a task, not asyncio.wait's registration on every task in flight at each answer
                if not finished:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await woken.wait()
                woken.clear()
                done = [finished.popleft() for _ in range(len(finished))]
                tasks.difference_update(done)
                errors = [e for t in done if (e := t.exception()) is not None]  # retrieves every one
                if errors:
                    raise errors[0]  # FleetDown propagates; everything committed stays committed
                STOP.check()  # a signal: the streams in flight are closed (SGLang aborts them), the answers committed
                await self._maybe_commit()
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            RUNNING.clear()
            membership.cancel()
            await asyncio.gather(membership, return_exceptions=True)
            await self.commit()
            await self.slots.close()
            await self.quarantine.close()
            samples = await sampler.stop() if sampler else []
            for output in self.outputs.values():
                output.run.load_samples = samples
                for slot in self.slots.slots:  # the server's limit is the fleet's; the counts stay the shard's
                    output.run.servers.setdefault(slot.url, {"completed": 0, "output_tokens": 0})
                    output.run.servers[slot.url]["in_flight_limit"] = slot.limit
                    output.run.servers[slot.url] |= {"stalls": slot.stalls, "ejections": slot.ejections}
                    if slot.membership:  # a gateway's workers that joined or left during the run
                        output.run.servers[slot.url]["membership"] = slot.membership

    def _quiet(self) -> bool:
        """Nothing but suspects is left to send: a suspect's turn (generation/quarantine.py)."""
        return self._exhausted and not self.ready and len(self._tasks) <= self.quarantine.parked

    def _resized(self, index: int, change: Change) -> None:
        """A gateway's workers changed: its slots follow (a joiner's added, a leaver's removed)."""
        slot = self.slots.slots[index]
        before = slot.limit
        self.slots.resize(slot, change.info)
        event = {
            "joined": change.joined,
            "left": change.left,
            "servers": change.info.servers,
            "in_flight_limit": slot.limit,
        }
        slot.membership.append(event)
        self.log(
            f"{slot.url}: workers joined {change.joined or 'none'}, left {change.left or 'none'}: "
            f"{change.info.servers} servers, in-flight limit {before} -> {slot.limit}"
        )

    def _moved_to(self, shard: str, now: float) -> None:
        """The stream reached `shard`: no new item of an earlier shard will come (follow-ups still may)."""
        for name, output in self.outputs.items():
            if name != shard and output.run.first_sent_at is not None and output.run.last_sent_at is None:
                output.close_sending(now)

    async def _one(self, item: TurnItem) -> None:
        output = self.outputs[item.shard]
        try:
            row = await self._attempts(item, output)
            if row is not None and self.follow_up and (follow := self.follow_up(item, row)) is not None:
                output.in_flight += 1  # the conversation goes on: its shard is not finished
                self.ready.append(follow)
                self.total += 1
        finally:
            self.answered += 1
            if self.on_answer:
                self.on_answer(self.answered, self.total)  # (answered, total): a terminal's progress bar
            output.done(time.monotonic(), output.run.last_sent_at is not None)

    async def _attempts(self, item: TurnItem, output: ShardOutput) -> CompletionRow | None:
        dispatch, error, stalled_on = self.dispatch, None, frozenset[str]()
        attempt, unavailable_since = 1, None
        while attempt <= dispatch.max_attempts:
            async with self.quarantine.turn(item, self._quiet):  # a suspect goes last, alone
                slot = await self.slots.acquire(item.prefer_server if attempt == 1 else None, stalled_on)
                try:
                    row = await self.send(item, slot, attempt)
                except Rejected as e:  # refused before it was sent (a later turn's own preflight)
                    self.slots.release(slot, ok=True)
                    output.refused.append(e.row)
                    return None
                except Quarantined as e:  # in flight at its second server death: never sent again, and said so at once
                    self.slots.release(slot, ok=False)
                    output.failed.append(self._failure(item, output, e, attempt))
                    async with self._recording:
                        await asyncio.to_thread(output.commit_failures)
                    return None
                except Ended as e:  # its conversation ends before it: nothing sent
                    self.slots.release(slot, ok=True)
                    output.run.ended_at_window[item.prompt_id] = e.turn
                    return None
                except ServerError as e:
                    gateway_down = e.kind == "no_worker" or (
                        e.down and e.kind == "upstream_lost"
                    )  # a gateway with no worker for it now
                    self.slots.release(slot, ok=not e.retryable or gateway_down)
                    if gateway_down:  # not this attempt's failure
                        unavailable_since = await self._wait_for_a_worker(slot, e, unavailable_since)
                        continue
                    if e.down:  # refused: its server was down before it was sent, not this attempt's failure; the slot
                        await asyncio.sleep(dispatch.backoff_base_s * random.uniform(0.5, 1.0))  # picker ejects it,
                        continue  # and stops the run with FleetDown once no server is healthy
                    if not e.retryable:  # a 400: the caller's problem, never resent at the same budget
                        output.refused.append(
                            self.refuse(item, f"HTTP {e.status}: {e.message}", slot.info.context_length)
                        )
                        return None
                    error, unavailable_since = e, None
                    attempt += 1
                    if e.kind == "stalled":  # it waited stall_timeout_s already: straight to another server
                        slot.stalls += 1
                        stalled_on |= {slot.url}
                        continue
                    delay = min(dispatch.backoff_max_s, dispatch.backoff_base_s * 2 ** (attempt - 2))
                    await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                    continue
                self.slots.release(slot, ok=True)
                slot.completed += 1
                slot.output_tokens += generated_tokens(row)
                output.answered(slot, row)
                return row
        output.failed.append(self._failure(item, output, error, dispatch.max_attempts))
        return None

    def _failure(self, item: TurnItem, output: ShardOutput, error: Exception | None, attempts: int) -> FailureRow:
        return FailureRow(
            shard=item.shard,
            prompt_id=item.prompt_id,
            config_hash=output.run.config_hash,
            error=str(error),
            attempts=attempts,
            created_at=datetime.now(UTC),
            turn=item.recorded_turn,
        )

    async def _wait_for_a_worker(self, slot: Slot, error: ServerError, since: float | None) -> float:
        """A gateway that has no worker to route to (every one unhealthy, or its circuit breaker open after a worker
        died with requests in flight) is the fleet down for the moment, as when no server is healthy: the request
        asks again every probe interval, spending no attempt, and the run stops with FleetDown (committed rows
        stay) once it has waited no_server_timeout_s. Returns when it began waiting."""
        now = time.monotonic()
        since = now if since is None else since
        if now - since >= self.dispatch.no_server_timeout_s:
            raise FleetDown(f"no worker available behind {slot.url} for {now - since:.0f}s ({error.message})")
        await asyncio.sleep(self.slots.probe_interval_s)
        return since

    async def _record_suspects(self, shard: str) -> None:
        """The shard's suspects written, as each death is seen: a run stopped for lack of servers keeps them."""
        output = self.outputs[shard]
        if output.suspects is None:
            return
        async with self._recording:  # one write at a time, each of the suspects as they are when it begins
            await asyncio.to_thread(output.suspects.replace, self._suspect_rows(shard), output.failure_file)

    def _suspect_rows(self, shard: str) -> list[FailureRow]:
        output = self.outputs[shard]
        return [
            FailureRow(
                shard=shard,
                prompt_id=key[1],
                config_hash=output.run.config_hash,
                error=" ".join(urls),
                attempts=len(urls),
                created_at=datetime.now(UTC),
                turn=key[2],
            )
            for key, urls in self.quarantine.suspects(shard)
        ]

    async def commit(self) -> None:
        for output in self.outputs.values():
            if output.pending:
                await output.commit()
        self.last_commit = time.monotonic()

    async def _maybe_commit(self) -> None:
        now, pending = time.monotonic(), sum(o.pending for o in self.outputs.values())
        if pending >= self.dispatch.commit_rows or (pending and now - self.last_commit >= self.dispatch.commit_seconds):
            await self.commit()
        if now - self.last_progress >= self.dispatch.progress_seconds:
            self.progress()
            self.last_progress = now

    def figures(self) -> Figures:
        """Where it stands: answered of total, tokens generated, turn rows cut at the cap, seconds since it began."""
        return Figures(
            self.answered,
            self.total,
            sum(s.output_tokens for s in self.slots.slots),
            sum(o.run.length for o in self.outputs.values()),
            max(time.monotonic() - self.started, 1e-9),
        )

    def progress(self) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        tokens = sum(s.output_tokens for s in self.slots.slots)
        runs = [o.run for o in self.outputs.values()]
        failed = sum(len(o.failed) for o in self.outputs.values())
        per_server = ", ".join(
            f"{s.url}: {s.in_flight} in flight, {s.output_tokens / elapsed:.0f} tok/s"
            + (f", {s.stalls} stalled" if s.stalls else "")
            + (" EJECTED" if s.ejected_at else "")
            for s in self.slots.slots
        )
        eta = f", ETA {(self.total - self.answered) * elapsed / self.answered:.0f}s" if self.answered else ""
        self.log(
            f"shards {', '.join(self.outputs)}: {self.answered}/{self.total} answered, "
            f"{sum(r.length for r in runs)} length, {sum(r.runaways_stopped for r in runs)} runaways stopped, "
            f"{failed} failed, "
            f"{sum(r.rejected_server for r in runs)} rejected by a server, {tokens / elapsed:.0f} tok/s{eta} "
            f"[{per_server}]"
        )
