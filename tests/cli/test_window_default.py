"""The window is the default (issue 53): a data dir written under the old default (a fixed cap) keeps its config and
hash, a rerun there without flags says in one line that it starts a new (window) config and how to continue the old
one, the demo decodes at most 1.01 tokens per trained token, and a cap past the window says it buys no trained
token (the seed's case: cap 4096, then 8192 with a 4096 window)."""

import re

from dflash_assets.cli import build_parser
from dflash_assets.store.configs import list_configs
from tests.support.cli import demo_slice, dflash, home, split_command


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
    flat = re.sub(r"\s+", " ", new.stdout)
    decoded, trained = (
        int(x.replace(",", "")) for x in re.search(r"decoded ([\d,]+) tokens, trained ([\d,]+)", flat).groups()
    )
    assert decoded / trained <= 1.01, flat
    # the seed's case: the cap bumped past the window buys no trained token; growing the window does
    bump = dflash("demo", "--max-output-tokens", "8192", env=env, cwd=tmp_path)
    flat = re.sub(r"\s+", " ", bump.stdout)
    assert (
        "Cap 8,192 lies past the trainer's window 4,096 (+16): every request asks at most the window's rest, so a "
        "larger cap buys no trained token" in flat
    ), flat
    assert "dflash continue --to-window 8192" in flat
