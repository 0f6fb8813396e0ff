"""Each export form is one writer: what one exported conversation (the kept rows of one (prompt, config)) becomes in
the JSONL file and the Parquet copy. `writer_for` is the one place that picks a writer by its form's name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa

from dflash_assets.generation.prompts import carries_history, last_turn_request
from dflash_assets.generation.tools import spliced
from dflash_assets.generation.turns import split_turns
from dflash_assets.quality.training.trainer_format import (
    FORM,
    STATUS,
    Form,
    recipe_flags,
    row_problem,
    tool_row_problem,
)
from dflash_assets.store.schema import COMPLETION_SCHEMA

# The content of a window-complete row cut inside its thinking (text forms): past the window, never read by the
# trainer, and non-empty so that SpecForge's validator accepts the file.
WINDOW_CUT_CONTENT = "[cut past the trainer's window]"
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
# a sample's id and status, then its completion row's provenance columns, typed as the row's
ROW_COLUMNS = ("prompt_id", "shard", "source", "config_hash", "max_output_tokens", "prompt_tokens", "completion_tokens")
PROVENANCE = [pa.field("id", pa.string()), pa.field("status", pa.string())]
PROVENANCE += [COMPLETION_SCHEMA.field(name) for name in ROW_COLUMNS]

# SpecForge's validator flags, strongest first: either recipe's (trainer_format.recipe_flags), then the markers alone
VALIDATOR_FLAGS = (
    recipe_flags(True),
    recipe_flags(False),
    {"expect_reasoning": False, "expect_non_reasoning": False, "strict_think_markers": True},
)
Sample = tuple[dict[str, Any], dict[str, Any]]  # (the JSONL line, the Parquet row)


@dataclass(frozen=True)
class KeptRow:
    """One kept completion row as the writers read it: export.py's KEPT query, a column a field."""

    id: str  # "<prompt_id>@<config_hash>"
    prompt_id: str
    shard: str
    source: str | None
    config_hash: str
    max_output_tokens: int | None
    prompt_tokens: int | None
    completion_tokens: int | None
    turn: int | None  # None: a last_turn row
    turns: int | None
    messages_json: str
    content: str | None
    reasoning_content: str | None
    window_cut_in_thinking: bool
    judged_window: int | None
    prompt_token_ids: list[int] | None  # pretokenized form only (else None)
    output_ids: list[int] | None
    file_index: int
    file_row_number: int
    enable_thinking: bool | None
    tool_calls_json: str | None
    tools_json: str | None
    reasoning_empty: bool

    @classmethod
    def of(cls, batch: pa.Table) -> list[KeptRow]:
        """The rows of a batch of KEPT, column by column (no dict per row)."""
        columns = [batch.column(f.name).to_pylist() for f in dataclasses.fields(cls)]
        return [cls(*values) for values in zip(*columns)]


@dataclass(frozen=True)
class Conversation:
    """The kept rows of one exported conversation: one row (last_turn), or its turns in order (all_turns)."""

    rows: tuple[KeptRow, ...]

    @property
    def messages(self) -> list[dict[str, Any]]:
        keys = ("role", "content", "tool_calls", "tool_call_id")
        return [{k: m[k] for k in keys if k in m} for m in json.loads(self.rows[0].messages_json)]

    @property
    def carries_history(self) -> bool:
        """A last_turn row whose history keeps the source's own earlier answers."""
        return self.rows[0].turn is None and carries_history(json.loads(self.rows[0].messages_json))


@dataclass
class Written:
    """What the writer wrote, and what it left out on its way (the manifest's figures)."""

    lines: int = 0  # JSONL lines written
    conversations: int = 0  # conversations they hold
    consumed: int = 0  # kept rows they hold
    refused: dict[str, int] = field(default_factory=dict)  # validator's words -> rows left out (recipe_validation)
    refused_rows: list[tuple[int, int]] = field(default_factory=list)  # (file_index, file_row_number) of those rows
    thinking: set[bool] = field(default_factory=set)  # enable_thinking of the rows judged: the recipe's flags
    source_answers: dict[str, int] = field(default_factory=lambda: {"written": 0, "left_out": 0})
    train_turns: int = 0  # kept rows in the train file (the held-out file holds the rest)
    validator_flags: list[dict[str, bool]] = field(default_factory=lambda: list(VALIDATOR_FLAGS))  # pass every line

    def validated(self, line: dict[str, Any]) -> None:
        """Keep the validator flags that pass on this written conversations line too (a per_turn event's history
        answers have no reasoning_content, a mix of modes has rows of both): the manifest names the first left."""
        self.validator_flags = [f for f in self.validator_flags if row_problem(line, **f) is None]


def answer(row: KeptRow) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": WINDOW_CUT_CONTENT if row.window_cut_in_thinking else row.content,
    }
    if not row.reasoning_empty:
        message["reasoning_content"] = row.reasoning_content
    if row.tool_calls_json:
        message["tool_calls"] = json.loads(row.tool_calls_json)
    return message


