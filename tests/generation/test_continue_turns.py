"""Continuing an all_turns config: a cut turn is continued by its token ids, then the turns after it are generated
in order on a history that holds the continued answer, keyed by (prompt_id, turn), exactly once under kill -9.

The emulator's stand-in model is autoregressive-consistent (an answer is a function of its request), so the
continued config must equal, turn for turn, a fresh all_turns run at the new cap."""

import json

import duckdb
import pytest

from dflash_assets.settings import GenerationSettings
from tests.generation.test_all_turns import conversation  # 3-turn conversations, a system turn in every other one
from tests.support.shards import SETTINGS, SHARD, cont, generate, kill_mid_continuation, on_fleet

CONVERSATIONS = 24
PARENT_CAP, NEW_CAP = 300, 1500
ARGS = ["--reasoning-parser", "qwen3", "--length-median", "260", "--length-sigma", "0.5"]
COLUMNS = (
    "prompt_id, turn, turns, config_hash, finish_reason, prompt_tokens, completion_tokens, reasoning_tokens, "
    "max_output_tokens, content, reasoning_content, prompt_token_ids, output_ids"
)


@pytest.fixture(scope="module")
def fleet_args():
    return ["--decode-tokens-per-s", "0", *ARGS]


def build(data_dir, urls) -> None:
    from dflash_assets.generation.shards import build_prompt_shard

    src = data_dir.parent / "prompts.jsonl"
    data_dir.mkdir(parents=True, exist_ok=True)
    src.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(CONVERSATIONS)))
    on_fleet(urls, lambda f: build_prompt_shard(src, 0, SHARD, CONVERSATIONS, data_dir, f, {"enable_thinking": True}))


def all_turns(cap: int) -> GenerationSettings:
    return GenerationSettings(max_output_tokens=cap, regenerate="all_turns")


def rows(data_dir, config_hash: str, columns: str = COLUMNS) -> list[tuple]:
    return duckdb.sql(
        f"select {columns} from read_parquet('{data_dir}/completions/**/*.parquet', union_by_name = true) "
        f"where config_hash = '{config_hash}' order by prompt_id, turn"
    ).fetchall()


@pytest.fixture(scope="module")
def continued(tmp_path_factory, fleet_urls):
    """A shard generated all_turns at a small cap and continued to a larger one; the same shard generated fresh."""
    a, b = tmp_path_factory.mktemp("continued") / "data", tmp_path_factory.mktemp("fresh") / "data"
    build(a, fleet_urls)
    build(b, fleet_urls)
    parent = generate(a, fleet_urls, all_turns(PARENT_CAP))
    run = cont(a, fleet_urls, parent.config_hash, NEW_CAP)
    fresh = generate(b, fleet_urls, all_turns(NEW_CAP))
    return a, b, parent, run, fresh


def test_cut_turns_are_continued_and_the_turns_after_them_generated_as_a_fresh_run_would(continued):
    a, b, parent, run, fresh = continued
    assert run.config_hash == fresh.config_hash, "the continued config is the new cap's all_turns config"
    cut = [r for r in rows(a, parent.config_hash, "prompt_id, turn, finish_reason") if r[2] == "length"]
    before = [r for r in cut if r[1] < 3]  # a cut before the last turn: the turns after it were never generated
    assert run.continued == len(cut) > 0 and len(before) > 0 and run.regenerated > 0
    mine, theirs = rows(a, run.config_hash), rows(b, fresh.config_hash)
    assert [r[:2] for r in mine] == [r[:2] for r in theirs], "every (prompt_id, turn) of a fresh run, once"
    for m, t in zip(mine, theirs):
        assert m == t, f"continued conversation {m[0]} turn {m[1]} differs from the fresh one"
    assert (run.prompts, run.completed, run.rejected, run.failed, run.left) == (CONVERSATIONS, CONVERSATIONS, 0, 0, 0)
    lineage = duckdb.sql(
        f"select count(*) filter (where parent_config_hash = '{parent.config_hash}'), count(*) from read_parquet("
        f"'{a}/completions/**/*.parquet', union_by_name = true) where config_hash = '{run.config_hash}'"
    ).fetchall()[0]
    assert lineage[0] == lineage[1] == len(mine), "every row of the new config names the config it came from"


def test_a_rerun_of_a_finished_continuation_of_turns_sends_nothing(continued, fleet_urls):
    a, _, parent, run, _ = continued
    again = cont(a, fleet_urls, parent.config_hash, NEW_CAP)
    assert (again.continued, again.regenerated, again.copied, again.completed) == (0, 0, 0, CONVERSATIONS)
    assert len(rows(a, run.config_hash)) == len(set(r[:2] for r in rows(a, run.config_hash)))


def test_a_killed_continuation_of_turns_resumes_with_every_prompt_and_turn_once(tmp_path, fleet_urls, continued):
    _, b, _, _, fresh = continued
    data = tmp_path / "data"
    build(data, fleet_urls)
    parent = generate(data, fleet_urls, all_turns(PARENT_CAP), SETTINGS)
    copies = len([r for r in rows(data, parent.config_hash, "finish_reason") if r[0] == "stop"])
    # slow decoding, so the kill lands while continued and regenerated turns are in flight
    slow = ["--decode-tokens-per-s", "2000", "--max-running-requests", "2", *ARGS]
    kill_mid_continuation(
        data,
        parent.config_hash,
        NEW_CAP,
        slow,
        tmp_path / "killed.txt",
        lambda: len(rows(data, fresh.config_hash, "prompt_id")) > copies + 1,
    )
    partial = [r[:2] for r in rows(data, fresh.config_hash)]
    assert copies + 1 < len(partial) < len(rows(b, fresh.config_hash)), "the kill should land mid-continuation"
    assert len(partial) == len(set(partial)), "a kill -9 left a (prompt_id, turn) twice"
    run = cont(data, fleet_urls, parent.config_hash, NEW_CAP)
    assert run.already_done == len(partial)
    assert rows(data, run.config_hash) == rows(b, fresh.config_hash), "nothing lost, nothing changed"
