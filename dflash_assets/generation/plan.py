"""Step 1 of generating a shard: what is left to do (recomputed from the committed parts on every start, so a kill
never duplicates a row), and does it fit (preflight).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import TypeVar

from dflash_assets.fleet.fleet import Fleet
from dflash_assets.generation.preflight import Budget, overflow_error, tool_parser_error
from dflash_assets.generation.prompts import canonical_json, last_turn_request
from dflash_assets.generation.request import request_cap, template_kwargs, window_problem
from dflash_assets.generation.turns import (
    FINISHED,
    Conversation,
    Planned,
    TurnItem,
    conversations,
    fills_before,
    next_item,
    plan_file,
)
from dflash_assets.rules import fills_window
from dflash_assets.settings import GenerationSettings
from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import PromptRow, RejectRow
from dflash_assets.store.storage import Storage
from dflash_assets.store.stores import completion_store, prompt_batches, prompt_store, reject_store

OVERFLOW_FAIL_SHARE = 0.9  # when this share of a shard overflows, the config is wrong, not the prompts
PLAN_COLUMNS = ["prompt_id", "line", "prompt_tokens", "template_kwargs_json"]


@dataclass
class ShardResult:
    """What a run of one shard did, every figure this shard's own; `prompts == completed + rejected + failed` once
    it has finished."""

    shard: str
    config_hash: str
    model: str
    prompts: int = 0
    already_done: int = 0
    completed: int = 0  # rows of this config in committed parts, this run's and earlier ones
    length: int = 0  # of this run's new rows, finish_reason == "length"
    runaways_stopped: int = 0  # of this run's new rows, stopped while looping (rules.RUNAWAY_FINISH)
    rejected_preflight: int = 0
    rejected_server: int = 0
    failed: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0  # first request of this shard sent -> its last answer (0 when nothing was sent)
    notes: list[str] = field(default_factory=list)  # about this shard
    fleet_notes: list[str] = field(default_factory=list)  # about the fleet: the same for every shard of the run
    servers: dict[str, dict] = field(default_factory=dict)  # url -> this shard's completed, output_tokens; limit
    first_sent_at: float | None = None  # monotonic time the first prompt was handed to the dispatcher
    last_sent_at: float | None = None  # monotonic time the last prompt was handed to the dispatcher
    answered_at: float | None = None  # monotonic time the last answer of this shard arrived
    finished_at: float | None = None  # monotonic time the shard had nothing left in flight or to send
    by_turn: dict[int, dict] = field(default_factory=dict)  # all_turns: turn -> rows, truncated, rejected
    truncated_at: dict[str, int] = field(default_factory=dict)  # all_turns: prompt_id -> the turn cut short
    # prompt_id -> the turn not sent, since its history fills the trainer's window (turns.fills_before): the
    # conversation ends there, with every turn before it; recomputed by every run's plan
    ended_at_window: dict[str, int] = field(default_factory=dict)
    infos: list = field(default_factory=list)  # the ServerInfo of each server the run used
    load_samples: list = field(default_factory=list)  # fleet.tuning.LoadSample, for the tuning report
    window: int | None = None  # cap_policy window: the trainer's window the requests were sized to
    filling_window: int = 0  # cap_policy fixed: prompts sent whose prompt fills the trainer's window

    @property
    def rejected(self) -> int:
        return self.rejected_preflight + self.rejected_server


def ended_at_window_note(run: ShardResult, max_length: int) -> str:
    """What the plan says of conversations that end at a turn whose history fills the trainer's window."""
    turns = sorted(set(run.ended_at_window.values()))
    by_turn = ", ".join(f"turn {k}: {list(run.ended_at_window.values()).count(k):,}" for k in turns)
    return (
        f"shard {run.shard}: {len(run.ended_at_window):,} conversations end at a turn whose history fills the "
        f"trainer's window max_length {max_length:,} ({by_turn}): no request for it or the turns after it"
    )


def filling_window_note(prompts: int, max_length: int) -> str:
    """What preflight says of prompts a fixed cap sends although they fill the trainer's window."""
    return (
        f"{prompts:,} prompts fill the trainer's window: their answers would never be trained on; "
        f"`--cap-policy window` rejects them (prompt_tokens >= max_length {max_length:,})"
    )


