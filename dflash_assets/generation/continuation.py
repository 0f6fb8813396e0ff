"""Continue truncated completions at a larger cap instead of generating them again.

A row cut at the cap (finish_reason "length") already holds thousands of valid tokens. Its prompt and
partial output go back to SGLang's native /generate BY TOKEN IDS (`input_ids = prompt_token_ids +
output_ids`, nothing re-tokenised) with the rest of the new cap and the same sampling; the server generates
only the missing tokens, and the row lands as a completion of the larger-cap config (the config hash a
fresh run at that cap would have) with its lineage: `parent_config_hash`, `tokens_reused`.

Rows of the parent that stopped on their own are complete at any larger cap: they are copied into the new
config (tokens_reused = completion_tokens, nothing generated), so the new config is complete for the shard
and its accounting adds up without sending anything. That is unbiased only because every cut row is
continued from where it stopped: a model continuing an answer already k tokens long ends past k, as the
first draw would have. Truncated rows without token ids (a run without store_token_ids) are continued by
their text instead, through the chat route's assistant prefill (`continue_final_message`, SGLang 0.5.23's
protocol.py): the prompt's messages plus the row's raw output as an unfinished assistant message, the server
re-tokenising that text. Leaving them to a fresh generation at the new cap would mix kept short rows with new,
shorter-on-average draws for the long ones (the set would skew short), so that is never done. The
re-tokenisation is the caveat of the text route: the server's count of the prefill (usage.prompt_tokens minus
the prompt) may differ from the tokens the row was generated as; each continued-by-text run measures it and
says so in its notes.

Growing the trainer's window (`to_window`): a config of the window policy is continued to a larger window L2, each
row to its own new request cap min(cap, L2 - prompt + overshoot): the new config is the one a fresh run at L2
would hash to. A row that stopped stays what it was (copied); a window-complete row is continued by its token ids
from where it stopped, paying only the tokens between the two windows.

One engine: a continuation is a plan (`plan_continuation`: what to copy, the cut turns to continue, the turns after
them to generate, each a conversation's TurnItem) that the engine's send and commit run, as they run a generation
run's plan. Exactly-once like the engine, with the engine's pieces: the committed parts of `completions/shard=K/`
are the only ledger (the new config's done set is read from them on every start), the shard lock, recovery,
compaction and the engine's dispatch loop (retries with backoff, ejection, a 400 never resent, failures).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

import pyarrow.compute as pc

from dflash_assets.fleet.client import ChatResult, ServerError
from dflash_assets.fleet.fleet import Fleet
from dflash_assets.fleet.stream import Watch
from dflash_assets.generation.commit import ShardOutput, account
from dflash_assets.generation.engine import turn_row
from dflash_assets.generation.plan import ShardResult, preflight, reject_row
from dflash_assets.generation.preflight import Budget, check_fleet
from dflash_assets.generation.provenance import parent_settings, record_continued
from dflash_assets.generation.reasoning import PARSERS, THINK_END, Reasoning
from dflash_assets.generation.request import chat_body, request_cap, window_columns
from dflash_assets.generation.send import Dispatch, Sent, next_turn, turn_sender, watch_of
from dflash_assets.generation.slots import Slot
from dflash_assets.generation.turns import (
    Conversation,
    Planned,
    TurnItem,
    conversations,
    next_item,
    regenerate_of,
)
from dflash_assets.rules import RUNAWAY_FINISH
from dflash_assets.settings import SAMPLING_PARAMS, DispatchSettings, GenerationSettings, RunawaySettings, SettingsError
from dflash_assets.store.configs import latest_order
from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import (
    COMPLETION_SCHEMA,
    CompletionRow,
    PromptRow,
    RejectRow,
    as_dicts,
    rows_as,
)
from dflash_assets.store.storage import Storage, open_storage
from dflash_assets.store.stores import (
    committed_keys,
    completion_batches,
    completion_store,
    prompt_batches,
    prompt_store,
    reject_store,
)

FINISHED = ("stop", "length", RUNAWAY_FINISH)  # what a continuation may end with; "abort" is retried
# what a continuation plans by: a parent row's small columns (its config is rebuilt from the first one's)
PLAN_COLUMNS = "prompt_id config_hash finish_reason completion_tokens prompt_tokens model max_output_tokens".split()
PLAN_COLUMNS += ["enable_thinking", "policy_cap", "trainer_max_length", "turn", "thinking_share", "mode_seed"]
PLAN_COLUMNS += SAMPLING_PARAMS
IDS = {  # how many token ids a row holds: null when its run stored none
    "n_prompt_ids": pc.list_value_length(pc.field("prompt_token_ids")),
    "n_output_ids": pc.list_value_length(pc.field("output_ids")),
}
ALONE = '[{"role":"user","content":""}]'  # the conversation of a parent row whose prompt is gone: its one turn
Key = tuple[str, int | None]  # what a row of a config is one of: its conversation and its turn (null: its only one)


class ToWindow(NamedTuple):
    """What a window-policy config is continued to: a larger trainer window (each row to its own request cap there)."""

    window: int


@dataclass
class ContinuationResult(ShardResult):
    """What continuing one shard did; `prompts == completed + rejected + failed + left` for the new config."""

    parent_config_hash: str = ""
    parent_cap: int = 0
    new_cap: int = 0
    continued: int = 0  # rows continued by this run
    regenerated: int = 0  # turns after a continued one generated by this run (regenerate all_turns)
    copied: int = 0  # stopped rows copied by this run
    without_ids: int = 0  # truncated parent rows without token ids: continued by their text
    left: int = 0  # prompts the new config has no row, reject or failure for: a generation run's work
    tokens_reused: int = 0  # over every row of the new config (this run's and earlier ones)
    new_config_tokens: int = 0  # completion tokens of every row of the new config


@dataclass(frozen=True)
class Parent:
    """A parent row as a continuation plans it: its small columns, and how many token ids it holds (None: none)."""

    row: CompletionRow
    prompt_ids: int | None
    output_ids: int | None

    @property
    def key(self) -> Key:
        return key(self.row)

    @property
    def prompt_tokens(self) -> int | None:
        """Exact when the ids are there."""
        return self.prompt_ids or self.row.prompt_tokens

    @property
    def cut(self) -> bool:
        return self.row.finish_reason == "length"


def key(row: CompletionRow) -> Key:
    return row.prompt_id, row.turn


def parent_rows(store: PartStore, config_hash: str) -> list[Parent]:
    """Every committed row of one config, its small columns and the count of its token ids."""
    if not (parts := store.parts()):
        return []
    dataset = store.storage.dataset(parts, schema=COMPLETION_SCHEMA)
    columns = {name: pc.field(name) for name in PLAN_COLUMNS} | IDS
    table = dataset.to_table(columns=columns, filter=pc.field("config_hash") == config_hash)
    rows = rows_as(CompletionRow, table.select(PLAN_COLUMNS))
    ids = zip(table["n_prompt_ids"].to_pylist(), table["n_output_ids"].to_pylist())
    return [Parent(row, prompt, output) for row, (prompt, output) in zip(rows, ids)]


def latest_parent(data_dir: str | Path | Storage, shard: str, new_cap: int, to_window: int | None = None) -> str | None:
    """`latest`: the most recently written config with rows in the shard (rules.latest_first) among those capped
    below `new_cap`. Below the cap, so a finished continuation is never its own parent. With `to_window`: among the
    window-policy configs of a smaller window."""
    order = latest_order(data_dir, shard)
    if to_window is None:
        return next((h for h, cap in order if cap < new_cap), None)
    table = completion_store(data_dir, shard).read(["config_hash", "trainer_max_length"])
    windows = dict(zip(*table.group_by("config_hash").aggregate([("trainer_max_length", "max")]).to_pydict().values()))
    return next((h for h, _ in order if windows.get(h) is not None and windows[h] < to_window), None)


def _window_settings(plan: list[Parent]) -> dict:
    """A window-policy parent's cap, window and overshoot, read off its rows: the overshoot from a row whose request
    was sized by the window (its own cap below the policy's; none: the default); the fixed policy for a fixed cap."""
    first = plan[0].row
    if first.policy_cap is None or first.trainer_max_length is None:
        return {"cap_policy": "fixed"}
    window, rows = first.trainer_max_length, (p.row for p in plan)
    sized = next((r for r in rows if r.prompt_tokens is not None and r.max_output_tokens < (r.policy_cap or 0)), None)
    settings = {"max_output_tokens": first.policy_cap, "cap_policy": "window", "trainer_max_length": window}
    return settings | ({"overshoot": sized.max_output_tokens - window + (sized.prompt_tokens or 0)} if sized else {})


def _parent_config(plan: list[Parent], parent: str, provenance: dict | None = None) -> GenerationSettings:
    """The parent's GenerationSettings, rebuilt from what its rows record (and the `provenance` its hash covers)
    and checked against its hash."""
    first = plan[0].row
    recorded = {k: getattr(first, k) for k in SAMPLING_PARAMS if getattr(first, k) is not None}
    generation = GenerationSettings(
        **({"max_output_tokens": first.max_output_tokens} | _window_settings(plan)),
        enable_thinking=first.enable_thinking,
        thinking_share=first.thinking_share,
        mode_seed=first.mode_seed or 0,
        regenerate=regenerate_of(first.turn is not None),
        **recorded,
    ).with_provenance(provenance)
    model = first.model or ""
    if generation.config_hash(model) != parent:  # settings the rows do not record, e.g. chat_template_kwargs
        raise SettingsError(
            f"config {parent} cannot be rebuilt from its rows ({generation}, model {first.model!r} "
            f"hash to {generation.config_hash(model)}); it cannot be continued"
        )
    return generation


def _target(parent: GenerationSettings, parent_hash: str, to: int | ToWindow) -> GenerationSettings:
    """The new config: the parent's at the larger cap, or at the larger window (`ToWindow`)."""
    if not isinstance(to, ToWindow):
        if to <= parent.max_output_tokens:
            raise SettingsError(f"new cap {to} must be larger than the parent's cap {parent.max_output_tokens}")
        return parent.model_copy(update={"max_output_tokens": to})
    if not parent.windowed:
        raise SettingsError(
            f"config {parent_hash} has a fixed cap ({parent.max_output_tokens}): "
            f"--to-window continues a config of the window policy; raise a fixed cap with --to"
        )
    if to.window <= parent.trainer_max_length:
        raise SettingsError(
            f"new window {to.window} must be larger than the parent's window {parent.trainer_max_length}"
        )
    return parent.model_copy(update={"trainer_max_length": to.window})


def _check_fleet(fleet: Fleet, model: str | None, parent_hash: str) -> None:
    """A continuation comes from the parent's model, and its text is split as the parent's was."""
    if fleet.model != model:
        raise SettingsError(
            f"config {parent_hash} was generated by {model!r} but the fleet "
            f"serves {fleet.model!r}; a continuation must come from the same model"
        )
    if odd := sorted({str(i.reasoning_parser) for i in fleet.infos if i.reasoning_parser not in PARSERS}):
        raise SettingsError(
            f"the fleet runs reasoning parser {', '.join(odd)}; continued text can only be split "
            f"the way {', '.join(str(p) for p in PARSERS)} split it"
        )


def _copied(row: CompletionRow, config_hash: str, generation: GenerationSettings) -> CompletionRow:
    """A stopped row is complete at any larger cap: the same completion, recorded under the new config (with the
    cap its request would have had there).

    It keeps the parent's provenance (server, latency, attempt, created_at): it is the same generation."""
    return replace(
        row,
        config_hash=config_hash,
        max_output_tokens=request_cap(generation, row.prompt_tokens or 0),
        **window_columns(generation),
        parent_config_hash=row.config_hash,
        tokens_reused=row.completion_tokens,
    )


@dataclass
class ContinuationPlan:
    """One shard's continuation, planned under its lock: the new config, the parent rows to copy, the cut turns to
    continue and the conversations to go on after a continued turn (all_turns)."""

    run: ContinuationResult
    generation: GenerationSettings
    store: PartStore
    prompts: dict[str, PromptRow]
    copies: set[Key] = field(default_factory=set)
    to_continue: set[Key] = field(default_factory=set)
    going_on: dict[str, Conversation] = field(default_factory=dict)
    cut_at: dict[str, int] = field(default_factory=dict)  # prompt_id -> its parent's cut turn
    rejects: list[RejectRow] = field(default_factory=list)

    @property
    def own_file(self) -> str:
        """A file name of our own, so a generation run's rejects and failures of the same config are never replaced."""
        return f"{self.run.config_hash}-from-{self.run.parent_config_hash}.parquet"

    def planned(self, parent: Parent) -> Planned:
        """A parent row as preflight reads it: its exact prompt tokens, its prompt's line."""
        prompt = self.prompts.get(parent.row.prompt_id)
        return Planned(
            prompt_id=parent.row.prompt_id,
            shard=self.run.shard,
            line=prompt.line if prompt else None,
            turn=parent.row.turn or 1,
            turns=1,
            prompt_tokens=parent.prompt_tokens,
        )

    def item(self, pid: str, state: Conversation, parent: CompletionRow | None = None) -> TurnItem:
        """A conversation's turn to send: its next one, or (`parent`) the cut turn the parent row goes on from (a
        parent row whose prompt the shard no longer holds, an earlier probe sample's, is its conversation's last)."""
        prompt = self.prompts.get(pid) or PromptRow(prompt_id=pid, messages_json=ALONE)
        item = next_item(prompt, self.run.shard, self.generation, state)
        if parent is not None:
            item.turn, item.prompt_tokens, item.parent = parent.turn or 1, parent.prompt_tokens, parent
        return item

    def to_send(self) -> Iterator[TurnItem]:
        """The cut turns to continue (each with the answers before it: the history of the turns after it), then the
        first turn after a continued one of the conversations a killed run left there."""
        wanted = {pid for pid, _ in self.to_continue}
        before: dict[str, dict[int, str]] = {}
        columns = ["prompt_id", "turn", "content"]
        for batch in completion_batches(self.store, self.run.parent_config_hash, columns, wanted):
            for r in batch:
                if (r.turn or 1) < self.cut_at[r.prompt_id]:
                    before.setdefault(r.prompt_id, {})[r.turn or 1] = r.content or ""
        for batch in completion_batches(self.store, self.run.parent_config_hash, wanted=wanted):
            for row in batch:
                if key(row) in self.to_continue:
                    answers = tuple(a for _, a in sorted(before.get(row.prompt_id, {}).items()))
                    yield self.item(row.prompt_id, Conversation(0, answers, None), row)
        for pid, state in self.going_on.items():
            yield self.item(pid, state)


def _exact(plan: list[Parent], todo: set[Key]) -> list[Parent]:
    """The parent rows not yet done that the new config takes: the stopped ones (copied), the cut ones with token ids
    (continued by them), then the cut ones without (continued by their text)."""
    rows = [p for p in plan if p.key in todo]
    by_ids = [p for p in rows if p.row.finish_reason == "stop" or (p.cut and None not in (p.prompt_ids, p.output_ids))]
    return by_ids + [p for p in rows if p.cut and p.output_ids is None]


def _preflight(plan: ContinuationPlan, exact: list[Parent], budget: Budget) -> set[Key]:
    """The rows the new config's requests could not hold, as rejects (the same rule as a fresh run at the new cap:
    a copied row must fit it too, or the new config would hold a row its own requests could not have produced)."""
    generation, run = plan.generation, plan.run
    planned = [plan.planned(p) for p in exact]
    parent_of = {id(item): p.row for item, p in zip(planned, exact)}
    over = preflight(planned, budget, generation)
    context = budget.context_length
    plan.rejects = [
        reject_row(r, "preflight", why, generation, run.config_hash, context, parent_of[id(r)].turn) for r, why in over
    ]
    return {key(parent_of[id(r)]) for r, _ in over}


def _choose(plan: ContinuationPlan, parents: list[Parent], budget: Budget, refused: set[Key]) -> None:
    """What becomes of each parent row not yet done: rejected in preflight, copied (stopped, or cut where its request
    would not grow: the window policy's cap reached already) or continued; and the conversations that go on after a
    continued turn, in order, on a history that holds the continued answer (after a kill, from its last turn)."""
    generation, run = plan.generation, plan.run
    done = committed_keys(plan.store, run.config_hash)
    run.already_done = len(done)
    exact = _exact(parents, {p.key for p in parents} - done - refused)
    run.without_ids = sum(p.cut and p.output_ids is None for p in exact)
    over = _preflight(plan, exact, budget)
    for p in exact:
        grows = request_cap(generation, p.prompt_tokens or 0) > (p.output_ids or p.row.completion_tokens or 0)
        if p.key not in over:
            (plan.to_continue if p.cut and grows else plan.copies).add(p.key)
    plan.cut_at = {p.row.prompt_id: p.row.turn or 1 for p in parents if p.cut}
    states = conversations(plan.store.storage, run.shard, run.config_hash, generation, replanned=False)
    plan.going_on = {
        pid: c
        for pid, c in states.items()
        if pid in plan.cut_at
        and c.over is None
        and len(c.answers) >= plan.cut_at[pid]
        and (pid, c.next_turn) not in refused
    }


def plan_continuation(
    storage: Storage, shard: str, fleet: Fleet, parent_hash: str, to: int | ToWindow, log: Callable[[str], None]
) -> ContinuationPlan:
    """Plan one shard's continuation under its lock: the new config rebuilt from the parent's rows, checked against
    the fleet, recorded, then what becomes of each parent row; the preflight rejects are written."""
    store = completion_store(storage, shard)
    parents = parent_rows(store, parent_hash)
    if not parents:
        raise SettingsError(f"shard {shard} has no rows of config {parent_hash} to continue")
    parent = _parent_config(parents, parent_hash, parent_settings(storage, parent_hash, fleet))
    generation = _target(parent, parent_hash, to)
    _check_fleet(fleet, parents[0].row.model, parent_hash)
    config_hash = generation.config_hash(fleet.model)
    record_continued(storage, config_hash, generation, fleet)
    run = ContinuationResult(
        shard,
        config_hash,
        fleet.model,
        notes=check_fleet(fleet.infos, generation.enable_thinking),
        parent_config_hash=parent_hash,
        parent_cap=parent.max_output_tokens,
        new_cap=generation.max_output_tokens,
    )
    columns = ["prompt_id", "line", "source", "messages_json", "tools_json"]
    prompts = {r.prompt_id: r for b in prompt_batches(prompt_store(storage, shard), columns) for r in b}
    run.prompts = len(prompts)
    plan = ContinuationPlan(run, generation, store, prompts)
    _choose(plan, parents, Budget.of(fleet.infos), committed_keys(reject_store(storage, shard, "server"), config_hash))
    reject_store(storage, shard, "preflight").replace(as_dicts(plan.rejects), plan.own_file)
    log(
        f"shard {shard}: continuing config {parent_hash} (cap {parent.max_output_tokens}) as {config_hash} "
        f"(cap {run.new_cap}): {len(parents)} parent rows, {run.already_done} already done, {len(plan.copies)} stopped "
        f"rows to copy, {len(plan.to_continue)} truncated rows to continue, {len(plan.going_on)} conversations to go on "
        f"after a continued turn, {run.without_ids} truncated without token ids (left to a generation run), "
        f"{len(plan.rejects)} rejected in preflight"
    )
    return plan


@dataclass
class Continuer:
    """The Send of a continuation: a cut turn goes on from its parent row (by its token ids on /generate, else by its
    text through the chat route's assistant prefill), a turn after it is generated as the engine generates any."""

    fleet: Fleet
    plan: ContinuationPlan
    watch: Watch | None
    end_ids: list[int]  # </think> as the server tokenizes it: whether a parent's output closed its thought
    drift: list[int] = field(default_factory=list)  # re-tokenisation drift of each row continued by text, in tokens

    def __post_init__(self) -> None:
        # the turns after a continued one keep their token ids, as the continued one does: the config goes on by them
        self.regenerate = turn_sender(self.fleet, self.plan.generation, True, self._regenerated, self.watch)

    def _regenerated(self, item: TurnItem, answer: ChatResult, sent: Sent) -> CompletionRow:
        row = turn_row(item, answer, sent, self.plan.generation, self.plan.run.config_hash)
        return replace(row, parent_config_hash=self.plan.run.parent_config_hash, tokens_reused=0)  # made here

    async def send(self, item: TurnItem, slot: Slot, attempt: int) -> CompletionRow:
        if item.parent is None:  # a turn after a continued one
            self.plan.run.regenerated += 1
            return await self.regenerate(item, slot, attempt)
        reasoning = Reasoning.of(  # the row's own mode (a seeded mix: each prompt its own)
            slot.info.reasoning_parser, bool(item.parent.enable_thinking), self.end_ids, slot.info.always_thinks
        )
        if item.parent.output_ids is None:
            return await self._by_text(item.parent, slot, attempt, reasoning)
        return await self._by_ids(item.parent, slot, attempt, reasoning)

    def _row(self, parent: CompletionRow, sent: Sent, **changes) -> CompletionRow:
        """A continued row: the parent's, recorded under the new config, with the request that continued it."""
        return replace(
            _copied(parent, self.plan.run.config_hash, self.plan.generation),
            server_context_length=sent.slot.info.context_length,
            server_url=sent.slot.url,
            model=sent.slot.info.model,
            latency_s=sent.latency_s,
            attempt=sent.attempt,
            created_at=datetime.now(UTC),
            **changes,
        )

    async def _by_ids(self, row: CompletionRow, slot: Slot, attempt: int, reasoning: Reasoning) -> CompletionRow:
        """The rest of the new cap by token ids: new_cap - old_cap for a row cut at its cap, and a row the server
        clamped short of its cap still ends where a fresh run at the new cap would."""
        generation, old = self.plan.generation, row.output_ids or []
        sampling = {"max_new_tokens": request_cap(generation, row.prompt_tokens or 0) - len(old)}
        t0 = time.monotonic()
        body = {"input_ids": (row.prompt_token_ids or []) + old, "sampling_params": sampling | generation.sampling()}
        resp = await slot.client.generate(body, self.watch)
        ids = old + list(resp["output_ids"])
        text = await slot.client.detokenize(ids)  # the whole output in one piece, split as the chat route splits
        finish = resp["meta_info"]["finish_reason"] or {}
        if finish.get("type") not in FINISHED:  # an abort without an HTTP error status: try again
            raise ServerError(slot.url, f"/generate finished with {finish!r}")
        thought, content = reasoning.split(text)
        loop = finish.get("loop_start_tokens")
        return self._row(
            row,
            Sent(slot, attempt, time.monotonic() - t0),
            finish_reason=finish["type"],
            completion_tokens=len(ids),
            reasoning_tokens=reasoning.tokens(ids),  # the parent's + the new
            content=content,
            reasoning_content=thought,
            output_ids=ids,
            tokens_reused=len(old),
            loop_start_tokens=None if loop is None else len(old) + loop,
        )

    async def _by_text(self, row: CompletionRow, slot: Slot, attempt: int, reasoning: Reasoning) -> CompletionRow:
        """SGLang's chat route with the raw output as the final, unfinished assistant message
        (`continue_final_message`); the raw continuation comes back unsplit. Without ids, the thought closed when
        content followed it (Qwen3 writes "\n\n" after </think>, so a closed thought leaves content)."""
        generation, done = self.plan.generation, row.completion_tokens or 0
        closed = list(reasoning.end_ids) if row.content else []
        raw = reasoning.raw_text(row.reasoning_content, row.content or "", closed)
        messages = [*json.loads(self.plan.prompts[row.prompt_id].messages_json or "[]")]
        prefill = [*messages, {"role": "assistant", "content": raw}]
        body = chat_body(generation, slot.info.model, prefill, prompt_id=row.prompt_id)  # the row's mode
        body |= {
            "max_completion_tokens": request_cap(generation, row.prompt_tokens or 0) - done,
            "continue_final_message": True,
            "separate_reasoning": False,
        }
        t0 = time.monotonic()
        answer = await slot.client.chat(body, self.watch)
        if answer.finish_reason not in FINISHED:
            raise ServerError(slot.url, f"chat finished with {answer.finish_reason!r}")
        new = answer.completion_tokens or 0
        self.drift.append((answer.prompt_tokens or 0) - (row.prompt_tokens or 0) - done)
        thought, content = reasoning.split(raw + (answer.content or ""))
        loop = answer.loop_start_tokens
        return self._row(
            row,
            Sent(slot, attempt, time.monotonic() - t0),
            finish_reason=answer.finish_reason,
            completion_tokens=done + new,
            reasoning_tokens=(row.reasoning_tokens or 0) + (0 if THINK_END in raw else answer.reasoning_tokens),
            content=content,
            reasoning_content=thought,
            loop_start_tokens=None if loop is None else done + loop,
        )

    def refuse(self, item: TurnItem, reason: str, context: int) -> RejectRow:
        run = self.plan.run
        return reject_row(item, "server", reason, self.plan.generation, run.config_hash, context, item.recorded_turn)


async def continue_shard(
    data_dir: str | Path,
    shard: str,
    fleet: Fleet,
    parent_config_hash: str,
    to: int | ToWindow,
    dispatch: DispatchSettings = DispatchSettings(),
    *,
    log: Callable[[str], None] = print,
    runaway: RunawaySettings | None = None,
) -> ContinuationResult:
    """Continue the truncated rows of `parent_config_hash` in `shard` to the cap `to`; copy its stopped rows.

    `to` a ToWindow: the parent is a window-policy config; continue it to this larger trainer window instead (each
    row to its own request cap there). With `dispatch.stream`, every request is streamed and watched (stalls, and
    loops by the `runaway` rules)."""
    storage, started = open_storage(data_dir), time.monotonic()
    store = completion_store(storage, shard)
    if not prompt_store(storage, shard).parts():
        raise FileNotFoundError(f"shard {shard} has no prompt_shards file under {storage}")
    with store.lock():
        store.recover()
        reject_store(storage, shard, "server").recover()
        plan = plan_continuation(storage, shard, fleet, parent_config_hash, to, log)
        run = plan.run
        wanted = {pid for pid, _ in plan.copies}
        for batch in completion_batches(store, parent_config_hash, wanted=wanted, size=dispatch.commit_rows):
            mine = [_copied(r, run.config_hash, plan.generation) for r in batch if key(r) in plan.copies]
            store.commit(as_dicts(mine))
            run.copied += len(mine)
        end_ids = await fleet.clients[0].tokenize(THINK_END) if plan.to_continue else []
        continuer = Continuer(fleet, plan, watch_of(dispatch, runaway), end_ids)
        output = ShardOutput.of(storage, run, plan.own_file, suspects=False)
        # the turn after a continued (or regenerated) one that stopped goes on, on the history that holds it
        dispatcher = Dispatch(
            fleet, dispatch, {shard: output}, continuer.send, continuer.refuse, log, follow_up=next_turn
        )
        await dispatcher.run(plan.to_send(), len(plan.to_continue) + len(plan.going_on))
        output.close()
        run.continued = sum(s["completed"] for s in run.servers.values()) - run.regenerated
        run.notes += _drift_note(continuer.drift)
        _account(run, storage, plan.generation, output)
    run.elapsed_s = time.monotonic() - started
    return run


def _drift_note(drift: list[int]) -> list[str]:
    """What the rows continued by text say of the server's re-tokenisation of their output."""
    if not drift:
        return []
    off = [d for d in drift if d]
    return [
        f"{len(drift)} rows continued by text (no token ids): the server's re-tokenisation of "
        f"their output differed from the generated token count in {len(off)} of them"
        + (f" (by {min(off)} to {max(off)} tokens)" if off else "")
    ]


def _account(run: ContinuationResult, data_dir: Storage, generation: GenerationSettings, output: ShardOutput) -> None:
    """The new config's figures from what is committed, each conversation in the first class that applies (a
    generation run's rows and rejects of the new config count too: the accounting is the config's, not this run's);
    a failure counts only where its conversation is still open."""
    h, shard = run.config_hash, run.shard
    states = account(run, data_dir, output, generation, numbered=False)
    open_ = {pid for pid, c in states.items() if c.over is None}
    run.failed = len({f.prompt_id for f in output.failed} & open_)
    run.left = run.prompts - run.completed - run.rejected - run.failed
    store = completion_store(data_dir, shard)
    if parts := store.parts():
        dataset = store.storage.dataset(parts, schema=COMPLETION_SCHEMA)
        mine = dataset.to_table(columns=["completion_tokens", "tokens_reused"], filter=pc.field("config_hash") == h)
        run.new_config_tokens = pc.sum(mine["completion_tokens"]).as_py() or 0
        run.tokens_reused = pc.sum(mine["tokens_reused"]).as_py() or 0
