"""The data people actually have: every common chat format reads as the same conversation, every malformed
turn is a reason naming its line, and a value that decodes but cannot be written back never kills a shard."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_assets.generation.prompts import (
    FieldMapping,
    Prompt,
    SourceReject,
    format_counts,
    last_turn_request,
    read_shard,
)

TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
]
SHAREGPT = [
    {"from": {"system": "system", "user": "human", "assistant": "gpt"}[t["role"]], "value": t["content"]} for t in TURNS
]

SAME_CONVERSATION = {
    "messages": {"id": "c1", "messages": TURNS},
    "conversations": {"id": "c1", "conversations": TURNS},
    "sharegpt": {"id": "c1", "conversations": SHAREGPT},
    "openai_batch": {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": TURNS},
    },
}


def write_jsonl(path, lines) -> None:
    with open(path, "wb") as f:
        for line in lines:
            f.write(
                (line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode())
                + b"\n"
            )


@pytest.mark.parametrize("fmt", list(SAME_CONVERSATION))
def test_each_chat_format_reads_as_the_same_conversation_and_is_named(tmp_path, fmt):
    src = tmp_path / "p.jsonl"
    write_jsonl(src, [SAME_CONVERSATION[fmt]])
    [prompt] = read_shard(src, 0, 10)
    assert isinstance(prompt, Prompt), prompt
    assert (prompt.prompt_id, prompt.messages, prompt.format) == ("c1", TURNS, fmt)
    # last_turn regenerates the final assistant turn, conditioned on everything before it
    assert prompt.request == TURNS[:4] and last_turn_request(TURNS[:4]) == TURNS[:4]


@pytest.mark.parametrize("speaker", ["human", "user", "gpt", "assistant", "chatgpt", "bing", "system"])
def test_every_sharegpt_speaker_maps_to_its_role(tmp_path, speaker):
    role = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant"}.get(speaker, speaker)
    turns = {
        "system": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}],
        "user": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, {"from": "user", "value": "q2"}],
    }.get(role, [{"from": "human", "value": "q"}, {"from": speaker, "value": "a"}])
    src = tmp_path / "p.jsonl"
    write_jsonl(src, [{"conversations": turns}])
    [prompt] = read_shard(src, 0, 10)
    assert role in [m["role"] for m in prompt.messages] and prompt.format == "sharegpt"


BAD_TURNS = [
    (
        {"conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]},
        "line 2: message 1 has unknown speaker 'robot' (expected one of ['assistant', 'bing', 'chatgpt', "
        "'function', 'function_call', 'gpt', 'human', 'observation', 'system', 'tool', 'user'])",
    ),
    (
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]},
        "line 2: message 1 content is empty",
    ),
    (
        {"conversations": [{"role": "user", "content": "q"}, {"role": "user", "content": "q again"}]},
        "line 2: alternation broken: message 1 is from the user again (message 0 was too)",
    ),
    (
        {"conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "q"}]},
        "line 2: the conversation starts with the assistant (message 0)",
    ),
    (
        {"conversations": [{"role": "user", "content": "q"}, {"from": "gpt", "value": "a"}]},
        "line 2: message 1 uses 'from'/'value' but message 0 uses 'role'/'content': mixed keys in one conversation",
    ),
    (
        {
            "conversations": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "system", "content": "late"},
            ]
        },
        "line 2: message 2 is a system message after the conversation started",
    ),
    (
        {"conversations": [{"role": "system", "content": "only"}]},
        "line 2: the conversation has only system messages, no user turn",
    ),
    ({"custom_id": "b1", "body": {"model": "m"}}, "line 2: 'body.messages' is missing or null"),
    ({"custom_id": "", "body": {"messages": TURNS}}, "line 2: custom_id is empty"),
    ({"id": True, "prompt": "x"}, "line 2: id must be a string or integer, got bool"),
    ({"conversations": "not a list"}, "line 2: 'conversations' must be a list, got str"),
]


@pytest.mark.parametrize("record,reason", BAD_TURNS, ids=[r.split(": ", 1)[1][:40] for _, r in BAD_TURNS])
def test_a_malformed_conversation_is_rejected_naming_its_line_and_the_rest_goes_on(tmp_path, record, reason):
    src = tmp_path / "p.jsonl"
    write_jsonl(src, [{"id": "a", "prompt": "x"}, record, {"id": "b", "conversations": SHAREGPT}])
    items = list(read_shard(src, 0, 10))
    assert [type(i) for i in items] == [Prompt, SourceReject, Prompt]
    assert items[1].reason == reason


# Values that JSON decodes but that cannot be written back (UTF-8 Parquet / JSON) or that Python will not decode:
# each was an exception that killed the whole shard.
UNWRITABLE = [
    (
        '{"id": "s1", "prompt": "broken emoji \\ud83d here"}',
        "line 2: 'prompt' holds a lone surrogate '\\ud83d' at character 13 (not valid Unicode)",
    ),
    (
        '{"id": "s2", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "\\udc00"}]}',
        "line 2: message 1 content holds a lone surrogate '\\udc00' at character 0 (not valid Unicode)",
    ),
    (
        '{"id": "lone \\ud800", "prompt": "x"}',
        "line 2: id holds a lone surrogate '\\ud800' at character 5 (not valid Unicode)",
    ),
    (
        '{"prompt": "x", "id": ' + "7" * 5000 + "}",
        "line 2: undecodable JSON: Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits",
    ),
    ("[" * 100_000 + "]" * 100_000, "line 2: undecodable JSON: nested too deeply"),
]


@pytest.mark.parametrize("line,reason", UNWRITABLE, ids=["prompt", "turn", "id", "huge-int", "deep"])
def test_a_value_that_decodes_but_cannot_be_written_back_rejects_only_its_line(tmp_path, line, reason):
    src = tmp_path / "p.jsonl"
    write_jsonl(src, [{"id": "a", "prompt": "x"}, line, {"id": "b", "prompt": "y"}])
    items = list(read_shard(src, 0, 10))
    assert [type(i) for i in items] == [Prompt, SourceReject, Prompt]
    assert items[1].reason == reason
    assert items[1].prompt_id == {"s1": "s1", "s2": "s2"}.get(line[8:10])  # an unwritable id is not kept
    items[1].reason.encode("utf-8")  # the reason itself can be written


def test_a_lone_surrogate_in_source_falls_back_to_the_file_name(tmp_path):
    src = tmp_path / "chat.jsonl"
    write_jsonl(src, ['{"id": "a", "prompt": "x", "source": "dump\\ud800"}'])
    [prompt] = read_shard(src, 0, 10)
    assert prompt.source == "chat"


def test_a_huggingface_parquet_export_reads_without_conversion(tmp_path):
    """datasets' to_parquet writes `conversations` as list<struct>; a ShareGPT one holds from/value."""
    src = tmp_path / "hf.parquet"
    struct = pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))
    pq.write_table(
        pa.table(
            {
                "id": ["h1", "h2"],
                "conversations": pa.array([SHAREGPT, [{"from": "gpt", "value": "first"}]], type=struct),
            }
        ),
        src,
    )
    first, second = read_shard(src, 0, 10)
    assert (first.messages, first.format) == (TURNS, "sharegpt")
    assert second.reason == "line 2: the conversation starts with the assistant (message 0)"

    messages = tmp_path / "hf_messages.parquet"
    pq.write_table(
        pa.table(
            {"messages": pa.array([TURNS], type=pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))}
        ),
        messages,
    )
    [prompt] = read_shard(messages, 0, 10)
    assert (prompt.messages, prompt.format) == (TURNS, "messages")


