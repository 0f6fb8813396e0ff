"""The round trip with the drafter trainer: the export is what SpecForge's validator accepts, and reads back."""

import asyncio
import json

import duckdb
import pyarrow.parquet as pq
import pytest

from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.prompts import Prompt, read_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality import export_training_set
from dflash_assets.quality.training.export import exclusion_lines
from dflash_assets.quality.training.trainer_format import (
    flags_text,
    has_think_marker,
    recipe_flags,
    row_problem,
    think_marker_sql,
)
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
    (turns({"role": "user", "content": "q"}), "conversation has no assistant message"),
    (
        turns(
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
            {"role": "user", "content": "q"},
        ),
        "conversation must end with an assistant message",
    ),
    ("a line", "expected a JSON object"),
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
        "assistant message 1 reasoning_content contains a thinking marker",
    ),
]


@pytest.mark.parametrize("row,problem", RULES, ids=[p for _, p in RULES])
def test_each_rule_of_the_trainer_format_refuses_its_case(row, problem):
    assert row_problem(GOOD) is None
    assert row_problem(row) == problem


def test_expect_non_reasoning_refuses_reasoning_and_the_two_expectations_exclude_each_other():
    """SpecForge's qwen3-8b recipe: --expect-non-reasoning --strict-think-markers (recipe_flags(False))."""
    plain = turns({"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": " "})
    assert recipe_flags(False) == {
        "expect_reasoning": False,
        "expect_non_reasoning": True,
        "strict_think_markers": True,
    }
    assert flags_text(False) == "--expect-non-reasoning --strict-think-markers"
    assert flags_text(True) == "--expect-reasoning --strict-think-markers"
    assert row_problem(plain, **recipe_flags(False)) is None  # blank reasoning is no reasoning
    assert row_problem(GOOD, **recipe_flags(False)) == "assistant message 2 has non-empty reasoning_content"
    assert row_problem(plain, **recipe_flags(True)) == "assistant message 1 has empty reasoning_content"
    with pytest.raises(ValueError, match="mutually exclusive"):
        row_problem(GOOD, expect_reasoning=True, expect_non_reasoning=True)


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


