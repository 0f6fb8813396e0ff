"""The typed rows of every table the pipeline writes and their Arrow schemas, derived from them (schema_of): a column
is declared once. Under the data dir, hive-style: prompt_shards/shard=<key>/prompts.parquet, and
rejects/shard=<key>/stage=<stage>/, completions/, failures/ and suspects/ (shard=<key>/<part>.parquet).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from itertools import repeat
from operator import attrgetter
from typing import Any, TypeVar, get_args, get_type_hints

import pyarrow as pa


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptRow:
    """A row of PROMPT_SCHEMA, field for field; a read of some of its columns leaves the others null."""

    prompt_id: str  # the source's id, else sha256 of the canonical messages JSON (16 hex)
    shard: str | None = None
    line: int | None = None  # 1-based line (JSONL) or row (Parquet) number in the source
    source: str | None = None  # dataset name: the source's `source` field, else the file stem
    messages_json: str | None = None  # canonical JSON of the whole conversation [{"role", "content"}, ...]
    # exact chat-template token count (the fleet's /v1/tokenize) of the last-turn request
    prompt_tokens: int | None = None
    template_kwargs_json: str | None = None  # chat_template_kwargs prompt_tokens was counted with
    # canonical JSON of the line's tool schemas, sent with every request of it (null for a tool-free line)
    tools_json: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionRow:
    """A row of COMPLETION_SCHEMA, field for field (tests/generation/test_rows.py holds the two together)."""

    prompt_id: str
    shard: str
    source: str | None
    config_hash: str
    finish_reason: str  # "stop" | "length" | "runaway" (stopped while looping: rules.py)
    prompt_tokens: int | None  # as the server counted them (usage.prompt_tokens)
    completion_tokens: int | None
    reasoning_tokens: int | None
    max_output_tokens: int
    server_context_length: int | None
    server_url: str | None
    model: str | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    enable_thinking: bool | None
    content: str | None
    reasoning_content: str | None  # null when the server did not separate reasoning
    latency_s: float | None
    attempt: int | None  # 1 for a first try; >1 after retries
    created_at: datetime | None
    # exact token ids, when the run asked for them (store_token_ids): no re-tokenisation drift downstream
    prompt_token_ids: list[int] | None = None
    output_ids: list[int] | None = None
    # lineage of a continued row (a truncated row of parent_config_hash, continued to this config's cap)
    parent_config_hash: str | None = None
    tokens_reused: int | None = None
    # regenerate: all_turns: a row per assistant turn, 1..turns (null for one row per prompt, last_turn)
    turn: int | None = None
    turns: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache held (usage.prompt_tokens_details)
    # cap_policy window: max_output_tokens is this request's own (the window's rest), policy_cap the config's cap and
    # trainer_max_length the window it was sized to (both null under a fixed cap)
    policy_cap: int | None = None
    trainer_max_length: int | None = None
    loop_start_tokens: int | None = None  # finish_reason "runaway": output tokens decoded when its loop began
    # a seeded mix of modes (GenerationSettings.thinking_share, mode_seed): null for a config of one mode; the row's
    # own mode is enable_thinking
    thinking_share: float | None = None
    mode_seed: int | None = None
    # an agentic turn: the tool calls the target made (JSON of SGLang's message.tool_calls), and whether they differ
    # from the source turn's (name and arguments, in order: the results spliced after them answer other calls)
    tool_calls_json: str | None = None
    calls_differ: bool | None = None
    # an agentic turn whose calls the source has no results for: its conversation ends here (turns.py `diverged`)
    diverged: bool | None = None

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> CompletionRow:
        """The row held by a mapping of its columns (a row read back from a part, with changes); other keys are
        not columns and are left out."""
        columns: dict[str, Any] = {name: row.get(name) for name in COMPLETION_SCHEMA.names}
        return cls(**columns)


@dataclass(frozen=True, slots=True, kw_only=True)
class RejectRow:
    """A row of REJECT_SCHEMA, field for field."""

    shard: str
    stage: str  # "source" | "preflight" | "server"
    line: int | None
    prompt_id: str | None  # null when the line could not be parsed
    config_hash: str | None  # null at stage "source"
    reason: str
    prompt_tokens: int | None
    max_output_tokens: int | None
    server_context_length: int | None
    created_at: datetime | None
    turn: int | None = None  # the assistant turn refused (all_turns), else null


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureRow:
    """A row of FAILURE_SCHEMA, field for field."""

    shard: str
    prompt_id: str
    config_hash: str
    error: str
    attempts: int
    created_at: datetime | None
    turn: int | None = None  # the assistant turn that failed (all_turns), else null


ARROW = {str: pa.string(), int: pa.int32(), float: pa.float64(), bool: pa.bool_()}
ARROW |= {datetime: pa.timestamp("us", tz="UTC"), list[int]: pa.list_(pa.int32())}
NARROW = {"attempt": pa.int16(), "attempts": pa.int16(), "turn": pa.int16(), "turns": pa.int16(), "line": pa.int64()}


def schema_of(row_type: type) -> pa.Schema:
    """A row type's Arrow schema, field for field in its order: a Python type's Arrow type (X | None: X's), the
    integer columns int32 unless NARROW names theirs."""
    hints = get_type_hints(row_type)
    kinds = {f.name: next(a for a in (*get_args(hints[f.name]), hints[f.name]) if a in ARROW) for f in fields(row_type)}
    return pa.schema([(name, NARROW.get(name, ARROW[kind])) for name, kind in kinds.items()])


PROMPT_SCHEMA = schema_of(PromptRow)
REJECT_SCHEMA = schema_of(RejectRow)
COMPLETION_SCHEMA = schema_of(CompletionRow)
FAILURE_SCHEMA = schema_of(FailureRow)
Row = CompletionRow | RejectRow | FailureRow | PromptRow
R = TypeVar("R", CompletionRow, RejectRow, FailureRow, PromptRow)


def table_of(rows: Sequence[Row] | Sequence[dict], schema: pa.Schema) -> pa.Table:
    """Rows as PartStore writes them: typed rows a column at a time (half the cost of a dict a row), mappings (columns
    left out are null) a row at a time."""
    if not rows or isinstance(rows[0], dict):
        return pa.Table.from_pylist(list(rows), schema=schema)
    columns = zip(*map(attrgetter(*schema.names), rows), strict=True)
    return pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(columns, schema, strict=True)], schema=schema)


def rows_as(row_type: type[R], batch: Any) -> list[R]:
    """A batch (an Arrow record batch or table) read back as the rows it was written as (table_of's inverse), a column
    at a time; a column the batch does not hold reads as null."""
    names, rows = batch.schema.names, [object.__new__(row_type) for _ in range(batch.num_rows)]
    for name in _names(row_type):
        values = batch.column(names.index(name)).to_pylist() if name in names else repeat(None)
        deque(map(getattr(row_type, name).__set__, rows, values), maxlen=0)
    return rows


_NAMES: dict[type, tuple[str, ...]] = {}


def _names(row: Row | type) -> tuple[str, ...]:
    kind = row if isinstance(row, type) else type(row)
    if (names := _NAMES.get(kind)) is None:
        names = _NAMES[kind] = tuple(f.name for f in fields(kind))
    return names