def test_an_explicit_mapping_reads_other_column_names(tmp_path):
    src = tmp_path / "odd.jsonl"
    write_jsonl(src, [{"uid": "u1", "dialog": SHAREGPT}, {"uid": "u2", "text": "no dialog"}])
    mapping = FieldMapping(id_field="uid", messages_field="dialog")
    first, second = read_shard(src, 0, 10, mapping)
    assert (first.prompt_id, first.messages, first.format) == ("u1", TURNS, "mapped")
    assert second.reason == "line 2: 'dialog' is missing or null" and second.prompt_id == "u2"


def test_a_mapped_parquet_column_that_does_not_exist_names_the_columns(tmp_path):
    from dflash_assets.generation.prompts import SourceError

    src = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"uid": ["u1"]}), src)
    with pytest.raises(SourceError, match=r"the mapped column\(s\) \['dialog'\] are not in the Parquet file"):
        list(read_shard(src, 0, 10, FieldMapping("uid", "dialog")))


def test_counts_add_up_and_formats_are_counted_per_shard(tmp_path):
    src = tmp_path / "mixed.jsonl"
    lines = [
        SAME_CONVERSATION[f] | ({"id": f"x{i}"} if f != "openai_batch" else {"custom_id": f"x{i}"})
        for i, f in enumerate(SAME_CONVERSATION)
    ]
    lines += [{"id": "p", "prompt": "q"}, record_bad := BAD_TURNS[0][0], '{"prompt": "\\ud800"}', "{broken"]
    write_jsonl(src, lines)
    items = list(read_shard(src, 0, 100))
    prompts = [i for i in items if isinstance(i, Prompt)]
    rejects = [i for i in items if isinstance(i, SourceReject)]
    assert len(items) == len(lines) == len(prompts) + len(rejects) == 8 and len(rejects) == 3
    assert format_counts(items) == {"conversations": 1, "messages": 1, "openai_batch": 1, "prompt": 1, "sharegpt": 1}
    assert [r.line for r in rejects] == [6, 7, 8] and record_bad


