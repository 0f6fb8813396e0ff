"""Bad input never stops a shard and never goes unexplained: every line is a prompt or a reason."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_assets.generation.prompts import (
    LINE_STEP,
    Prompt,
    SourceError,
    SourceReject,
    _line_index,
    count_rows,
    read_shard,
    shard_fingerprint,
    shard_keys,
)
from dflash_assets.settings import GenerationSettings, SettingsError

GOOD = {"messages": [{"role": "user", "content": "hello"}]}

BAD_LINES = [
    ('{"messages": [', "invalid JSON"),
    ('"just a string"', "expected a JSON object, got str"),
    ('{"text": "x"}', "none of 'messages', 'conversations', 'prompt' or 'custom_id' + 'body' is present"),
    ('{"messages": []}', "'messages' is empty"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "unknown role 'wizard'"),
    ('{"messages": [{"role": "user", "content": 7}]}', "content must be a string, got int"),
    ('{"messages": [{"role": "user", "content": "  "}]}', "content is empty"),
    (
        '{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}',
        "the conversation starts with the assistant (message 0)",
    ),
    ('{"prompt": "nul \\u0000 inside"}', "contains a NUL byte"),
    ('{"prompt": 5}', "'prompt' must be a string, got int"),
]


def write_jsonl(path, lines: list[str | bytes]) -> None:
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")


@pytest.mark.parametrize("line,reason", BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_bad_line_is_rejected_with_its_reason_and_the_rest_goes_on(tmp_path, line, reason):
    src = tmp_path / "p.jsonl"
    write_jsonl(src, [json.dumps(GOOD | {"id": "a"}), line, json.dumps(GOOD | {"id": "b"})])
    items = list(read_shard(src, 0, 10))
    assert [type(i) for i in items] == [Prompt, SourceReject, Prompt]
    assert items[1].line == 2
    assert reason in items[1].reason and items[1].reason.startswith("line 2: ")


def test_invalid_utf8_is_rejected_naming_the_byte(tmp_path):
    src = tmp_path / "p.jsonl"
    write_jsonl(src, [b'{"prompt": "caf\xe9"}', json.dumps(GOOD).encode()])
    items = list(read_shard(src, 0, 10))
    assert items[0].reason == "line 1: invalid UTF-8 at byte 15"
    assert isinstance(items[1], Prompt)


def test_duplicate_id_within_the_source_is_rejected_naming_the_first_line(tmp_path):
    src = tmp_path / "p.jsonl"
    write_jsonl(src, [json.dumps(GOOD | {"id": "x"}), json.dumps(GOOD | {"id": "y"}), json.dumps(GOOD | {"id": "x"})])
    items = list(read_shard(src, 0, 10))
    assert items[2].reason == "line 3: duplicate id 'x' (first seen on line 1)"


def test_prompt_id_is_the_given_id_else_a_stable_content_hash(tmp_path):
    src = tmp_path / "p.jsonl"
    write_jsonl(src, [json.dumps({"id": 42, "prompt": "a"}), json.dumps({"prompt": "b"})])
    first, second = read_shard(src, 0, 10)
    again = list(read_shard(src, 0, 10))[1]
    assert first.prompt_id == "42"
    assert len(second.prompt_id) == 16 and second.prompt_id == again.prompt_id
    assert second.messages == [{"role": "user", "content": "b"}]


def test_shards_are_fixed_line_ranges_and_lines_add_up(tmp_path):
    src = tmp_path / "p.jsonl"
    write_jsonl(src, [json.dumps({"id": i, "prompt": f"p{i}"}) for i in range(23)] + ["{bad"])
    assert count_rows(src) == 24 and shard_keys(src, 10) == ["00000", "00001", "00002"]
    shards = [list(read_shard(src, i, 10)) for i in range(3)]
    assert [len(s) for s in shards] == [10, 10, 4]
    assert [p.prompt_id for p in shards[1]] == [str(i) for i in range(10, 20)]
    assert isinstance(shards[2][-1], SourceReject) and shards[2][-1].line == 24


def test_a_shard_is_read_from_the_source_line_index_which_is_read_once_and_again_when_the_file_changes(tmp_path):
    """Every shard starts near its own lines (the index of every LINE_STEP-th line), not by reading all lines
    before it; shards straddling the index's steps hold exactly their lines, and a rewritten source is indexed anew."""
    src = tmp_path / "p.jsonl"
    n, size = 3 * LINE_STEP + 5, 700  # shards of 700 lines cross the index's steps at different lines
    write_jsonl(src, [json.dumps({"id": f"l{i}", "prompt": f"p{i}"}) for i in range(n)])
    _line_index.cache_clear()
    shards = [list(read_shard(src, i, size)) for i in range(len(shard_keys(src, size)))]
    assert [p.prompt_id for s in shards for p in s] == [f"l{i}" for i in range(n)]
    assert [p.line for p in shards[3]] == list(range(2101, 2801))
    assert list(read_shard(src, 99, size)) == []  # past the end: no line
    assert _line_index.cache_info().misses == 1, "the source was indexed once for every shard"
    lines, _ = shard_fingerprint(src, 2, size)
    assert lines == size and _line_index.cache_info().misses == 1

    write_jsonl(src, [json.dumps({"id": f"m{i}", "prompt": f"q{i}"}) for i in range(n + 1)])
    assert [p.prompt_id for p in read_shard(src, 4, size)] == [f"m{i}" for i in range(2800, n + 1)]
    assert _line_index.cache_info().misses == 2