def exported_messages(conversation: Conversation) -> list[dict[str, str]]:
    """The messages of one exported id: the prompt and its regenerated answer (last_turn), or under all_turns
    each user turn followed by its regenerated answer, up to the turn where it ends for the trainer (selection.py)."""
    rows, messages = conversation.rows, conversation.messages
    if rows[0].turn is None:
        return [*last_turn_request(messages), answer(rows[0])]
    if [r.turn for r in rows] != list(range(1, len(rows) + 1)):  # selection.py exports turns 1..k
        raise RuntimeError(f"conversation {rows[0].id} exported with turns {[r.turn for r in rows]}")
    out, groups = split_turns(messages)
    previous: dict[str, Any] | None = None
    for group, row in zip(groups, rows):  # a user turn, or the source's tool results spliced after the calls
        out += spliced(group, previous)
        previous = answer(row)
        out.append(previous)
    return out


def pretokenized(row: KeptRow, max_length: int | None) -> dict[str, Any]:
    """{id, input_ids, loss_mask}: the prompt's ids (loss 0) then the generated ids (loss 1), cut at the window.
    What SpecForge's online trainer (prompt_builder.py) and speculators' pre-tokenized path read as is."""
    prompt, output = row.prompt_token_ids or [], row.output_ids or []
    end = len(prompt) + len(output) if max_length is None else max_length
    sample_id = row.id if row.turn is None else f"{row.id}#{row.turn}"
    return {
        "id": sample_id,
        "input_ids": (prompt + output)[:end],
        "loss_mask": ([0] * len(prompt) + [1] * len(output))[:end],
    }


class Writer:
    """One export form: its Parquet schema and what a conversation becomes."""

    form: ClassVar[Form]
    schema: ClassVar[pa.Schema]

    def samples(self, conversation: Conversation, done: Written) -> list[Sample]:
        raise NotImplementedError

    @staticmethod
    def dumps(line: dict[str, Any]) -> bytes:
        return json.dumps(line, ensure_ascii=False).encode("utf-8") + b"\n"

    def record(self, row: KeptRow, **columns: Any) -> dict[str, Any]:
        """The Parquet row: the schema's columns the kept row has (provenance), then the form's own."""
        return {k: getattr(row, k, None) for k in self.schema.names} | {"status": STATUS} | columns


class PretokenizedWriter(Writer):
    """A sample per row (per turn under all_turns): its own ids, cut at its row's window (judged_window)."""

    form = FORM["pretokenized"]
    schema = pa.schema(
        [
            *PROVENANCE,
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("turn", pa.int16()),
        ]
    )

    @staticmethod
    def dumps(line: dict[str, Any]) -> bytes:
        return json.dumps(line, separators=(",", ":")).encode("utf-8") + b"\n"

    def samples(self, conversation: Conversation, done: Written) -> list[Sample]:
        done.consumed += len(conversation.rows)
        done.source_answers["written"] += conversation.carries_history  # in the prompt's ids: loss 0
        out = []
        for row in conversation.rows:
            sample = pretokenized(row, row.judged_window)
            out.append((sample, self.record(row, **sample)))
        return out


class TextWriter(Writer):
    """The text forms: the whole conversation, first judged by SpecForge's validator with its recipe's flags for
    the row's config (trainer_format.recipe_flags): a conversation it would stop at is left out, never written."""

    check = staticmethod(row_problem)  # the validator's verdict on a conversations row

    def line(self, sample_id: str, judged: dict[str, Any], messages: list[dict[str, str]]) -> dict[str, Any]:
        raise NotImplementedError

    def samples(self, conversation: Conversation, done: Written) -> list[Sample]:
        rows = conversation.rows
        judged = self.judged(conversation, done)
        if judged is None:
            return []
        row = dataclasses.replace(rows[-1], completion_tokens=sum(r.completion_tokens or 0 for r in rows))
        messages = judged["conversations"]
        return [(self.line(row.id, judged, messages), self.record(row, **{self.form.column: messages}))]

    def judged(self, conversation: Conversation, done: Written) -> dict[str, Any] | None:
        """The conversations row of `conversation`, or None where the validator would stop at it."""
        rows = conversation.rows
        done.consumed += len(rows)
        messages = exported_messages(conversation)
        history = conversation.carries_history
        thinking = bool(rows[-1].enable_thinking)
        done.thinking.add(thinking)
        judged = {"id": rows[-1].id, "status": STATUS, "conversations": messages}
        if problem := self.check(judged, **recipe_flags(thinking)):
            done.refused[problem] = done.refused.get(problem, 0) + len(rows)
            done.refused_rows += [(r.file_index, r.file_row_number) for r in rows]
            done.source_answers["left_out"] += history
            return None
        done.source_answers["written"] += history
        return judged


