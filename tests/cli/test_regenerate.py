"""What `dflash demo` says of a multi-turn source: regenerate auto regenerates every turn (and says why the default
changed); last_turn keeps the source's answers, and the terminal and the manifest say SpecForge's
data.train_only_last_turn. Through Dagster, on one emulated server, one shard of a small ShareGPT source."""

import json
import re

from tests.support.cli import dflash, home

CHATS = 8
SOURCE = [
    {
        "id": f"chat{i}",
        "conversations": [
            {"from": "human", "value": f"Chat {i}: what is step one of topic {i}?"},
            {"from": "gpt", "value": f"The source's own answer of chat {i}."},
            {"from": "human", "value": "And step two?"},
        ],
    }
    for i in range(CHATS)
] + [{"id": f"one{i}", "prompt": f"Single question {i}."} for i in range(4)]


def demo(tmp_path, *flags: str):
    src = tmp_path / "sharegpt.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in SOURCE))
    env = home(tmp_path, "home") | {
        "DFLASH_PROMPTS": str(src),
        "DFLASH_SHARD_SIZE": "100",
        "DFLASH_NUM_SERVERS": "1",
        # short answers, so that the generous cap cuts none: every row reaches the export
        "DFLASH_EMULATOR_ARGS": "--reasoning-parser qwen3 --length-median 150 --length-sigma 0.3",
    }
    done = dflash("demo", "--full", "--max-output-tokens", "4096", *flags, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads(next((tmp_path / "home-data" / "training").glob("*/manifest.json")).read_text())
    return re.sub(r"\s+", " ", done.stdout), manifest


def test_last_turn_on_a_multi_turn_source_says_train_only_last_turn_and_the_manifest_counts_its_rows(tmp_path):
    """With thinking (the default) the source's answers have no reasoning, so the recipe's --expect-reasoning would
    stop at them: they are left out and counted (without thinking they are written: tests/quality/
    test_trainer_format.py)."""
    out, manifest = demo(tmp_path, "--regenerate", "last_turn")
    assert (
        f"regenerate last_turn: {CHATS} of {len(SOURCE)} prompts carry earlier assistant turns, whose earlier "
        f"answers are the source's own text. SpecForge puts loss on every assistant turn: set its "
        f"data.train_only_last_turn: true" in out
    ), out
    answers = manifest["source_answers"]
    assert (answers["rows"], answers["left_out"]) == (CHATS, CHATS)
    assert manifest["excluded"]["recipe_validation"] == CHATS
    assert manifest["recipe"]["flags"] == "--expect-reasoning --strict-think-markers"
    assert f"{CHATS} rows keep the source's own earlier answers in their history" in out
    assert "recipe_validation: SpecForge's validator with --expect-reasoning --strict-think-markers" in out


def test_the_default_regenerates_every_turn_of_a_multi_turn_source_and_says_why(tmp_path):
    out, manifest = demo(tmp_path)
    assert f"regenerate auto: all_turns, since {CHATS} of {len(SOURCE)} prompts carry earlier assistant turns" in out
    assert "the default was last_turn" in out and "docs/multi-turn.md" in out
    assert manifest["source_answers"]["rows"] == 0 and manifest["excluded"]["recipe_validation"] == 0
    assert manifest["conversations"]["exported"] + manifest["conversations_not_whole"] == len(SOURCE)
    # the default form of all_turns under qwen3.5 (which drops earlier reasoning): a row per assistant turn, said
    assert manifest["form"] == "per_turn" and manifest["rows"] == sum(
        c["rows"] for c in manifest["rows_by_config"].values()
    )
    assert "form per_turn, auto: regenerate all_turns under chat_template qwen3.5" in out