def test_parquet_source_with_messages_and_prompt_columns(tmp_path):
    src = tmp_path / "p.parquet"
    pq.write_table(
        pa.table(
            {
                "id": ["a", "b", None],
                "prompt": [None, "plain prompt", None],
                "messages": [[{"role": "user", "content": "hi"}], None, None],
            }
        ),
        src,
    )
    items = list(read_shard(src, 0, 10))
    assert [type(i) for i in items] == [Prompt, Prompt, SourceReject]
    assert items[1].messages == [{"role": "user", "content": "plain prompt"}]
    assert "none of 'messages', 'conversations', 'prompt'" in items[2].reason


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda d: d / "missing.jsonl", "does not exist"),
        (lambda d: (d / "empty.jsonl").write_bytes(b"") or d / "empty.jsonl", "is empty"),
        (lambda d: (d / "dir.jsonl").mkdir() or d / "dir.jsonl", "is not a file"),
        (
            lambda d: (d / "broken.parquet").write_bytes(b"PAR1 not really") and d / "broken.parquet",
            "is not a readable Parquet file",
        ),
        (
            lambda d: pq.write_table(pa.table({"text": ["x"]}), d / "cols.parquet") or d / "cols.parquet",
            "has none of the columns 'messages', 'conversations', 'prompt' or 'body' (columns: ['text'])",
        ),
        (lambda d: (d / "p.csv").write_text("a,b") and d / "p.csv", "unsupported format '.csv'"),
    ],
)
def test_a_bad_source_file_is_a_clear_error_naming_the_file(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(SourceError, match="prompt source") as err:
        list(read_shard(path, 0, 10))
    assert message in str(err.value) and str(path) in str(err.value)


def test_shard_size_must_be_positive(tmp_path):
    src = tmp_path / "p.jsonl"
    write_jsonl(src, [json.dumps(GOOD)])
    with pytest.raises(SourceError, match="shard size must be a positive integer, got 0"):
        shard_keys(src, 0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_output_tokens": 0}, "max_output_tokens must be a positive integer, got 0"),
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ],
)
def test_bad_generation_config_is_refused_before_any_work(kwargs, message):
    with pytest.raises(SettingsError) as err:
        GenerationSettings(**kwargs)
    assert message in str(err.value)


def test_config_hash_covers_what_changes_the_output():
    base = GenerationSettings(regenerate="last_turn")
    assert base.config_hash("m") == GenerationSettings(regenerate="last_turn").config_hash("m")
    assert base.config_hash("m") != base.model_copy(update={"max_output_tokens": 8192}).config_hash("m")
    assert base.config_hash("m") != base.model_copy(update={"enable_thinking": False}).config_hash("m")
    assert base.config_hash("m") != base.config_hash("other-model")