def count_filling_window(run: ShardResult, rows: Iterable[Planned], generation: GenerationSettings) -> None:
    """Under a fixed cap, the prompts about to be sent that fill the trainer's window (the window policy refuses
    them in preflight): counted before any request and said in the shard's notes; they decode for nothing trained."""
    if generation.windowed:
        return
    window = generation.trainer_max_length
    run.filling_window = sum(fills_window(r.prompt_tokens or 0, window) for r in rows)
    if run.filling_window:
        run.notes.append(f"shard {run.shard}: {filling_window_note(run.filling_window, window)}")


def reject_row(
    planned: Planned,
    stage: str,
    reason: str,
    generation: GenerationSettings,
    config_hash: str,
    context: int,
    turn: int | None,
) -> RejectRow:
    """A row of the rejects table for one turn of this config (stage "preflight" or "server"), with the cap its
    request had (its own under the window policy); `turn` as the row records it."""
    tokens = planned.prompt_tokens
    return RejectRow(
        shard=planned.shard,
        stage=stage,
        line=planned.line,
        prompt_id=planned.prompt_id,
        config_hash=config_hash,
        reason=reason,
        prompt_tokens=tokens,
        max_output_tokens=request_cap(generation, tokens) if tokens is not None else generation.max_output_tokens,
        server_context_length=context,
        created_at=datetime.now(UTC),
        turn=turn,
    )


def plan_remaining(prompts: PartStore, finished: set[str]) -> tuple[int, dict[str, PromptRow]]:
    """(prompts in the shard, {prompt_id: its row} of those not finished), from the small columns only."""
    total, todo = 0, dict[str, PromptRow]()
    for batch in prompt_batches(prompts, PLAN_COLUMNS):
        total += len(batch)
        todo.update((r.prompt_id, r) for r in batch if r.prompt_id not in finished)
    return total, todo


P = TypeVar("P", bound=Planned)


def preflight(
    rows: list[P], budget: Budget, generation: GenerationSettings, policy: str = "reject"
) -> list[tuple[P, str]]:
    """(turn, why) for every turn whose prompt_tokens + request cap the fleet cannot honour: each turn's request cap
    is request_cap's (its own under the window policy), and the window refuses a prompt that fills it.

    Raises PreflightError (nothing sent) under policy "fail", or when OVERFLOW_FAIL_SHARE of the rows overflow: then
    the config is wrong, not the prompts (a prompt that fills the window never counts towards that share)."""
    counted = [(r, r.prompt_tokens or 0) for r in rows]
    full = [(r, problem) for r, tokens in counted if (problem := window_problem(generation, tokens))]
    refused = {id(r) for r, _ in full}
    over = [
        (r, problem)
        for r, tokens in counted
        if id(r) not in refused and (problem := budget.problem(tokens, request_cap(generation, tokens)))
    ]
    if over and (policy == "fail" or len(over) >= OVERFLOW_FAIL_SHARE * len(rows)):
        config_cap = generation.max_output_tokens
        longest = max(r.prompt_tokens or 0 for r, _ in over)
        raise overflow_error(budget, config_cap, len(over), len(rows), longest)
    return full + over


def turn_label(turn: int, turns: int) -> str:
    """How a reject names the turn it refused, when its conversation has several generated turns."""
    return f"turn {turn} of {turns}: " if turns > 1 else ""


@dataclass
class ShardPlan:
    """One shard, planned under its lock: its figures so far, each conversation not over, and its next turn's
    prompt_tokens (counted at planning)."""

    run: ShardResult
    prompts: PartStore
    generation: GenerationSettings
    todo: dict[str, Conversation]
    prompt_tokens: dict[str, int | None] = field(default_factory=dict)

    def items(self, columns: tuple[str, ...] = ()) -> Iterator[tuple[TurnItem, PromptRow]]:
        """The next turn of each conversation not over, in shard order, with its prompt row (`columns` read too)."""
        names = ["prompt_id", "line", "source", "messages_json", "tools_json", *columns]
        for batch in prompt_batches(self.prompts, list(dict.fromkeys(names))):
            for row in batch:
                if (state := self.todo.get(row.prompt_id)) is not None:
                    item = next_item(row, self.run.shard, self.generation, state)
                    item.prompt_tokens = self.prompt_tokens.get(row.prompt_id)
                    yield item, row

    def to_send(self) -> Iterator[TurnItem]:
        """The work items of the dispatcher."""
        return (item for item, _ in self.items())


