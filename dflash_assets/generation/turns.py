"""regenerate: all_turns. Every assistant turn of a conversation, in order, each conditioned on the ones before.

The source's assistant turns are dropped. Turn k (1-based) is requested with the system turns, the user turns
1..k and the regenerated answers of turns 1..k-1, each answer as its `content` only, without its reasoning:
what Qwen3's chat template itself keeps of earlier assistant turns (it strips their thinking), so the request
is what the model would see in a real dialogue. Turns of one conversation are sequential (turn k+1 is a
follow-up the dispatcher sends as soon as turn k's answer is back); conversations run in parallel.

Exactly once per turn, with the same ledger as everything else: a turn is done iff its row (prompt_id, turn,
config_hash) is in a committed part. On every start the state of each conversation is recomputed from those
rows and the rejects: the turns committed so far (1..k, contiguous), whether it is over (every turn done, a
turn cut short, a turn refused), else the next turn, whose history is rebuilt from the committed answers: the
same history an uninterrupted run would have sent. A truncated or refused turn ends its conversation (a later
turn would condition on a cut answer); a turn whose retries ran out is retried by the next run. Under the window
policy a conversation also ends once a turn's prompt plus answer fills the trainer's window: the trainer cuts
every later turn.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow.compute as pc

from dflash_assets.fleet.fleet import Fleet
from dflash_assets.fleet.stream import Watch
from dflash_assets.generation.commit import ShardOutput
from dflash_assets.generation.plan import ShardResult, count_filling_window, preflight, prompt_batches, reject_row
from dflash_assets.generation.preflight import Budget
from dflash_assets.generation.request import chat_body
from dflash_assets.generation.send import Rejected
from dflash_assets.generation.slots import Slot
from dflash_assets.rules import fills_window
from dflash_assets.settings import DispatchSettings, GenerationSettings
from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import COMPLETION_SCHEMA, REJECT_SCHEMA
from dflash_assets.store.storage import Storage
from dflash_assets.store.stores import completion_store, prompt_store, reject_store

TURN_ROW = Callable[[dict, dict, Slot, int, float], dict]  # (item, response, slot, attempt, latency) -> the row


def split_turns(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the leading system turns, the user turns): what all_turns keeps of a source conversation."""
    system = [m for m in messages if m["role"] == "system"]
    return system, [m for m in messages if m["role"] == "user"]


def history(item: dict) -> list[dict]:
    """The messages turn `item["turn"]` is requested with: system, then user/answer pairs, then its user turn."""
    messages = list(item["system"])
    for user, answer in zip(item["users"], item["answers"]):
        messages += [user, {"role": "assistant", "content": answer}]
    return messages + [item["users"][item["turn"] - 1]]


@dataclass(frozen=True)
class Conversation:
    """Where one conversation stands, from what is committed."""

    turns: int  # assistant turns to generate: one per user turn
    answers: tuple[str, ...]  # the committed answers of turns 1..k, in order
    over: str | None  # "done", "truncated", "window", "rejected", or None: turn k+1 is next

    @property
    def next_turn(self) -> int | None:
        return None if self.over else len(self.answers) + 1


def conversation(
    turns: int, committed: dict[int, tuple], rejected: set[int], window: int | None = None
) -> Conversation:
    """`committed`: turn -> (finish_reason, content[, prompt_tokens, completion_tokens]); `rejected`: the turns
    with a reject row; `window`: the trainer's window of the window policy (None: a fixed cap)."""
    answers: list[str] = []
    for k in range(1, turns + 1):
        if k not in committed:
            # a reject of the next turn ends it; one of a later turn belongs to a history that was never committed
            return Conversation(turns, tuple(answers), "rejected" if k in rejected else None)
        finish, content, *lengths = committed[k]
        answers.append(content)
        if finish != "stop":
            return Conversation(turns, tuple(answers), "truncated")
        if k < turns and window is not None and lengths and fills_window(sum(x or 0 for x in lengths), window):
            return Conversation(turns, tuple(answers), "window")
    return Conversation(turns, tuple(answers), "done")


def _committed_turns(
    store: PartStore, config_hash: str
) -> dict[str, dict[int, tuple[str, str, int | None, int | None]]]:
    parts = store.parts()
    found: dict[str, dict[int, tuple[str, str, int | None, int | None]]] = {}
    if not parts:
        return found
    where = (pc.field("config_hash") == config_hash) & pc.field("turn").is_valid()
    dataset = store.storage.dataset(parts, schema=COMPLETION_SCHEMA)  # parts from before `turn` read it as null
    columns = ["prompt_id", "turn", "finish_reason", "content", "prompt_tokens", "completion_tokens"]
    for batch in dataset.to_batches(columns=columns, filter=where):
        for r in batch.to_pylist():
            found.setdefault(r["prompt_id"], {})[r["turn"]] = (
                r["finish_reason"],
                r["content"] or "",
                r["prompt_tokens"],
                r["completion_tokens"],
            )
    return found