def test_a_range_of_prompt_shards_is_built_on_one_connection_and_a_shard_past_the_end_fails_naming_it(tmp_path):
    """A backfill run of prompt_shards connects once (a connect waits for every server's /health, >= 1 s on
    SGLang 0.5.23); the shards before one past the end of the source are built, then the run fails naming it."""
    import dagster as dg
    import duckdb

    from dflash_assets.defs.partitions import shard_partitions
    from dflash_assets.defs.prompts.assets import prompt_shards
    from dflash_assets.defs.resources import DataDirResource, FleetResource, PromptSourceResource
    from tests.support import dagster_run
    from tests.support.forks import start_emulator
    from tests.support.http import Http

    def healths(url: str) -> dict[str, int]:
        return {k: n for k, n in Http(url).get("/_emulator/routes")[1].items() if k.startswith("GET /health ")}

    src = tmp_path / "prompts.jsonl"
    write_jsonl(src, [json.dumps({"prompt": f"question {i}"}) for i in range(5)])  # shards of 2: 00000-00002
    keys = ["00000", "00001", "00002", "00003"]
    with start_emulator([]) as emu, dagster_run.instance() as instance:
        instance.add_dynamic_partitions(shard_partitions.name, keys)
        job = dg.Definitions(
            assets=[prompt_shards],
            resources={
                "fleet": FleetResource(mode="attach", urls=emu.url),
                "data_dir": DataDirResource(path=str(tmp_path / "data")),
                "prompt_source": PromptSourceResource(path=str(src), shard_size=2),
            },
        ).resolve_implicit_global_asset_job_def()
        before = healths(emu.url)  # start_emulator's own readiness probes
        result = job.execute_in_process(
            instance=instance,
            raise_on_error=False,
            tags={"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]},
        )
        health = {k: n - before.get(k, 0) for k, n in healths(emu.url).items()}
    assert not result.success
    failure = result.failure_data_for_node("prompt_shards").user_failure_data
    assert failure.description == f"shard 00003 is past the end of {src}: it has no lines"
    # a failed step records no materialisation, but the shards before the end are built (a re-run reuses them)
    built = duckdb.sql(
        f"SELECT shard, count(*) FROM read_parquet('{tmp_path}/data/prompt_shards/**/*.parquet') "
        f"GROUP BY shard ORDER BY shard"
    ).fetchall()
    assert built == [("00000", 2), ("00001", 2), ("00002", 1)]
    assert sum(health.values()) == 1, health  # one connect for the four shards


def test_a_source_without_history_is_scanned_once_for_the_whole_count_and_for_auto(tmp_path):
    """The terminal's count (every prompt) and regenerate auto's check (the first prompt with history) share one scan
    when no prompt has history: it read the whole source already."""
    from dflash_assets.generation.prompts import _source_turns, source_turns

    history = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] + GOOD["messages"]}
    plain, mixed = tmp_path / "plain.jsonl", tmp_path / "mixed.jsonl"
    write_jsonl(plain, [json.dumps(GOOD | {"id": f"p{i}"}) for i in range(5)])
    write_jsonl(
        mixed, [json.dumps(GOOD | {"id": "p0"}), json.dumps(history | {"id": "h1"}), json.dumps(GOOD | {"id": "p2"})]
    )
    _source_turns.cache_clear()
    whole, first = source_turns(plain), source_turns(plain, first_only=True)
    assert whole == first and (whole.prompts, whole.with_history, whole.complete) == (5, 0, True)
    assert _source_turns.cache_info().currsize == 1
    _source_turns.cache_clear()
    first, whole = source_turns(mixed, first_only=True), source_turns(mixed)
    assert (first.prompts, first.with_history, first.complete) == (2, 1, False)
    assert (whole.prompts, whole.with_history, whole.complete) == (3, 1, True)
    assert _source_turns.cache_info().currsize == 2
