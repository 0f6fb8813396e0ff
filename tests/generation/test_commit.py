"""A shard's results on their way to Parquet (generation/commit.py): what a commit writes and counts, and what closing
the shard leaves behind. Real PartStores in a temporary data dir, read back with DuckDB."""

import asyncio
from datetime import UTC, datetime

import duckdb

from dflash_assets.generation.commit import ShardOutput, generated_tokens
from dflash_assets.generation.plan import ShardResult
from dflash_assets.rules import RUNAWAY_FINISH
from dflash_assets.store.schema import COMPLETION_SCHEMA, CompletionRow, FailureRow, RejectRow
from dflash_assets.store.stores import completion_store, failure_store, reject_store

SHARD, CONFIG = "00000", "c0ffee000000"
NOW = datetime(2026, 12, 3, tzinfo=UTC)


def row(prompt_id: str, finish_reason: str = "stop", tokens: int = 10, reused: int | None = None) -> CompletionRow:
    columns = dict.fromkeys(COMPLETION_SCHEMA.names) | {"source": "demo", "max_output_tokens": 64, "attempt": 1}
    return CompletionRow.of(
        columns
        | {
            "prompt_id": prompt_id,
            "shard": SHARD,
            "config_hash": CONFIG,
            "finish_reason": finish_reason,
            "prompt_tokens": 5,
            "completion_tokens": tokens,
            "tokens_reused": reused,
            "created_at": NOW,
        }
    )


def reject(prompt_id: str, stage: str) -> RejectRow:
    return RejectRow(
        shard=SHARD,
        stage=stage,
        line=1,
        prompt_id=prompt_id,
        config_hash=CONFIG,
        reason="too long",
        prompt_tokens=None,
        max_output_tokens=None,
        server_context_length=None,
        created_at=NOW,
    )


def failure(prompt_id: str) -> FailureRow:
    return FailureRow(
        shard=SHARD, prompt_id=prompt_id, config_hash=CONFIG, error="HTTP 503", attempts=4, created_at=NOW
    )


def output(data_dir) -> ShardOutput:
    return ShardOutput(
        ShardResult(SHARD, CONFIG, "emulated/qwen3-27b"),
        completion_store(data_dir, SHARD),
        reject_store(data_dir, SHARD, "server"),
        reject_store(data_dir, SHARD, "preflight"),
        failure_store(data_dir, SHARD),
        f"{CONFIG}.parquet",
    )


def table(data_dir, name: str) -> list[tuple]:
    files = sorted(str(p) for p in (data_dir / name).rglob("*.parquet"))
    return duckdb.sql(f"select prompt_id from read_parquet({files}) order by 1").fetchall() if files else []


def test_a_commit_writes_the_rows_and_refusals_held_and_counts_them_for_the_shard(tmp_path):
    out = output(tmp_path)
    out.rows = [row("a", "length", 30), row("b", RUNAWAY_FINISH, 20), row("c", "stop", 40, reused=15)]
    out.refused = [reject("d", "server"), reject("e", "preflight")]
    assert out.pending == 5
    asyncio.run(out.commit())
    assert out.pending == 0
    run = out.run
    assert (run.length, run.runaways_stopped, run.rejected_server, run.rejected_preflight) == (1, 1, 1, 1)
    assert run.output_tokens == 30 + 20 + (40 - 15)  # a continued row counts only what was generated anew
    assert generated_tokens(row("x", tokens=40, reused=15)) == 25
    assert table(tmp_path, "completions") == [("a",), ("b",), ("c",)]
    assert table(tmp_path / "rejects" / f"shard={SHARD}", "stage=server") == [("d",)]
    assert table(tmp_path / "rejects" / f"shard={SHARD}", "stage=preflight") == [("e",)]
    asyncio.run(out.commit())  # nothing held: nothing written, nothing counted twice
    assert (run.length, len(list((tmp_path / "completions").rglob("*.parquet")))) == (1, 1)


def test_closing_a_shard_compacts_its_parts_and_replaces_its_failure_file(tmp_path):
    out = output(tmp_path)
    for batch in (["a", "b"], ["c"], ["d"]):  # three commits: three parts
        out.rows = [row(p) for p in batch]
        asyncio.run(out.commit())
    parts = sorted(p.name for p in (tmp_path / "completions").rglob("*.parquet"))
    out.failed = [failure("e")]
    out.close()
    after = sorted(p.name for p in (tmp_path / "completions").rglob("*.parquet"))
    assert len(parts) == 3 and len(after) == 1 and after[0].startswith("compact-"), after
    assert table(tmp_path, "completions") == [("a",), ("b",), ("c",), ("d",)]
    assert table(tmp_path, "failures") == [("e",)] and out.run.failed == 1
    # the next run of the config retried the failure: its failure file is replaced by nothing, so it is gone
    again = output(tmp_path)
    again.close()
    assert table(tmp_path, "failures") == [] and again.run.failed == 0


def test_a_shard_is_finished_when_everything_was_sent_and_nothing_is_in_flight(tmp_path):
    out = output(tmp_path)
    out.sent(10.0)
    out.sent(11.0)
    out.done(12.0, all_sent=False)
    out.close_sending(13.0)  # the stream moved past the shard: one is still in flight
    assert (out.run.first_sent_at, out.run.last_sent_at, out.run.finished_at) == (10.0, 13.0, None)
    out.done(15.0, all_sent=True)
    assert (out.in_flight, out.run.answered_at, out.run.finished_at, out.run.elapsed_s) == (0, 15.0, 15.0, 5.0)