def _rejected_turns(stores: list[PartStore], config_hash: str) -> dict[str, dict[int, str]]:
    """prompt_id -> {turn: stage} of the turn rejects of this config."""
    found: dict[str, dict[int, str]] = {}
    for store in stores:
        if not (parts := store.parts()):
            continue
        where = (pc.field("config_hash") == config_hash) & pc.field("turn").is_valid()
        table = store.storage.dataset(parts, schema=REJECT_SCHEMA).to_table(
            columns=["prompt_id", "turn", "stage"], filter=where
        )
        for r in table.to_pylist():
            found.setdefault(r["prompt_id"], {})[r["turn"]] = r["stage"]
    return found


@dataclass
class ConversationPlan:
    """One shard under all_turns: the state of every conversation, and the next turn of those not over."""

    run: ShardResult
    prompts: PartStore
    todo: dict[str, Conversation]
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # the next turn's request, counted at planning

    def to_send(self) -> Iterator[dict]:
        for batch in prompt_batches(self.prompts, ["prompt_id", "line", "source", "messages_json"]):
            for row in batch:
                if (state := self.todo.get(row["prompt_id"])) is not None:
                    system, users = split_turns(json.loads(row["messages_json"]))
                    yield {
                        "prompt_id": row["prompt_id"],
                        "shard": self.run.shard,
                        "line": row["line"],
                        "source": row["source"],
                        "turn": state.next_turn,
                        "turns": state.turns,
                        "system": system,
                        "users": users,
                        "answers": list(state.answers),
                        "prompt_tokens": self.prompt_tokens.get(row["prompt_id"]),
                    }


def conversations(
    data_dir: Storage, shard: str, config_hash: str, window: int | None = None
) -> dict[str, Conversation]:
    """The state of every conversation of the shard under this config, from the committed parts (`window`: the
    window policy's trainer window, which ends a conversation once a turn fills it)."""
    committed = _committed_turns(completion_store(data_dir, shard), config_hash)
    rejected = _rejected_turns([reject_store(data_dir, shard, s) for s in ("preflight", "server")], config_hash)
    states = {}
    for batch in prompt_batches(prompt_store(data_dir, shard), ["prompt_id", "messages_json"]):
        for row in batch:
            turns = len(split_turns(json.loads(row["messages_json"]))[1])
            states[row["prompt_id"]] = conversation(
                turns, committed.get(row["prompt_id"], {}), set(rejected.get(row["prompt_id"], {})), window
            )
    return states


async def plan_conversations(
    data_dir: Storage,
    shard: str,
    fleet: Fleet,
    generation: GenerationSettings,
    dispatch: DispatchSettings,
    preflight_policy: str,
    log: Callable[[str], None],
) -> ConversationPlan:
    """Resume and preflight one shard under all_turns (its lock is held): each conversation goes on from its last
    committed turn. That next turn is preflighted now (its history is known); later turns when they are sent."""
    config_hash = generation.config_hash(fleet.model)
    run = ShardResult(shard, config_hash, fleet.model, infos=list(fleet.infos), window=generation.window)
    preflight_rejects = reject_store(data_dir, shard, "preflight")
    for store in (completion_store(data_dir, shard), reject_store(data_dir, shard, "server"), preflight_rejects):
        store.recover()
    states = conversations(data_dir, shard, config_hash, generation.window)
    run.prompts = len(states)
    todo = {pid: c for pid, c in states.items() if c.over is None}
    run.already_done = len(states) - len(todo)
    plan = ConversationPlan(run, prompt_store(data_dir, shard), todo)
    gate, kwargs = asyncio.Semaphore(64), generation.template_kwargs()

    async def count(i: int, item: dict) -> dict:
        async with gate:
            item["prompt_tokens"] = await fleet.clients[i % len(fleet.clients)].count_prompt_tokens(
                history(item), kwargs
            )
        return {k: item[k] for k in ("prompt_id", "line", "turn", "turns", "prompt_tokens")}

    next_turns = await asyncio.gather(*(count(i, item) for i, item in enumerate(plan.to_send())))
    budget = Budget.of(fleet.infos)
    over = preflight(next_turns, budget, generation, preflight_policy)
    preflight_rejects.commit(
        [
            reject_row(
                r,
                "preflight",
                f"turn {r['turn']} of {r['turns']}: {problem}",
                generation,
                config_hash,
                shard,
                budget.context_length,
            )
            for r, problem in over
        ]
    )
    for r, _ in over:
        del todo[r["prompt_id"]]
    count_filling_window(run, [r for r in next_turns if r["prompt_id"] in todo], generation)  # their next turns
    plan.prompt_tokens = {r["prompt_id"]: r["prompt_tokens"] for r in next_turns}
    turns_done = sum(len(c.answers) for c in states.values())
    log(
        f"shard {shard} config {config_hash} (cap {generation.max_output_tokens}, all turns): {run.prompts} "
        f"conversations, {run.already_done} already over, {turns_done} turns already committed, {len(over)} "
        f"rejected in preflight, {len(todo)} to go on with ({sum(c.turns - len(c.answers) for c in todo.values())} "
        f"turns at most) on {len(fleet.clients)} servers"
    )
    return plan


