"""The window is the default (issue 53): a data dir written under the old default (a fixed cap) keeps its config and
hash, a rerun there without flags says in one line that it starts a new (window) config and how to continue the old
one, the demo decodes at most 1.01 tokens per trained token, and a cap past the window says it buys no trained
token (the seed's case: cap 4096, then 8192 with a 4096 window), while growing the window to 8192 continues the cut
turns paying only the new tokens."""

import re
from pathlib import Path

import duckdb

from dflash_assets.cli import build_parser
from dflash_assets.store.configs import list_configs
from tests.support.cli import demo_slice, dflash, home, split_command
from tests.support.docs import written_by_this_run

README = Path(__file__).resolve().parents[2] / "README.md"
README_MARK = "<!-- the figures of tests/cli/test_window_default.py's run: DFLASH_WRITE_DOCS=1 writes them -->"


def figures(stdout: str) -> tuple[int, int]:
    """(decoded, trained) as the demo's answer says them."""
    found = re.search(r"decoded ([\d,]+) tokens, trained ([\d,]+)", re.sub(r"\s+", " ", stdout))
    assert found, stdout
    return int(found.group(1).replace(",", "")), int(found.group(2).replace(",", ""))


def test_an_old_default_data_dir_keeps_its_config_and_a_rerun_says_it_starts_a_window_config(tmp_path):
    env = home(tmp_path, "home") | {
        "DFLASH_PROMPTS": str(demo_slice(tmp_path, 60)),
        "DFLASH_SHARD_SIZE": "60",
        "DFLASH_NUM_SERVERS": "1",
    }
    old = dflash("demo", "--cap-policy", "fixed", "--max-output-tokens", "16384", env=env, cwd=tmp_path)
    assert old.returncode == 0, old.stdout + old.stderr
    [fixed] = list_configs(env["DFLASH_DATA_DIR"])
    new = dflash("demo", env=env, cwd=tmp_path)
    assert new.returncode == 0, new.stdout + new.stderr
    said = [line for line in new.stdout.splitlines() if "decode a fixed cap" in line]
    assert len(said) == 1, new.stdout
    assert "this run starts a new config, cap_policy window at the trainer's window 4,096" in said[0]
    command = said[0].split(f"To continue config {fixed.config_hash} (cap 16384) instead: ")[1]
    _, words = split_command(command)
    again = build_parser().parse_args(words[1:])
    assert (again.subcommand, again.cap_policy, again.max_output_tokens) == ("demo", "fixed", 16384)
    configs = {c.config_hash: c for c in list_configs(env["DFLASH_DATA_DIR"])}
    assert configs[fixed.config_hash].rows == fixed.rows and configs[fixed.config_hash].cap_policy == "fixed"
    [window] = [c for h, c in configs.items() if h != fixed.config_hash]
    assert window.cap_policy == "window" and window.window == 4096
    (decoded, trained), (old_decoded, old_trained) = figures(new.stdout), figures(old.stdout)
    assert decoded / trained <= 1.01 < old_decoded / old_trained, new.stdout
    written_by_this_run(
        README,
        README_MARK + "\n",
        "\n\n",
        f"Decoded per trained token, 60 demo prompts: {decoded / trained:.4f}; "
        f"`--cap-policy fixed --max-output-tokens 16384`: {old_decoded / old_trained:.4f}.",
    )
    # the seed's case: the cap bumped past the window buys no trained token; growing the window does
    bump = dflash("demo", "--max-output-tokens", "8192", env=env, cwd=tmp_path)
    flat = re.sub(r"\s+", " ", bump.stdout)
    assert (
        "Cap 8,192 lies past the trainer's window 4,096 (+16): every request asks at most the window's rest, so a "
        "larger cap buys no trained token" in flat
    ), flat
    assert "dflash continue --to-window 8192" in flat
    # with an 8192 window it continues the cut turns by their ids: the command as printed
    line = next(x for x in bump.stdout.splitlines() if "dflash continue --to-window 8192" in x)
    _, words = split_command(line[line.index("dflash continue") :] if "uv run" not in line else line)
    grown = dflash(*words[1:], env=env, cwd=tmp_path)
    assert grown.returncode == 0, grown.stdout + grown.stderr
    data = env["DFLASH_DATA_DIR"]
    # each row of the 8192 window that has a parent reuses all of its parent's tokens: a cut one is continued from
    # where it stopped, a stopped one copied; only the rest is decoded
    cut, continued, reused, short = duckdb.sql(
        f"""with c as (select * from read_parquet('{data}/completions/**/*.parquet', union_by_name = true))
        select count(*) filter (where p.finish_reason = 'length'), count(*) filter (where p.finish_reason = 'length'
            and n.completion_tokens > p.completion_tokens), sum(n.tokens_reused), count(*) filter (where n.tokens_reused <> p.completion_tokens)
        from c n join c p on p.config_hash = n.parent_config_hash and p.prompt_id = n.prompt_id
            and p.turn is not distinct from n.turn
        where n.trainer_max_length = 8192"""
    ).fetchall()[0]
    flat = re.sub(r"\s+", " ", grown.stdout)
    assert short == 0 and continued > 0 and re.search(rf"00000 {cut} \d+ \d+ {reused:,} ", flat), flat
    [(all_tokens,)] = duckdb.sql(
        f"select sum(completion_tokens) from read_parquet('{data}/completions/**/*.parquet', union_by_name = true) "
        "where trainer_max_length = 8192"
    ).fetchall()
    assert f"tokens reused: {reused:,} of {all_tokens:,}" in flat, flat
