"""Rejects never stop the good rows: a shard whose every line was rejected is a built shard of zero prompts, done
once built, and the rest of the run goes on; a source with no good line at all is refused in one line, exit 2, before
any run starts."""

import json

import duckdb
import pytest

from tests.support.cli import dflash, home
from tests.support.shards import FAST


def test_a_shard_of_rejected_lines_only_is_done_with_zero_prompts_and_the_good_rows_are_committed(tmp_path):
    good = [json.dumps({"id": f"g{i}", "prompt": f"good question {i}"}) for i in range(6)]
    bad = ["", '{"id": "b1", "prompt": "unterminated', json.dumps({"id": "b2", "prompt": ""})]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(good[:3] + bad + good[3:]) + "\n")
    env = home(tmp_path, "home") | {"DFLASH_EMULATOR_ARGS": " ".join(FAST)}
    result = dflash("demo", "--prompts", str(src), "--shard-size", "3", "--servers", "1", env=env, cwd=tmp_path)
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    data = env["DFLASH_DATA_DIR"]
    ids = duckdb.sql(f"select prompt_id from read_parquet('{data}/completions/**/*.parquet') order by 1").fetchall()
    assert [i for (i,) in ids] == [f"g{i}" for i in range(6)], said
    [(rejected,)] = duckdb.sql(f"select count(*) from read_parquet('{data}/rejects/**/*.parquet')").fetchall()
    assert rejected == 3, said


@pytest.mark.parametrize(
    "content,first",
    [
        (b"\n\n   \n\n", "line 1: "),
        (bytes(range(256)) * 8 + b"\n\xff\xfe\x00garbage\n", "line 1: "),
    ],
    ids=["blank", "binary"],
)
def test_a_source_without_a_single_prompt_is_refused_in_one_line_before_any_run(tmp_path, content, first):
    src = tmp_path / "prompts.jsonl"
    src.write_bytes(content)
    env = home(tmp_path, "home")
    result = dflash("demo", "--prompts", str(src), env=env, cwd=tmp_path)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, lines
    assert f"dflash demo: prompt source {src.resolve()}: none of its " in lines[0], lines
    assert f"is a prompt (the first: {first}" in lines[0] and lines[0].endswith("file of prompts"), lines
    assert not (tmp_path / "home-data" / "prompt_shards").exists(), "nothing was written"


def test_bad_config_exits_2_in_one_line_a_url_with_credentials_unechoed_and_parquet_without_prompt_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "a question"}) + "\n")
    env = home(tmp_path, "home") | {"DFLASH_FLEET_MODE": "attach", "DFLASH_FLEET_URLS": "http://me:s3cret@127.0.0.1:9"}
    result = dflash("backfill", "--prompts", str(src), env=env, cwd=tmp_path)
    said = result.stdout + result.stderr
    lines = [line for line in said.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, said
    assert "dflash backfill: server URL #1 carries credentials" in lines[0] and "s3cret" not in said, said

    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"foo": [1, 2], "bar": ["a", "b"]}), wrong)
    result = dflash("demo", "--prompts", str(wrong), env=home(tmp_path, "other"), cwd=tmp_path)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, lines
    assert "Parquet file has none of the columns 'messages', 'conversations', 'prompt' or 'body'" in lines[0], lines
