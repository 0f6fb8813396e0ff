"""A conversation is the unit of generation: the turns a config generates of it, and where it stands.

`regenerate` (read only by `turns_of`): last_turn, the final assistant turn (rows without a turn number); all_turns,
turn k requested with the user turns 1..k and the regenerated answers of turns 1..k-1 as `content` only (what Qwen3's
template keeps). An agentic conversation splices the source's tool results after the target's own calls, and ends,
`diverged`, where they do not match.

A turn is done iff its row (prompt_id, turn, config_hash) is committed: each start rebuilds every conversation from
those rows. A cut or refused turn ends its conversation, as does, under the window policy, one that fills the window.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pyarrow.compute as pc

from dflash_assets.generation.prompts import last_turn_request
from dflash_assets.generation.tools import answer_message, calls_of, results_in, spliced
from dflash_assets.rules import fills_window, leaves_loss_room
from dflash_assets.settings import GenerationSettings, Regenerate
from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import COMPLETION_SCHEMA, REJECT_SCHEMA, CompletionRow, PromptRow, RejectRow, rows_as
from dflash_assets.store.storage import Storage
from dflash_assets.store.stores import completion_store, prompt_batches, prompt_store, reject_store

FINISHED = ("done", "truncated", "window", "diverged")  # a conversation over with every turn it will have committed
Answer = str | dict  # a committed answer: its content, or its message (answer_message) when it may carry calls


def split_turns(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(the leading system turns, the messages before each assistant turn: its user turn, or the tool results that
    answer the turn before): what all_turns keeps of a source conversation."""
    system, groups, group = [m for m in messages if m["role"] == "system"], [], list[dict]()
    for m in messages:
        if m["role"] in ("assistant", "user") and group:  # a user turn is a group of its own
            groups.append(group)
            group = []
        if m["role"] in ("user", "tool"):
            group.append(m)
    return system, groups + ([group] if group else [])


def source_calls(messages: list[dict]) -> list[list[dict]]:
    """The tool calls of each assistant turn of the source, in order (what a regenerated turn is compared with)."""
    return [m.get("tool_calls") or [] for m in messages if m["role"] == "assistant"]


@dataclass(frozen=True)
class Turns:
    """The turns a config generates of one source conversation: turn k is requested with `before`, the groups and
    generated answers before it, and `groups[k - 1]` (a user turn, or tool results spliced after the answer before).
    `numbered`: its rows record their turn number; `tools`: the schemas every request of it carries."""

    before: list[dict]
    groups: list[list[dict]]
    numbered: bool
    tools: list[dict] | None = None
    calls: tuple[tuple[dict, ...], ...] = ()  # the source's calls of each generated turn (all_turns)

    @property
    def count(self) -> int:
        return len(self.groups)

    def history(self, turn: int, answers: list[Answer] | tuple[Answer, ...]) -> list[dict]:
        """The messages turn `turn` is requested with: `before`, then each group and its answer, then its group."""
        messages: list[dict] = list(self.before)
        previous: dict | None = None
        for group, answer in zip(self.groups, answers):
            messages += spliced(group, previous)
            previous = answer if isinstance(answer, dict) else answer_message(answer, None)
            messages.append(previous)
        return messages + spliced(self.groups[turn - 1], previous)

    def ends_after(self, turn: int, answer: Answer) -> bool:
        """Whether the conversation ends after `turn`, its answer's calls not matching the results the source has
        after it (turns.py: `diverged`)."""
        return turn < self.count and len(calls_of(answer)) != results_in(self.groups[turn])

    def source_calls_of(self, turn: int) -> list[dict]:
        return list(self.calls[turn - 1]) if turn <= len(self.calls) else []

    def column(self, turn: int) -> int | None:
        """The turn as its rows record it."""
        return turn if self.numbered else None


def every_turn(generation: GenerationSettings) -> bool:
    """Whether the config generates every assistant turn (all_turns), its rows numbered by turn."""
    return generation.regenerate == "all_turns"


def regenerate_of(numbered: bool) -> Regenerate:
    """The mode of a config whose rows are `numbered` by turn (every_turn's inverse)."""
    return "all_turns" if numbered else "last_turn"


def turns_of(messages: list[dict], generation: GenerationSettings, tools: list[dict] | None = None) -> Turns:
    """With `every_turn`, the one place the regenerate mode is read: which turns of `messages` the config generates
    (`tools`: the conversation's tool schemas)."""
    calls = tuple(tuple(c) for c in source_calls(messages))
    if every_turn(generation):
        system, groups = split_turns(messages)
        return Turns(system, groups, numbered=True, tools=tools, calls=calls)
    request = last_turn_request(messages)
    start = len(request) - 1
    while start > 0 and request[start - 1]["role"] == "tool":  # the results that answer the calls before them
        start -= 1
    final = calls[-1:] if messages[-1]["role"] == "assistant" else ()
    return Turns(request[:start], [request[start:]], numbered=False, tools=tools, calls=final)


def turns_of_row(row: PromptRow, generation: GenerationSettings) -> Turns:
    """The turns of a prompt row (its messages_json and tools_json)."""
    tools = json.loads(row.tools_json) if row.tools_json else None
    return turns_of(json.loads(row.messages_json or "[]"), generation, tools)


