"""Growing the trainer's window later costs only the new tokens (issue 20, part 6): a window-policy config at
L1 = 512 continued to L2 = 1024 by token ids equals a fresh run at L2, row for row and in the export."""

import json

import duckdb
import pytest

from dflash_assets.fleet.fleet import on_fleet
from dflash_assets.generation.continuation import ToWindow, continue_shard, latest_parent
from dflash_assets.generation.engine import generate_shard
from dflash_assets.quality import export_training_set
from dflash_assets.settings import GenerationSettings, SettingsError
from tests.support.forks import start_emulator
from tests.support.window import FAST, SETTINGS, N, make_shard

L1, L2 = 512, 1024
COLUMNS = (
    "prompt_id, config_hash, finish_reason, prompt_tokens, completion_tokens, max_output_tokens, policy_cap, "
    "trainer_max_length, content, reasoning_content, prompt_token_ids, output_ids"
)


def window(length: int) -> GenerationSettings:
    return GenerationSettings(max_output_tokens=8192, cap_policy="window", trainer_max_length=length)


def rows(data_dir, config_hash, columns=COLUMNS):
    return duckdb.sql(
        f"select {columns} from read_parquet('{data_dir}/completions/**/*.parquet', union_by_name = "
        f"true) where config_hash = '{config_hash}' order by prompt_id"
    ).fetchall()


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """A shard at window L1, continued to L2; the same shard generated afresh at L2."""
    a, b = tmp_path_factory.mktemp("grown") / "data", tmp_path_factory.mktemp("fresh") / "data"
    with start_emulator(FAST) as x, start_emulator(FAST) as y:
        urls = [x.url, y.url]
        make_shard(a, urls)
        make_shard(b, urls)
        parent = on_fleet(urls, lambda f: generate_shard(a, "00000", f, window(L1), SETTINGS, log=lambda m: None))
        assert latest_parent(a, "00000", 8192, to_window=L2) == parent.config_hash
        run = on_fleet(
            urls,
            lambda f: continue_shard(a, "00000", f, parent.config_hash, ToWindow(L2), SETTINGS, log=lambda m: None),
        )
        fresh = on_fleet(urls, lambda f: generate_shard(b, "00000", f, window(L2), SETTINGS, log=lambda m: None))
        again = on_fleet(
            urls,
            lambda f: continue_shard(a, "00000", f, parent.config_hash, ToWindow(L2), SETTINGS, log=lambda m: None),
        )
    return a, b, parent, run, fresh, again


def test_the_grown_config_is_the_one_a_fresh_run_at_the_new_window_hashes_to_and_its_rows_equal_it(grown):
    a, b, parent, run, fresh, _ = grown
    assert run.config_hash == fresh.config_hash != parent.config_hash
    assert run.completed == fresh.completed == N and run.prompts == run.completed + run.rejected + run.failed + run.left
    assert rows(a, run.config_hash) == rows(b, fresh.config_hash)


def test_rows_that_stopped_stay_and_window_complete_rows_pay_only_the_new_tokens(grown):
    a, _, parent, run, fresh, _ = grown
    before = {r[0]: r for r in rows(a, parent.config_hash)}
    stopped = [pid for pid, r in before.items() if r[2] == "stop"]
    assert stopped and run.copied == len(stopped)
    assert run.continued == N - len(stopped) > 0
    generated = run.new_config_tokens - run.tokens_reused
    assert run.tokens_reused == sum(r[4] for r in before.values())  # every parent token reused
    assert generated == sum(r[4] for r in rows(a, run.config_hash)) - sum(r[4] for r in before.values())
    assert generated < fresh.output_tokens / 2  # the fresh run paid for the first window again
    lineage = duckdb.sql(
        f"select count(*) from read_parquet('{a}/completions/**/*.parquet', union_by_name = true) "
        f"where config_hash = '{run.config_hash}' and parent_config_hash = '{parent.config_hash}'"
    ).fetchall()[0][0]
    assert lineage == N


def test_the_export_at_the_new_window_equals_a_fresh_runs_under_the_exactness_test(grown, tmp_path):
    a, b, _, run, fresh, _ = grown
    ours = export_training_set(a, tmp_path / "a", config_hash=run.config_hash, max_length=L2, form="pretokenized")
    theirs = export_training_set(b, tmp_path / "b", config_hash=fresh.config_hash, max_length=L2, form="pretokenized")
    assert ours.jsonl_path.read_bytes() == theirs.jsonl_path.read_bytes()
    samples = [json.loads(line) for line in ours.jsonl_path.read_text().splitlines()]
    assert len(samples) == N and any(len(s["input_ids"]) == L2 for s in samples)


def test_a_second_continue_sends_nothing_and_a_fixed_cap_is_refused_by_name(grown, tmp_path):
    a, _, _, run, _, again = grown
    assert again.already_done == N and again.continued == 0 and again.copied == 0
    data = tmp_path / "data"
    with start_emulator(FAST) as x:
        make_shard(data, [x.url])
        fixed = on_fleet(
            [x.url],
            lambda f: generate_shard(
                data,
                "00000",
                f,
                GenerationSettings(max_output_tokens=256, cap_policy="fixed"),
                SETTINGS,
                log=lambda m: None,
            ),
        )
        with pytest.raises(
            SettingsError, match="has a fixed cap \\(256\\): --to-window continues a config of the window policy"
        ):
            on_fleet(
                [x.url],
                lambda f: continue_shard(
                    data, "00000", f, fixed.config_hash, ToWindow(L2), SETTINGS, log=lambda m: None
                ),
            )


def test_dflash_continue_to_window_grows_the_demos_window_through_dagster(tmp_path):
    from tests.support.cli import demo_slice, dflash, home

    # two shards of the demo's prompts (their rows reach a 2048 window as the demo's do), on one server
    env = home(tmp_path, "home") | {
        "DFLASH_PROMPTS": str(demo_slice(tmp_path, 60)),
        "DFLASH_SHARD_SIZE": "30",
        "DFLASH_NUM_SERVERS": "1",
    }
    # a row per prompt: the slice's multi-turn prompts would make regenerate auto all_turns
    demo = dflash(
        "demo",
        "--cap-policy",
        "window",
        "--trainer-max-length",
        "2048",
        "--regenerate",
        "last_turn",
        env=env,
        cwd=tmp_path,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    grown = dflash("continue", "--to-window", "4096", env=env, cwd=tmp_path)
    assert grown.returncode == 0, grown.stdout + grown.stderr
    assert "to the trainer's window 4096" in grown.stdout
    data = env["DFLASH_DATA_DIR"]
    by_window = dict(
        duckdb.sql(
            f"select trainer_max_length, count(*) from read_parquet('{data}/completions/**/"
            f"*.parquet', union_by_name = true) group by 1"
        ).fetchall()
    )
    assert set(by_window) == {2048, 4096} and by_window[4096] == by_window[2048] > 50  # every row taken on
    flat = " ".join(grown.stdout.split())
    assert "tokens reused:" in flat and "at or past the trainer's window max_length 4,096" in flat
    both = dflash("continue", "--to", "8192", "--to-window", "8192", env=env)
    assert both.returncode == 2 and "give one of --to (a larger cap) and --to-window" in both.stderr
