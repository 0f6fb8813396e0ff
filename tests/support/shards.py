"""A shard on an emulated fleet, without Dagster: its prompts written, built, generated, continued, read back.

The data dir is `data_dir`; its prompt source is written beside it (`data_dir.parent / "prompts.jsonl"`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import duckdb

from dflash_assets.fleet.fleet import on_fleet
from dflash_assets.generation.continuation import continue_shard
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.settings import DispatchSettings, GenerationSettings

SHARD = "00000"
# instant decode, the reasoning split on: a shard of 40 prompts is generated in well under a second
FAST = ["--decode-tokens-per-s", "0", "--reasoning-parser", "qwen3"]
# token ids stored (for continuing), small commits, no load sampling between commits
SETTINGS = DispatchSettings(store_token_ids=True, commit_rows=8, commit_seconds=0.2, load_sample_s=0)
# short answers (about 60 tokens), metrics on
SHORT = ["--reasoning-parser", "qwen3", "--enable-metrics", "--length-median", "60", "--length-sigma", "0.2"]
FEW_RETRIES = DispatchSettings(max_attempts=3, backoff_base_s=0.01)
N = 40
EXPLAIN = {f"c{i:03d}": f"Explain idea {i} step by step." for i in range(N)}  # the default prompts of a shard
COLUMNS = (
    "prompt_id, config_hash, finish_reason, prompt_tokens, completion_tokens, reasoning_tokens, "
    "max_output_tokens, content, reasoning_content, prompt_token_ids, output_ids"
)


def quiet(message: str) -> None:
    """A run's log, silenced."""


def numbered(texts: Iterable[str], prefix: str = "q") -> dict[str, str]:
    """{prompt_id: text} with ids q0, q1, ... in order."""
    return {f"{prefix}{i}": text for i, text in enumerate(texts)}


def questions(n: int, end: str = " in detail.") -> Iterator[dict]:
    """n prompt records p0000, p0001, ...: "Question i: explain topic (7i mod 13)" and `end`."""
    return ({"id": f"p{i:04d}", "prompt": f"Question {i}: explain topic {i * 7 % 13}{end}"} for i in range(n))


def write_prompts(path: Path, records: Iterable[dict], extra_lines: dict[int, str] | None = None) -> Path:
    """A JSONL prompt source of `records`, with the raw `extra_lines` inserted at their line index."""
    lines = [json.dumps(r) for r in records]
    for at, line in sorted((extra_lines or {}).items()):
        lines.insert(at, line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def make_shard(data_dir: Path, urls: list[str], prompts: dict[str, str] = EXPLAIN, api_key: str | None = None):
    """Shard 00000 of `prompts` ({id: text}) built on the fleet, thinking on; the build's figures."""
    src = write_prompts(Path(data_dir).parent / "prompts.jsonl", ({"id": k, "prompt": v} for k, v in prompts.items()))
    return on_fleet(
        urls, lambda f: build_prompt_shard(src, 0, SHARD, len(prompts), data_dir, f, {"enable_thinking": True}), api_key
    )


def generate(data_dir, urls: list[str], cap: int | GenerationSettings, settings: DispatchSettings = SETTINGS, **kw):
    """Generate shard 00000 at the fixed cap `cap` (or a whole GenerationSettings); `kw` go to generate_shard (log,
    policy)."""
    config = (
        cap if isinstance(cap, GenerationSettings) else GenerationSettings(max_output_tokens=cap, cap_policy="fixed")
    )
    kw.setdefault("log", quiet)
    return on_fleet(urls, lambda f: generate_shard(data_dir, SHARD, f, config, settings, **kw))


def cont(data_dir, urls: list[str], parent: str, cap: int, settings: DispatchSettings = SETTINGS, **kw):
    """Continue shard 00000's rows of config `parent` to `cap`."""
    kw.setdefault("log", quiet)
    return on_fleet(urls, lambda f: continue_shard(data_dir, SHARD, f, parent, cap, settings, **kw))


def cont_main(argv: list[str]) -> int:
    """`cont` as a process's main (forked by tests/support/forks.py): data dir, server URL, parent config, cap; a
    commit per row, so a kill -9 lands between commits."""
    data_dir, url, parent, cap = argv
    cont(Path(data_dir), [url], parent, int(cap), DispatchSettings(commit_rows=1, commit_seconds=0.05, load_sample_s=0))
    return 0


def kill_mid_continuation(data_dir, parent: str, cap: int, flags: list[str], log: Path, committed) -> None:
    """`cont_main` forked on an emulator of its own started with `flags`, killed -9 once `committed()` is true: every
    request still to come is held first, so the kill lands mid-continuation whatever the speed."""
    from tests.support.forks import Forked, start_emulator
    from tests.support.http import set_faults

    with start_emulator(flags) as slow:
        target = "tests.support.shards:cont_main"
        proc = Forked(
            target, [str(data_dir), slow.url, parent, str(cap)], dict(os.environ), None, log, log, session=True
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not committed():
            time.sleep(0.05)
        set_faults(slow.url, {"hold": True})
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def rows(data_dir, config_hash: str | None = None, columns: str = COLUMNS) -> list[tuple]:
    """The completion rows (of one config, or all), ordered by prompt_id."""
    where = f"config_hash = '{config_hash}'" if config_hash else "true"
    return duckdb.sql(
        f"select {columns} from read_parquet('{data_dir}/completions/**/*.parquet', union_by_name = "
        f"true) where {where} order by prompt_id"
    ).fetchall()


def longest_prompt(prompt_shards: Path, glob: str = "**/*.parquet") -> int:
    """The most prompt tokens of any prompt under a prompt_shards folder (the preflight and the probe size the
    cap from it)."""
    return duckdb.sql(f"select max(prompt_tokens) from read_parquet('{prompt_shards}/{glob}')").fetchall()[0][0]