@dataclass(kw_only=True, slots=True)
class Planned:
    """A conversation's turn with its prompt counted (None: not yet, a follow-up's history is known only when it is
    sent): what preflight and a reject row read. `turn` is its place in the conversation, 1-based."""

    prompt_id: str
    shard: str
    line: int | None
    turn: int
    turns: int
    prompt_tokens: int | None
    tools: bool = False  # its requests carry tool schemas


@dataclass(kw_only=True, slots=True)
class TurnItem(Planned):
    """A conversation's turn to send, a work item of the dispatcher: a plan's, a follow-up, or a continued row's
    (`parent`: the row cut at the cap that this turn goes on from)."""

    source: str | None
    conversation: Turns
    answers: list[Answer]
    prefer_server: str | None = None  # the server whose prefix cache holds its history
    parent: CompletionRow | None = field(default=None, repr=False)

    @property
    def recorded_turn(self) -> int | None:
        """The turn as its rows record it: a number only where the conversation's rows carry one."""
        return self.conversation.column(self.turn)

    @property
    def recorded_turns(self) -> int | None:
        return self.conversation.column(self.turns)


def next_item(prompt: PromptRow, shard: str, generation: GenerationSettings, state: Conversation) -> TurnItem:
    """The next turn of a conversation not over, from its prompt row and where it stands."""
    conversation = turns_of_row(prompt, generation)
    return TurnItem(
        prompt_id=prompt.prompt_id,
        shard=shard,
        line=prompt.line,
        source=prompt.source,
        conversation=conversation,
        turn=state.next_turn or state.turns,
        turns=conversation.count,
        answers=list(state.answers),
        prompt_tokens=None,
        tools=bool(conversation.tools),
    )


def fills_before(turn: int, prompt_tokens: int, generation: GenerationSettings) -> bool:
    """A later turn whose history leaves the trainer's window no room for min_loss_tokens (rules.leaves_loss_room):
    its conversation ends there, unsent. A first turn is preflight's."""
    return turn > 1 and not leaves_loss_room(prompt_tokens, generation.trainer_max_length, generation.min_loss_tokens)


@dataclass(frozen=True)
class Conversation:
    """Where one conversation stands, from what is committed."""

    turns: int  # assistant turns to generate
    answers: tuple[Answer, ...]  # the committed answers of turns 1..k, in order
    over: str | None  # "done", "truncated", "window", "diverged", "rejected", or None: turn k+1 is next

    @property
    def next_turn(self) -> int | None:
        return None if self.over else len(self.answers) + 1


def conversation(
    turns: int, committed: dict[int, tuple], rejected: set[int], window: int | None = None, shape: Turns | None = None
) -> Conversation:
    """`committed`: turn -> (finish_reason, answer[, prompt_tokens, completion_tokens]); `rejected`: the turns
    with a reject row; `window`: the trainer's window of the window policy (None: a fixed cap); `shape`: the turns,
    whose tool results an answer's calls must match for the conversation to go on."""
    answers: list[Answer] = []
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
        if shape is not None and shape.ends_after(k, content):
            return Conversation(turns, tuple(answers), "diverged")
    return Conversation(turns, tuple(answers), "done")


def _committed_turns(
    store: PartStore, config_hash: str
) -> dict[str, dict[int, tuple[str, Answer, int | None, int | None]]]:
    """prompt_id -> {turn: (finish_reason, answer, prompt_tokens, completion_tokens)} of this config, the answer its
    content, or its message where it made tool calls; a row with no turn number is turn 1."""
    parts = store.parts()
    found: dict[str, dict[int, tuple[str, Answer, int | None, int | None]]] = {}
    if not parts:
        return found
    dataset = store.storage.dataset(parts, schema=COMPLETION_SCHEMA)  # parts from before `turn` read it as null
    columns = ["prompt_id", "turn", "finish_reason", "content", "prompt_tokens", "completion_tokens", "tool_calls_json"]
    for batch in dataset.to_batches(columns=columns, filter=pc.field("config_hash") == config_hash):
        for pid, turn, finish, content, prompt, completion, calls in zip(*batch.to_pydict().values(), strict=True):
            answer = answer_message(content or "", calls) if calls else content or ""
            found.setdefault(pid, {})[turn or 1] = (finish, answer, prompt, completion)
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
        for r in rows_as(RejectRow, table):
            found.setdefault(r.prompt_id or "", {})[r.turn or 1] = r.stage
    return found


def conversations(
    data_dir: Storage,
    shard: str,
    config_hash: str,
    generation: GenerationSettings,
    replanned: bool = True,
) -> dict[str, Conversation]:
    """The state of every conversation of the shard under this config, from the committed parts and the rejects
    (`replanned=False`: without the plan's preflight rejects, which a plan recomputes)."""
    committed = _committed_turns(completion_store(data_dir, shard), config_hash)
    stores = [reject_store(data_dir, shard, s) for s in ("preflight", "server")]
    rejected = rejected_turns(stores, config_hash, replanned)
    states = {}
    for batch in prompt_batches(prompt_store(data_dir, shard), ["prompt_id", "messages_json", "tools_json"]):
        for row in batch:
            pid = row.prompt_id
            shape = turns_of_row(row, generation)
            states[pid] = conversation(
                shape.count, committed.get(pid, {}), set(rejected.get(pid, {})), generation.window, shape
            )
    return states