class ConversationsWriter(TextWriter):
    """SpecForge's {id, status, conversations}: what its validate_regenerated_data.py accepts."""

    form = FORM["conversations"]
    schema = pa.schema([*PROVENANCE, ("conversations", pa.list_(MESSAGE))])

    def line(self, sample_id: str, judged: dict[str, Any], messages: list[dict[str, str]]) -> dict[str, Any]:
        return judged


class MessagesWriter(TextWriter):
    """OpenAI's {id, messages}."""

    form = FORM["messages"]
    schema = pa.schema([*PROVENANCE, ("messages", pa.list_(MESSAGE))])

    def line(self, sample_id: str, judged: dict[str, Any], messages: list[dict[str, str]]) -> dict[str, Any]:
        return {"id": sample_id, "messages": messages}


class PerTurnWriter(TextWriter):
    """One generation-event row per regenerated assistant turn, line for line what SpecForge's
    scripts/expand_reasoning_conversations.py (expand_row) makes of the conversations form's file: the history before
    the turn with earlier answers' reasoning dropped, then the turn. Trained with train_only_last_turn: true."""

    form = FORM["per_turn"]
    schema = pa.schema(
        [
            *PROVENANCE,
            ("source_id", pa.string()),
            ("assistant_turn_index", pa.int16()),
            ("conversations", pa.list_(MESSAGE)),
        ]
    )

    def __init__(self) -> None:
        self.source_rows = 0  # the conversations form's lines so far: the next one's source_row_index

    def samples(self, conversation: Conversation, done: Written) -> list[Sample]:
        judged = self.judged(conversation, done)
        if judged is None:
            return []
        source_row_index, self.source_rows = self.source_rows, self.source_rows + 1
        history: list[dict[str, Any]] = []
        events, index = [], 0
        # the regenerated answers: every one under all_turns, the last one under last_turn (the source's earlier
        # answers are history the target did not write)
        regenerated = len(conversation.rows)
        assistants = sum(m["role"] == "assistant" for m in judged["conversations"])
        for message in judged["conversations"]:
            if message["role"] != "assistant":
                history.append(dict(message))
                continue
            if index >= assistants - regenerated:
                row = conversation.rows[index - (assistants - regenerated)]
                event = {
                    "id": f"{judged['id']}#turn{index}",
                    "source_id": judged["id"],
                    "source_row_index": source_row_index,
                    "assistant_turn_index": index,
                    "conversations": [*(dict(m) for m in history), dict(message)],
                    "status": STATUS,
                }
                record = self.record(row, id=event["id"], source_id=judged["id"], assistant_turn_index=index) | {
                    "conversations": event["conversations"]
                }
                events.append((event, record))
            history.append({k: v for k, v in message.items() if k != "reasoning_content"})
            index += 1
        return events


WRITERS: dict[str, type[Writer]] = {
    w.form.name: w for w in (ConversationsWriter, PerTurnWriter, MessagesWriter, PretokenizedWriter)
}


# An agentic export's messages: tool calls (JSON of SGLang's tool_calls) and the call a tool result answers
TOOL_CALL = pa.struct(
    [
        ("id", pa.string()),
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
    ]
)
AGENTIC_MESSAGE = pa.struct(
    [
        *(MESSAGE.field(i) for i in range(MESSAGE.num_fields)),
        ("tool_calls", pa.list_(TOOL_CALL)),
        ("tool_call_id", pa.string()),
    ]
)


def agentic(writer: type[Writer]) -> type[Writer]:
    """The writer of a text form for an export with tool schemas: each line (and Parquet row) carries `tools`, the
    JSON text of its conversation's schemas, as SpecForge's build_eagle3_dataset reads it (json.loads of the
    column) and hands it to the chat template; messages keep tool_calls and tool_call_id."""
    fields = [pa.field(f.name, pa.list_(AGENTIC_MESSAGE)) if f.type == pa.list_(MESSAGE) else f for f in writer.schema]

    class Agentic(writer):  # type: ignore[valid-type,misc]  # a subclass of the form's writer, made per form
        schema = pa.schema([*fields, ("tools", pa.string())])
        check = staticmethod(tool_row_problem)

        def samples(self, conversation: Conversation, done: Written) -> list[Sample]:
            tools = conversation.rows[0].tools_json
            return [
                ({**line, "tools": tools} if tools else line, record | {"tools": tools})
                for line, record in super().samples(conversation, done)
            ]

    return Agentic


def writer_for(form: str, tools: bool = False) -> Writer:
    """The writer of a form (TrainerSettings.format); an unknown form is refused before anything is written.
    `tools`: the export holds conversations with tool schemas (the text forms then carry them)."""
    if form not in WRITERS:
        raise ValueError(f"export form must be one of {', '.join(WRITERS)}, got {form!r}")
    writer = WRITERS[form]
    return agentic(writer)() if tools and issubclass(writer, TextWriter) else writer()