def turn_sender(
    fleet: Fleet, generation: GenerationSettings, token_ids: bool, make_row: TURN_ROW, watch: Watch | None = None
):
    """The Send of all_turns: each turn preflighted when it is sent (its history is known only then), streamed
    and watched with `watch` (None: not streamed)."""
    budget = Budget.of(fleet.infos)
    config_hash = generation.config_hash(fleet.model)

    async def send(item: dict, slot: Slot, attempt: int) -> dict:
        messages = history(item)
        if item["prompt_tokens"] is None:  # a follow-up: its history is known only now
            item["prompt_tokens"] = await slot.client.count_prompt_tokens(messages, generation.template_kwargs())
        request_cap = generation.request_cap(item["prompt_tokens"])
        if problem := generation.window_problem(item["prompt_tokens"]) or budget.problem(
            item["prompt_tokens"], request_cap
        ):
            raise Rejected(
                reject_row(
                    item,
                    "preflight",
                    f"turn {item['turn']} of {item['turns']}: {problem}",
                    generation,
                    config_hash,
                    item["shard"],
                    budget.context_length,
                )
            )
        body = chat_body(generation, fleet.model, messages, token_ids, request_cap)
        t0 = time.monotonic()
        resp = await slot.client.chat(body, watch)
        return make_row(item, resp, slot, attempt, time.monotonic() - t0) | {
            "turn": item["turn"],
            "turns": item["turns"],
        }

    return send


def next_turn(item: dict, row: dict) -> dict | None:
    """The follow-up of a turn that stopped on its own; a cut (or last) turn ends the conversation, and so does a
    turn that fills the window of the window policy (the rule `conversation` applies on a restart)."""
    if row["finish_reason"] != "stop" or item["turn"] >= item["turns"]:
        return None
    window = row.get("trainer_max_length")
    if window is not None and fills_window(row["prompt_tokens"] + row["completion_tokens"], window):
        return None
    return {
        **item,
        "turn": item["turn"] + 1,
        "answers": item["answers"] + [row["content"]],
        "prompt_tokens": None,
        "prefer_server": row["server_url"],
    }  # the server whose prefix cache holds this history


def account(run: ShardResult, data_dir: Storage, output: ShardOutput) -> None:
    """The shard's figures under all_turns, from what is committed: each conversation in one class.

    completed: over with every turn done or cut short (a truncated conversation is reported by its turn);
    rejected: a turn refused (preflight or server); failed: a turn whose retries ran out in this run."""
    states = conversations(data_dir, run.shard, run.config_hash, run.window)
    failed = {f["prompt_id"] for f in output.failed}
    rejected = _rejected_turns([reject_store(data_dir, run.shard, s) for s in ("preflight", "server")], run.config_hash)
    run.completed = sum(c.over in ("done", "truncated", "window") for c in states.values())
    stages = [rejected[pid][len(c.answers) + 1] for pid, c in states.items() if c.over == "rejected"]
    run.rejected_preflight, run.rejected_server = stages.count("preflight"), stages.count("server")
    run.failed = len(failed)
    by_turn: dict[int, dict[str, int]] = {}
    for c in states.values():
        for k in range(1, len(c.answers) + 1):
            by_turn.setdefault(k, {"rows": 0, "truncated": 0, "rejected": 0})["rows"] += 1
        if c.over in ("truncated", "rejected"):
            k = len(c.answers) + (c.over == "rejected")
            by_turn.setdefault(k, {"rows": 0, "truncated": 0, "rejected": 0})[c.over] += 1
    run.by_turn = dict(sorted(by_turn.items()))
    run.truncated_at = {pid: len(c.answers) for pid, c in states.items() if c.over == "truncated"}