def generate_source(url: str, records: list[dict], data, config: GenerationSettings, token_ids: bool = False):
    """`records` as a JSONL source beside `data`, its one prompt shard built and generated under `config`."""
    src = data.parent / f"{data.name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    kwargs = {"enable_thinking": config.enable_thinking}

    async def go():
        async with connected([url]) as fleet:
            await build_prompt_shard(src, 0, "00000", 100, data, fleet, kwargs)
            settings = DispatchSettings(load_sample_s=0, store_token_ids=token_ids)
            await generate_shard(data, "00000", fleet, config, settings, log=lambda m: None)

    asyncio.run(go())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tests.support.forks import start_emulator

    tmp = tmp_path_factory.mktemp("roundtrip")
    args = ["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "50000", "--length-median", "150"]
    with start_emulator(args) as emu:
        generate_source(emu.url, SOURCE, tmp / "data", GenerationSettings(max_output_tokens=8192))
    return (
        tmp,
        export_training_set(tmp / "data", tmp / "out", max_length=None, form="conversations"),
        export_training_set(tmp / "data", tmp / "out_messages", max_length=None, form="messages"),
    )


def test_every_exported_row_passes_the_trainer_rules_with_reasoning_and_strict_markers(exported):
    _, export, _ = exported
    rows = [json.loads(line) for line in export.jsonl_path.read_text().splitlines()]
    assert len(rows) == export.manifest["rows"] >= len(SOURCE) - 2  # a few may be cut at the cap
    assert [(r["id"], row_problem(r, expect_reasoning=True, strict_think_markers=True)) for r in rows] == [
        (r["id"], None) for r in rows
    ]
    assert {r["status"] for r in rows} == {"success"}
    # regenerate auto: the source has a multi-turn prompt, so every turn of it is the target's, with its reasoning
    multi = next(r for r in rows if r["id"].startswith("multi@"))
    roles = [m["role"] for m in multi["conversations"]]
    assert roles == ["user", "assistant", "user", "assistant"]
    answers = [m for m in multi["conversations"] if m["role"] == "assistant"]
    assert all(m["reasoning_content"].strip() for m in answers)
    assert {m["content"] for m in answers}.isdisjoint({"Striping with parity.", "An old answer, regenerated."})
    assert export.manifest["recipe"]["flags"] == "--expect-reasoning --strict-think-markers"
    assert export.manifest["source_answers"]["rows"] == 0


# A ShareGPT source of multi-turn prompts (the form SpecForge's regeneration reads), some ending with the source's
# own answer, beside single-turn ones: what each regenerate mode and thinking setting exports, in every form.
SHAREGPT = [
    {
        "id": f"chat{i}",
        "conversations": [
            turn
            for k in range(1, 2 + i % 3)
            for turn in (
                {"from": "human", "value": f"Chat {i}, question {k}: why does step {k} of topic {i} hold?"},
                {"from": "gpt", "value": f"The source's own answer {k} of chat {i}."},
            )
        ][: None if i % 2 else -1],
    }
    for i in range(10)
] + [{"id": f"one{i}", "conversations": [{"from": "human", "value": f"Single question {i}."}]} for i in range(4)]
SOURCE_ANSWERS = {m["value"] for r in SHAREGPT for m in r["conversations"] if m["from"] == "gpt"}
WITH_HISTORY = sum(1 for r in SHAREGPT if sum(m["from"] == "human" for m in r["conversations"]) > 1)
MODES = [("auto", True), ("auto", False), ("last_turn", True), ("last_turn", False)]


@pytest.fixture(scope="module")
def modes(tmp_path_factory):
    """The ShareGPT source generated under each (regenerate, enable_thinking), exported in the three forms."""
    from tests.support.forks import start_emulator

    tmp = tmp_path_factory.mktemp("modes")
    args = ["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "50000", "--length-median", "120"]
    out = {}
    with start_emulator(args) as emu:
        for regenerate, thinking in MODES:
            data = tmp / f"{regenerate}-{thinking}"
            config = GenerationSettings(max_output_tokens=8192, regenerate=regenerate, enable_thinking=thinking)
            generate_source(emu.url, SHAREGPT, data, config, token_ids=True)
            forms = ("conversations", "messages", "pretokenized")
            out[regenerate, thinking] = (
                data,
                {
                    form: export_training_set(data, data.parent / f"{data.name}-{form}", max_length=None, form=form)
                    for form in forms
                },
            )
    return out


def lines(export) -> list[dict]:
    return [json.loads(line) for line in export.jsonl_path.read_text().splitlines()]


@pytest.mark.parametrize("regenerate,thinking", MODES)
def test_every_row_of_every_form_and_mode_passes_the_recipes_own_validation(modes, regenerate, thinking):
    """--expect-reasoning --strict-think-markers with thinking, --expect-non-reasoning --strict-think-markers without:
    a row that could not pass is left out with the validator's words in the manifest, never written."""
    data, exports = modes[regenerate, thinking]
    flags = recipe_flags(thinking)
    conversations, messages = lines(exports["conversations"]), lines(exports["messages"])
    assert conversations and [r["id"] for r in messages] == [r["id"] for r in conversations]
    for row in conversations:
        assert row_problem(row, **flags) is None, row["id"]
    for row in messages:  # the OpenAI form: the same conversation under another key
        assert row_problem({"id": row["id"], "status": "success", "conversations": row["messages"]}, **flags) is None
    for form, export in exports.items():
        m = export.manifest
        assert m["rows"] == len(lines(export)) and m["excluded"]["recipe_validation"] == sum(
            m["recipe"].get("left_out", {}).values()
        )
        if form == "conversations":  # the file SpecForge validates (messages: no trainer's form, none)
            assert m["recipe"]["flags"] == flags_text(thinking)


def test_regenerate_auto_on_a_multi_turn_sharegpt_source_trains_only_on_the_fleets_answers(modes):
    """The defaults: every assistant message exported was generated by the fleet (a committed completion of this
    config, turn by turn), none is the source's, and every conversation is exported whole."""
    data, exports = modes["auto", True]
    committed = {
        (pid, turn): (content, reasoning)
        for pid, turn, content, reasoning in duckdb.sql(
            f"select prompt_id, turn, content, reasoning_content from read_parquet('{data}/completions/**/*.parquet')"
        ).fetchall()
    }
    assert {turn for _, turn in committed} >= {1, 2, 3}  # all_turns: a row per assistant turn
    rows = lines(exports["conversations"])
    assert exports["conversations"].manifest["excluded"]["recipe_validation"] == 0
    assert len(rows) + exports["conversations"].manifest["conversations_not_whole"] == len(SHAREGPT)
    for row in rows:
        pid = row["id"].split("@")[0]
        source = next(r for r in SHAREGPT if r["id"] == pid)["conversations"]
        answers = [m for m in row["conversations"] if m["role"] == "assistant"]
        assert len(answers) == sum(m["from"] == "human" for m in source)  # a regenerated answer per user turn
        for k, m in enumerate(answers, start=1):
            assert (m["content"], m["reasoning_content"]) == committed[pid, k], (pid, k)
            assert m["content"] not in SOURCE_ANSWERS
    assert exports["conversations"].manifest["source_answers"]["rows"] == 0


def test_last_turn_on_the_same_source_counts_the_rows_that_keep_the_sources_answers(modes):
    """last_turn keeps the source's earlier answers. With thinking they have no reasoning, so the recipe's
    --expect-reasoning refuses them: left out and counted. Without thinking they are written, counted, and the
    manifest says to set SpecForge's data.train_only_last_turn. The pre-tokenized form gives that history loss 0."""
    _, thinking = modes["last_turn", True]
    m = thinking["conversations"].manifest
    assert m["source_answers"] | {"note": ""} == {
        "rows": WITH_HISTORY,
        "written": 0,
        "left_out": WITH_HISTORY,
        "train_only_last_turn": False,
        "note": "",
    }
    assert m["excluded"]["recipe_validation"] == WITH_HISTORY
    assert set(m["recipe"]["left_out"]) == {"assistant message 1 has empty reasoning_content"}
    assert not any(
        r["id"].startswith("chat") and "@" in r["id"] and len(r["conversations"]) > 2
        for r in lines(thinking["conversations"])
    )

    _, plain = modes["last_turn", False]
    m = plain["conversations"].manifest
    assert (m["source_answers"]["rows"], m["source_answers"]["written"]) == (WITH_HISTORY, WITH_HISTORY)
    assert m["source_answers"]["train_only_last_turn"] is True
    said = "\n".join(exclusion_lines(m))
    assert f"{WITH_HISTORY} rows keep the source's own earlier answers" in said
    assert "set data.train_only_last_turn: true" in said
    kept = [r for r in lines(plain["conversations"]) if len(r["conversations"]) > 2]
    assert len(kept) == WITH_HISTORY
    assert all(r["conversations"][1]["content"] in SOURCE_ANSWERS for r in kept)  # the history is the source's

    data, exports = modes["last_turn", True]
    ids = {
        f"{pid}@{h}": (len(p), len(o))
        for pid, h, p, o in duckdb.sql(
            f"select prompt_id, config_hash, prompt_token_ids, output_ids "
            f"from read_parquet('{data}/completions/**/*.parquet')"
        ).fetchall()
    }
    samples = lines(exports["pretokenized"])
    assert exports["pretokenized"].manifest["source_answers"]["written"] == WITH_HISTORY  # written, history loss 0
    for sample in samples:
        prompt, output = ids[sample["id"]]
        assert sample["loss_mask"] == [0] * prompt + [1] * output, sample["id"]


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
        ValueError, match="export form must be one of conversations, per_turn, messages, pretokenized, got 'sharegpt'"
    ):
        export_training_set(exported[0] / "data", exported[0] / "bad", form="sharegpt")


def test_the_trained_tokens_plan_says_what_all_turns_costs_against_last_turn_on_the_measured_lengths(modes):
    from dflash_assets.quality.planning.window_plan import window_plan, window_plan_lines

    measured = {}
    for regenerate in ("auto", "last_turn"):
        data, _ = modes[regenerate, True]
        rows = duckdb.sql(
            f"select config_hash, prompt_id, turn, completion_tokens from "
            f"read_parquet('{data}/completions/**/*.parquet', union_by_name = true)"
        ).fetchall()
        plan = window_plan(data, rows[0][0], 8192, tokens_per_s=1000.0, servers=2)
        measured[regenerate] = plan.turns, rows, window_plan_lines(plan)
    cost, rows, said = measured["auto"]
    user_turns = {r["id"]: sum(m["from"] == "human" for m in r["conversations"]) for r in SHAREGPT}
    last = sum(n for _, pid, turn, n in rows if turn == user_turns[pid])  # each conversation's final answer
    assert (cost.mode, cost.conversations, cost.basis) == ("all_turns", len(SHAREGPT), "rows")
    assert (cost.all_turns, cost.last_turn) == (sum(r[3] for r in rows), last) and cost.all_turns > 1.5 * last
    hours = cost.all_turns / 1000 / 3600 * 2
    assert f"all_turns decodes {cost.all_turns:,} tokens ({hours:,.1f} GPU-h), last_turn {last:,}" in "\n".join(said)
    cost, rows, said = measured["last_turn"]
    decoded, earlier = sum(r[3] for r in rows), sum(user_turns[pid] - 1 for _, pid, _, _ in rows)
    assert (cost.mode, cost.basis, cost.last_turn) == ("last_turn", "model", decoded)
    assert cost.all_turns == pytest.approx(decoded + decoded / len(rows) * earlier)
    assert any("the mean answer for the turns not generated" in line for line in said)
