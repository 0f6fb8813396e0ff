"""A conversation is the unit of generation: the turns a config generates of it, and where it stands.

`regenerate` chooses which turns of a source conversation are generated (`turns_of`, the one place that reads it):
- last_turn: one turn, its final assistant turn, requested with everything before it (the source's own earlier
  answers included); its rows record no turn number (the rows of the pipeline before all_turns existed).
- all_turns: every assistant turn, in order. The source's assistant turns are dropped: turn k (1-based) is requested
  with the system turns, the user turns 1..k and the regenerated answers of turns 1..k-1, each answer as its
  `content` only, without its reasoning: what Qwen3's chat template itself keeps of earlier assistant turns (it
  strips their thinking), so the request is what the model would see in a real dialogue.
Everything after that choice (plan, send, commit, accounting) takes conversations and turns: turns of one
conversation are sequential (turn k+1 is a follow-up the dispatcher sends as soon as turn k's answer is back);
conversations run in parallel.

Exactly once per turn, with the same ledger as everything else: a turn is done iff its row (prompt_id, turn,
config_hash) is in a committed part. On every start the state of each conversation is recomputed from those
rows and the server's refusals: the turns committed so far (1..k, contiguous), whether it is over (every turn
done, a turn cut short, a turn refused), else the next turn, whose history is rebuilt from the committed answers:
the same history an uninterrupted run would have sent. A truncated or refused turn ends its conversation (a later
turn would condition on a cut answer); a turn whose retries ran out is retried by the next run. Under the window
policy a conversation also ends once a turn's prompt plus answer fills the trainer's window: the trainer cuts
every later turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow.compute as pc

from dflash_assets.generation.prompts import last_turn_request
from dflash_assets.rules import fills_window, leaves_loss_room
from dflash_assets.settings import GenerationSettings, Regenerate
from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import COMPLETION_SCHEMA, REJECT_SCHEMA
from dflash_assets.store.storage import Storage
from dflash_assets.store.stores import completion_store, prompt_batches, prompt_store, reject_store

FINISHED = ("done", "truncated", "window")  # a conversation over with every turn it will have committed


def split_turns(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the leading system turns, the user turns): what all_turns keeps of a source conversation."""
    system = [m for m in messages if m["role"] == "system"]
    return system, [m for m in messages if m["role"] == "user"]


@dataclass(frozen=True)
class Turns:
    """The turns a config generates of one source conversation: turn k is requested with `before`, the user turns
    and generated answers before it, and `users[k - 1]`. `numbered`: its rows record their turn number."""

    before: list[dict]
    users: list[dict]
    numbered: bool

    @property
    def count(self) -> int:
        return len(self.users)

    def history(self, turn: int, answers: list[str] | tuple[str, ...]) -> list[dict]:
        """The messages turn `turn` is requested with: `before`, then user/answer pairs, then its user turn."""
        messages = list(self.before)
        for user, answer in zip(self.users, answers):
            messages += [user, {"role": "assistant", "content": answer}]
        return messages + [self.users[turn - 1]]

    def column(self, turn: int) -> int | None:
        """The turn as its rows record it."""
        return turn if self.numbered else None


def every_turn(generation: GenerationSettings) -> bool:
    """Whether the config generates every assistant turn (all_turns), its rows numbered by turn."""
    return generation.regenerate == "all_turns"


def regenerate_of(numbered: bool) -> Regenerate:
    """The mode of a config whose rows are `numbered` by turn (every_turn's inverse)."""
    return "all_turns" if numbered else "last_turn"


def turns_of(messages: list[dict], generation: GenerationSettings) -> Turns:
    """With `every_turn`, the one place the regenerate mode is read: which turns of `messages` the config generates."""
    if every_turn(generation):
        system, users = split_turns(messages)
        return Turns(system, users, numbered=True)
    request = last_turn_request(messages)
    return Turns(request[:-1], request[-1:], numbered=False)


def fills_before(turn: int, prompt_tokens: int, generation: GenerationSettings) -> bool:
    """A later turn whose history already fills the trainer's window, or leaves it room for fewer than
    min_loss_tokens supervised tokens: the trainer keeps none of its answer nor of the turns after it, so its
    conversation ends there, with no request for any of them (rules.leaves_loss_room, the rule preflight and the
    export share). A first turn is preflight's: the window policy rejects it, a fixed cap sends it and counts it."""
    return turn > 1 and not leaves_loss_room(prompt_tokens, generation.trainer_max_length, generation.min_loss_tokens)


@dataclass(frozen=True)
class Conversation:
    """Where one conversation stands, from what is committed."""

    turns: int  # assistant turns to generate
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
    """prompt_id -> {turn: (finish_reason, content, prompt_tokens, completion_tokens)} of this config; a row that
    records no turn number is its conversation's one generated turn, turn 1."""
    parts = store.parts()
    found: dict[str, dict[int, tuple[str, str, int | None, int | None]]] = {}
    if not parts:
        return found
    dataset = store.storage.dataset(parts, schema=COMPLETION_SCHEMA)  # parts from before `turn` read it as null
    columns = ["prompt_id", "turn", "finish_reason", "content", "prompt_tokens", "completion_tokens"]
    for batch in dataset.to_batches(columns=columns, filter=pc.field("config_hash") == config_hash):
        for r in batch.to_pylist():
            found.setdefault(r["prompt_id"], {})[r["turn"] or 1] = (
                r["finish_reason"],
                r["content"] or "",
                r["prompt_tokens"],
                r["completion_tokens"],
            )
    return found


def plan_file(config_hash: str) -> str:
    """The file of a config's preflight rejects found in planning: every run's plan recomputes and replaces it."""
    return f"{config_hash}.parquet"


def rejected_turns(stores: list[PartStore], config_hash: str, replanned: bool = True) -> dict[str, dict[int, str]]:
    """prompt_id -> {turn: stage} of the rejects of this config (a reject with no turn number refused turn 1);
    `replanned=False`: without the plan's preflight file (a plan recomputes those)."""
    found: dict[str, dict[int, str]] = {}
    for store in stores:
        if not (parts := [p for p in store.parts() if replanned or p.name != plan_file(config_hash)]):
            continue
        table = store.storage.dataset(parts, schema=REJECT_SCHEMA).to_table(
            columns=["prompt_id", "turn", "stage"], filter=pc.field("config_hash") == config_hash
        )
        for r in table.to_pylist():
            found.setdefault(r["prompt_id"], {})[r["turn"] or 1] = r["stage"]
    return found


def conversations(
    data_dir: Storage,
    shard: str,
    config_hash: str,
    generation: GenerationSettings,
    replanned: bool = True,
) -> dict[str, Conversation]:
    """The state of every conversation of the shard under this config, from the committed parts and the rejects
    (`replanned=False`: without the plan's preflight rejects, which a plan recomputes). Under the window policy a
    conversation ends once a turn fills the trainer's window."""
    committed = _committed_turns(completion_store(data_dir, shard), config_hash)
    stores = [reject_store(data_dir, shard, s) for s in ("preflight", "server")]
    rejected = rejected_turns(stores, config_hash, replanned)
    states = {}
    for batch in prompt_batches(prompt_store(data_dir, shard), ["prompt_id", "messages_json"]):
        for row in batch:
            pid = row["prompt_id"]
            turns = turns_of(json.loads(row["messages_json"]), generation).count
            states[pid] = conversation(turns, committed.get(pid, {}), set(rejected.get(pid, {})), generation.window)
    return states
