"""Exactly-once under kill -9: the generating process is SIGKILLed at random moments, then resumed."""

import asyncio
import json
import os
import random
import signal
import time

import duckdb
import pytest

from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.shards import build_prompt_shard
from tests.support.cli import Command, start
from tests.support.waiting import wait_for

PROMPTS = 160


@pytest.fixture(scope="module")
def fleet_args():
    # slow enough that a run lasts a few seconds, so kills land mid-run
    return ["--decode-tokens-per-s", "4000", "--max-running-requests", "8", "--reasoning-parser", "qwen3"]


def build_shard(tmp_path, urls) -> None:
    tmp_path.mkdir(exist_ok=True)
    src = tmp_path / "prompts.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"k{i:04d}", "prompt": f"Resume test prompt {i}."}) + "\n" for i in range(PROMPTS))
    )

    async def go():
        async with connected(urls) as fleet:
            await build_prompt_shard(src, 0, "00000", PROMPTS, tmp_path / "data", fleet, {"enable_thinking": True})

    asyncio.run(go())


def generate(tmp_path, urls, run: str) -> Command:
    """`dflash generate` of the shard in a process of its own (tests/support/cli.py), its output in tmp_path/run."""
    return start(
        "generate",
        "--shard",
        "00000",
        "--urls",
        ",".join(urls),
        "--data-dir",
        str(tmp_path / "data"),
        "--max-output-tokens",
        "2048",
        "--commit-rows",
        "4",
        "--commit-seconds",
        "0.2",
        out=tmp_path / run,
    )


def rows(tmp_path) -> list[tuple]:
    if not list((tmp_path / "data" / "completions").glob("**/*.parquet")):
        return []  # killed before the first commit
    return duckdb.sql(
        f"select prompt_id, content, completion_tokens from read_parquet("
        f"'{tmp_path}/data/completions/**/*.parquet') order by prompt_id"
    ).fetchall()


def test_kill_9_at_random_moments_loses_nothing_and_duplicates_nothing(tmp_path, fleet_urls):
    build_shard(tmp_path, fleet_urls)
    rng = random.Random(7)
    committed = [0]
    for kill in range(4):
        proc = generate(tmp_path, fleet_urls, f"kill{kill}.txt")

        # every kill lands after this process has committed a part of its own (so it cuts into committed work,
        # not only into start-up), at a random moment after that commit
        def own_part(proc=proc, kill=kill) -> bool:
            assert proc.poll() is None, (tmp_path / f"kill{kill}.txt").read_text()
            return len(rows(tmp_path)) > committed[-1]

        wait_for(f"run {kill} to commit a part of its own", own_part, 120, every_s=0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        assert proc.poll() is None, "the run finished before the kill: nothing was interrupted"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        ids = [r[0] for r in rows(tmp_path)]
        assert len(ids) == len(set(ids)), "a kill -9 left duplicate rows"
        committed.append(len(ids))
    assert committed == sorted(set(committed)), f"each run committed rows before its kill, none lost: {committed}"
    assert committed[-1] < PROMPTS, "the kills interrupted the work"
    final = generate(tmp_path, fleet_urls, "final.txt")
    assert final.wait(timeout=120) == 0, (tmp_path / "final.txt").read_text()
    out = (tmp_path / "final.txt").read_text()
    assert f"{PROMPTS} prompts = {PROMPTS} completed + 0 rejected + 0 failed" in out

    clean = tmp_path / "clean"
    build_shard(clean, fleet_urls)
    assert generate(clean, fleet_urls, "clean.txt").wait(timeout=120) == 0, (clean / "clean.txt").read_text()
    resumed, fresh = rows(tmp_path), rows(clean)
    assert [r[0] for r in resumed] == sorted(f"k{i:04d}" for i in range(PROMPTS))
    assert resumed == fresh, "the resumed set equals a clean run's, row for row"
    leftovers = [
        p.name for p in (tmp_path / "data" / "completions" / "shard=00000").iterdir() if p.name.endswith(".tmp")
    ]
    assert leftovers == [], "torn temporary files are cleaned"