def test_a_lone_surrogate_line_no_longer_kills_prompt_shards(tmp_path, emulator):
    """Was: UnicodeEncodeError writing prompts.parquet, and none of the shard's prompts processed."""
    import asyncio

    import duckdb

    from dflash_assets.fleet.fleet import connected
    from dflash_assets.generation.shards import build_prompt_shard

    server = emulator("--reasoning-parser", "qwen3")
    src = tmp_path / "dump.jsonl"
    write_jsonl(
        src,
        [
            {"id": "a", "conversations": SHAREGPT},
            '{"id": "s", "prompt": "emoji \\ud83d cut"}',
            {"id": "b", "prompt": "fine"},
            '{"id": "t", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "\\udfff"}]}',
        ],
    )

    async def build():
        async with connected([server.emu.url]) as fleet:
            last_turn = await fleet.clients[0].count_prompt_tokens(TURNS[:4], {"enable_thinking": True})
            return last_turn, await build_prompt_shard(
                src, 0, "00000", 10, tmp_path / "data", fleet, {"enable_thinking": True}
            )

    last_turn, build = asyncio.run(build())
    assert (build.lines, build.prompts, build.rejected) == (4, 2, 2)
    assert build.formats == {"prompt": 1, "sharegpt": 1}
    rows = duckdb.sql(
        f"select prompt_id, prompt_tokens from read_parquet('{tmp_path}/data/prompt_shards/**/*.parquet')"
        " order by prompt_id"
    ).fetchall()
    assert rows[0] == ("a", last_turn)  # counted for the request last_turn sends: up to the last user turn
    reasons = duckdb.sql(
        f"select line, reason from read_parquet('{tmp_path}/data/rejects/**/*.parquet') order by line"
    ).fetchall()
    assert reasons == [
        (2, "line 2: 'prompt' holds a lone surrogate '\\ud83d' at character 6 (not valid Unicode)"),
        (4, "line 4: message 1 content holds a lone surrogate '\\udfff' at character 0 (not valid Unicode)"),
    ]
