"""The typed rows (store/schema.py) are the Parquet schemas field for field: a row the generation builds is written
as its schema says, and a column added to one without the other fails here."""

import types
import typing
from dataclasses import fields
from datetime import UTC, datetime

import pyarrow as pa
import pytest

from dflash_assets.generation.plan import reject_row
from dflash_assets.settings import GenerationSettings
from dflash_assets.store.schema import (
    COMPLETION_SCHEMA,
    FAILURE_SCHEMA,
    REJECT_SCHEMA,
    CompletionRow,
    FailureRow,
    RejectRow,
    as_dicts,
)
from dflash_assets.store.stores import completion_store, failure_store, reject_store

ROWS = [(CompletionRow, COMPLETION_SCHEMA), (RejectRow, REJECT_SCHEMA), (FailureRow, FAILURE_SCHEMA)]
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
    prompt = {"prompt_id": "p", "line": 7, "prompt_tokens": 5, "turn": 2}
    reject = reject_row(prompt, "server", "HTTP 400", GenerationSettings(max_output_tokens=8), "c", "00000", 64)
    failure = FailureRow(shard="00000", prompt_id="p", config_hash="c", error="HTTP 503", attempts=4, created_at=now)
    for store, row in [
        (completion_store(tmp_path, "00000"), completion),
        (reject_store(tmp_path, "00000", "server"), reject),
        (failure_store(tmp_path, "00000"), failure),
    ]:
        store.commit(as_dicts([row]))
        assert store.read().to_pylist() == as_dicts([row])
