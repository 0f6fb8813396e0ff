"""The typed rows (store/schema.py) are the Parquet schemas field for field: a row the generation builds is written
as its schema says, and a column added to one without the other fails here."""

import types
import typing
from dataclasses import fields
from datetime import UTC, datetime

import pyarrow as pa
import pytest

from dflash_assets.generation.plan import reject_row
from dflash_assets.generation.turns import Planned
from dflash_assets.settings import GenerationSettings
from dflash_assets.store.schema import (
    COMPLETION_SCHEMA,
    FAILURE_SCHEMA,
    PROMPT_SCHEMA,
    REJECT_SCHEMA,
    CompletionRow,
    FailureRow,
    PromptRow,
    RejectRow,
    rows_as,
)
from dflash_assets.store.stores import (
    completion_batches,
    completion_store,
    failure_store,
    prompt_batches,
    prompt_store,
    reject_store,
)

ROWS = [
    (CompletionRow, COMPLETION_SCHEMA),
    (RejectRow, REJECT_SCHEMA),
    (FailureRow, FAILURE_SCHEMA),
    (PromptRow, PROMPT_SCHEMA),
]
PYTHON = {str: pa.types.is_string, int: pa.types.is_integer, float: pa.types.is_floating, bool: pa.types.is_boolean}


def arrow_test(annotation):
    """The pyarrow type test an annotation stands for (X | None: X's)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        [annotation] = args
    if annotation is datetime:
        return pa.types.is_timestamp
    if typing.get_origin(annotation) is list:
        [item] = typing.get_args(annotation)
        return lambda t: pa.types.is_list(t) and PYTHON[item](t.value_type)
    return PYTHON[annotation]


@pytest.mark.parametrize(("row", "schema"), ROWS, ids=lambda x: getattr(x, "__name__", ""))
def test_each_row_type_is_its_schema_field_for_field(row, schema):
    hints = typing.get_type_hints(row)
    assert [f.name for f in fields(row)] == schema.names
    assert [f.name for f in schema if not arrow_test(hints[f.name])(f.type)] == []


def test_typed_rows_are_written_by_the_part_stores_as_their_schema_reads_them(tmp_path):
    now = datetime(2026, 12, 4, tzinfo=UTC)
    completion = CompletionRow.of(
        dict.fromkeys(COMPLETION_SCHEMA.names)
        | {"prompt_id": "p", "shard": "00000", "config_hash": "c", "finish_reason": "stop", "max_output_tokens": 8}
        | {"output_ids": [1, 2], "turn": 2, "turns": 3, "created_at": now, "line": 7}  # `line` is not a column
    )
    turn = Planned(prompt_id="p", shard="00000", line=7, turn=2, turns=3, prompt_tokens=5)
    reject = reject_row(turn, "server", "HTTP 400", GenerationSettings(max_output_tokens=8), "c", 64, turn.turn)
    failure = FailureRow(shard="00000", prompt_id="p", config_hash="c", error="HTTP 503", attempts=4, created_at=now)
    prompt = PromptRow(prompt_id="p", shard="00000", line=7, source="s", messages_json="[]", prompt_tokens=5)
    for store, row in [
        (completion_store(tmp_path, "00000"), completion),
        (reject_store(tmp_path, "00000", "server"), reject),
        (failure_store(tmp_path, "00000"), failure),
        (prompt_store(tmp_path, "00000"), prompt),
    ]:
        store.commit([row])
        assert store.read().to_pylist() == [{name: getattr(row, name) for name in store.schema.names}]
        assert rows_as(type(row), store.read()) == [row]  # read back as the row it was written as


def test_the_stores_read_rows_back_typed_and_a_column_not_read_or_not_yet_written_is_null(tmp_path):
    prompts = prompt_store(tmp_path, "00000")
    old = PROMPT_SCHEMA.remove(PROMPT_SCHEMA.get_field_index("tools_json"))  # a part from before tools_json
    prompts.storage.write_table(
        pa.Table.from_pylist([{"prompt_id": "a", "line": 1, "prompt_tokens": 3}], old), prompts.dir / "part-old.parquet"
    )
    prompts.commit([{"prompt_id": "b", "line": 2, "tools_json": "[]"}])
    read = [r for batch in prompt_batches(prompts, ["prompt_id", "line", "tools_json"]) for r in batch]
    assert sorted(read, key=lambda r: r.prompt_id) == [
        PromptRow(prompt_id="a", line=1),  # prompt_tokens not read; tools_json not written
        PromptRow(prompt_id="b", line=2, tools_json="[]"),
    ]
    completions = completion_store(tmp_path, "00000")
    base = dict.fromkeys(COMPLETION_SCHEMA.names) | {"shard": "00000", "finish_reason": "stop", "max_output_tokens": 8}
    rows = [
        CompletionRow.of(base | {"prompt_id": p, "config_hash": c}) for p, c in [("a", "x"), ("b", "x"), ("b", "y")]
    ]
    completions.commit(rows)
    assert [r for b in completion_batches(completions, "x", wanted={"b"}) for r in b] == [rows[1]]
    [[only]] = completion_batches(completions, "y", ["prompt_id", "finish_reason"])
    assert (only.prompt_id, only.finish_reason, only.max_output_tokens) == ("b", "stop", None)