async def count_next_turns(plan: ShardPlan, fleet: Fleet, log: Callable[[str], None]) -> list[Planned]:
    """Each conversation's next turn with its exact prompt_tokens: the shard's own count when the turn is the
    source's last-turn request counted with this config's chat_template_kwargs, else the fleet's /v1/tokenize."""
    generation = plan.generation
    gate, stale = asyncio.Semaphore(64), 0
    counted: list[Planned] = []

    async def count(i: int, item: TurnItem, row: PromptRow, fresh: bool) -> Planned:
        messages = item.conversation.history(item.turn, item.answers)
        if not fresh or messages != last_turn_request(json.loads(row.messages_json or "[]")):
            async with gate:
                item.prompt_tokens = await fleet.clients[i % len(fleet.clients)].count_prompt_tokens(
                    messages, template_kwargs(generation, item.prompt_id), item.conversation.tools
                )
        return Planned(**{f.name: getattr(item, f.name) for f in fields(Planned)})  # without its conversation

    batch: list[tuple[TurnItem, PromptRow, bool]] = []
    for item, row in plan.items(("prompt_tokens", "template_kwargs_json")):
        item.prompt_tokens = row.prompt_tokens
        fresh = row.template_kwargs_json == canonical_json(template_kwargs(generation, item.prompt_id))  # its mode
        stale += not fresh
        batch.append((item, row, fresh))
        if len(batch) == 2048:
            counted += await asyncio.gather(*(count(len(counted) + j, *it) for j, it in enumerate(batch)))
            batch = []
    counted += await asyncio.gather(*(count(len(counted) + j, *it) for j, it in enumerate(batch)))
    if stale:
        log(f"shard {plan.run.shard}: {stale} prompts were counted with other chat_template_kwargs; recounted")
    return counted


async def plan_shard(
    data_dir: Storage,
    shard: str,
    fleet: Fleet,
    generation: GenerationSettings,
    preflight_policy: str,
    config_hash: str,
    log: Callable[[str], None],
) -> ShardPlan:
    """Resume and preflight one shard (its lock is held) for a config: each conversation goes on from its last
    committed turn, preflighted now (a later turn when it is sent). Every run recomputes the preflight rejects."""
    run = ShardResult(shard, config_hash, fleet.model, infos=list(fleet.infos), window=generation.window)
    preflight_rejects = reject_store(data_dir, shard, "preflight")
    for store in (completion_store(data_dir, shard), reject_store(data_dir, shard, "server"), preflight_rejects):
        store.recover()
    states = conversations(data_dir, shard, config_hash, generation, replanned=False)
    run.prompts = len(states)
    todo = {pid: c for pid, c in states.items() if c.over is None}
    run.already_done = sum(c.over in FINISHED for c in states.values())
    plan = ShardPlan(run, prompt_store(data_dir, shard), generation, todo)
    next_turns = await count_next_turns(plan, fleet, log)
    if any(r.tools for r in next_turns) and (refused := tool_parser_error(fleet.infos)):
        raise refused
    budget = Budget.of(fleet.infos)
    ending = {r.prompt_id for r in next_turns if fills_before(r.turn, r.prompt_tokens or 0, generation)}
    over = preflight([r for r in next_turns if r.prompt_id not in ending], budget, generation, preflight_policy)
    context = budget.context_length
    rejects = [
        reject_row(r, "preflight", turn_label(r.turn, r.turns) + problem, generation, config_hash, context, r.turn)
        for r, problem in over
    ]
    preflight_rejects.replace(rejects, plan_file(config_hash))
    run.rejected_preflight = len(over)
    for r, _ in over:
        del todo[r.prompt_id]
    for r in next_turns:
        if r.prompt_id in todo and r.prompt_id in ending:
            run.ended_at_window[r.prompt_id] = r.turn
            del todo[r.prompt_id]
    count_filling_window(run, [r for r in next_turns if r.prompt_id in todo], generation)  # their next turns
    plan.prompt_tokens = {r.prompt_id: r.prompt_tokens for r in next_turns}
    turns_done = sum(len(c.answers) for c in states.values())
    policy = f", window {generation.trainer_max_length}" if generation.windowed else ""
    log(
        f"shard {shard} config {config_hash} (cap {generation.max_output_tokens}{policy}): {run.prompts} "
        f"conversations, {run.already_done} already over, {turns_done} turns already committed, "
        f"{len(states) - len(todo) - run.already_done - len(over) - len(run.ended_at_window)} rejected earlier, "
        f"{len(over)} rejected in preflight, {len(run.ended_at_window)} ending at a turn that fills the window, "
        f"{len(todo)} to go "
        f"on with ({sum(c.turns - len(c.answers) for c in todo.values())} turns at most) on {len(fleet.clients)} "
        f"servers"
    )
    return plan
