"""The round trip with the drafter trainer: the export is what SpecForge's validator accepts, and reads back."""

import asyncio
import json

import pyarrow.parquet as pq
import pytest

from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.prompts import Prompt, read_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality import export_training_set
from dflash_assets.quality.trainer_format import has_think_marker, row_problem, think_marker_sql
from dflash_assets.settings import DispatchSettings, GenerationSettings

GOOD = {
    "id": "x@h",
    "status": "success",
    "conversations": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
    ],
}


def with_(**changes):
    return {**GOOD, **changes}


def turns(*changes):
    return with_(conversations=[dict(m) for m in changes])


RULES = [  # each rule of the format refuses its case, with the validator's own words
    (with_(id=""), "id must be a non-empty string"),
    (with_(id=7), "id must be a non-empty string"),
    ({k: v for k, v in GOOD.items() if k != "status"}, "status must be 'success'"),
    (with_(conversations=[]), "conversations must be a non-empty list"),
    (
        turns({"role": "user", "content": "q"}, {"role": "assistant", "content": " "}),
        "message 1 content must be a non-empty string",
    ),
    (turns({"role": "assistant", "content": "a"}), "message 0 expected role 'user', got 'assistant'"),
    (
        turns({"role": "user", "content": "q"}, {"role": "user", "content": "q"}),
        "message 1 expected role 'assistant', got 'user'",
    ),
    (
        turns({"role": "user", "content": "q"}, {"role": "tool", "content": "t"}),
        "message 1 has unsupported role 'tool'",
    ),
    (turns({"role": "user", "content": "q"}), "conversation must end with an assistant message"),
    (
        turns({"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": 3}),
        "assistant message 1 reasoning_content must be a string or null",
    ),
    (
        turns({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}),
        "assistant message 1 has empty reasoning_content",
    ),
    (
        turns(
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "a </THINK>", "reasoning_content": "r"}
        ),
        "assistant message 1 contains a thinking marker",
    ),
    (
        turns({"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "<think>r"}),
        "assistant message 1 contains a thinking marker",
    ),
]


@pytest.mark.parametrize("row,problem", RULES, ids=[p for _, p in RULES])
def test_each_rule_of_the_trainer_format_refuses_its_case(row, problem):
    assert row_problem(GOOD) is None
    assert row_problem(row) == problem


SOURCE = [
    {"id": "single", "prompt": "Explain a Bloom filter."},
    {"id": "sys", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why TCP?"}]},
    # multi-turn, last_turn: the final assistant turn is regenerated, conditioned on the turns before it
    {
        "id": "multi",
        "conversations": [
            {"from": "human", "value": "Hi, what is RAID 5?"},
            {"from": "gpt", "value": "Striping with parity."},
            {"from": "human", "value": "And RAID 6?"},
            {"from": "gpt", "value": "An old answer, regenerated."},
        ],
    },
] + [{"id": f"p{i}", "prompt": f"Round trip prompt {i}."} for i in range(12)]


def test_the_sql_marker_flag_is_the_validators_python_rule_on_tricky_text():
    """The check and the export read a DuckDB flag; the validator runs `marker in text.lower()` in Python."""
    import duckdb

    texts = [
        "<THINK>",
        "x</Think>y",
        "<thin\u212a>",
        "<th\u0130nk>",
        "<th\u0131nk>",
        "< think>",
        "<thinking>",
        "</think",
        "plain",
        "",
    ]
    sql = duckdb.execute(f"SELECT {think_marker_sql('t')} FROM unnest($texts) AS u(t)", {"texts": texts}).fetchall()
    assert (
        [hit for (hit,) in sql]
        == [has_think_marker(t) for t in texts]
        == [True, True, True, False, False, False, False, False, False, False]
    )
    # fetchall, not fetchone: duckdb 2 leaves the default connection busy with an unfinished result otherwise
    assert duckdb.execute(
        f"SELECT {think_marker_sql('a', 'b')} FROM (SELECT NULL::VARCHAR a, NULL::VARCHAR b)"
    ).fetchall() == [(False,)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tests.support.forks import start_emulator

    tmp = tmp_path_factory.mktemp("roundtrip")
    src = tmp / "source.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in SOURCE))
    args = ["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "50000", "--length-median", "150"]

    async def go(url):
        async with connected([url]) as fleet:
            await build_prompt_shard(src, 0, "00000", 100, tmp / "data", fleet, {"enable_thinking": True})
            await generate_shard(
                tmp / "data",
                "00000",
                fleet,
                GenerationSettings(max_output_tokens=8192),
                DispatchSettings(load_sample_s=0),
                log=lambda m: None,
            )

    with start_emulator(args) as emu:
        asyncio.run(go(emu.url))
    return (
        tmp,
        export_training_set(tmp / "data", tmp / "out", max_length=None),
        export_training_set(tmp / "data", tmp / "out_messages", max_length=None, form="messages"),
    )


def test_every_exported_row_passes_the_trainer_rules_with_reasoning_and_strict_markers(exported):
    _, export, _ = exported
    rows = [json.loads(line) for line in export.jsonl_path.read_text().splitlines()]
    assert len(rows) == export.manifest["rows"] >= len(SOURCE) - 2  # a few may be cut at the cap
    single = [r for r in rows if not r["id"].startswith("multi@")]
    assert [(r["id"], row_problem(r, expect_reasoning=True, strict_think_markers=True)) for r in single] == [
        (r["id"], None) for r in single
    ]
    assert {r["status"] for r in rows} == {"success"}
    # last_turn keeps the source's earlier answers, which carry no reasoning: such a row passes without
    # --expect-reasoning only (regenerate: all_turns gives every turn its reasoning)
    multi = next(r for r in rows if r["id"].startswith("multi@"))
    assert row_problem(multi, expect_reasoning=True) == "assistant message 1 has empty reasoning_content"
    assert row_problem(multi, expect_reasoning=False, strict_think_markers=True) is None
    roles = [m["role"] for m in multi["conversations"]]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert multi["conversations"][1] == {"role": "assistant", "content": "Striping with parity."}  # history kept
    assert multi["conversations"][3]["content"] != "An old answer, regenerated."  # the last turn is the target's


@pytest.mark.parametrize("name", ["training_set.jsonl", "training_set.parquet"])
def test_our_own_export_reads_back_as_a_prompt_source_with_the_same_conversations(exported, name):
    _, export, _ = exported
    path = export.jsonl_path.parent / name
    written = [json.loads(line) for line in export.jsonl_path.read_text().splitlines()]
    items = list(read_shard(path, 0, 1000))
    assert all(isinstance(i, Prompt) and i.format == "conversations" for i in items), items
    assert [(i.prompt_id, i.messages) for i in items] == [
        (r["id"], [{"role": m["role"], "content": m["content"]} for m in r["conversations"]]) for r in written
    ]


def test_the_openai_messages_form_holds_the_same_conversations(exported):
    _, export, messages = exported
    conversations = [json.loads(line) for line in export.jsonl_path.read_text().splitlines()]
    as_messages = [json.loads(line) for line in messages.jsonl_path.read_text().splitlines()]
    assert [set(r) for r in as_messages] == [{"id", "messages"}] * len(conversations)
    assert [(r["id"], r["messages"]) for r in as_messages] == [(r["id"], r["conversations"]) for r in conversations]
    assert "messages" in pq.read_schema(messages.parquet_path).names and messages.manifest["form"] == "messages"
    with pytest.raises(
        ValueError, match="export form must be one of conversations, messages, pretokenized, got 'sharegpt'"
    ):
        export_training_set(exported[0] / "data", exported[0] / "bad", form="sharegpt")
