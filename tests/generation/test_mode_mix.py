"""A seeded mix of modes in one config (GenerationSettings.thinking_share, mode_seed): each prompt is generated with
thinking on or off as a seeded hash of its id says (rules.thinks), its row records the mode, the config hash covers
the mix (and a config of one mode keeps the hash it always had), and a run killed -9 and resumed keeps every
prompt's mode."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import duckdb

from dflash_assets.quality.training.export import export_training_set
from dflash_assets.rules import thinks
from dflash_assets.settings import DispatchSettings, GenerationSettings
from dflash_assets.store.configs import list_configs
from tests.support.forks import Forked, start_emulator
from tests.support.http import set_faults
from tests.support.shards import FAST, cont, generate, make_shard

N, SHARE, SEED = 200, 0.7, 11  # 30% of prompts with thinking off
PROMPTS = {f"m{i:03d}": f"mode mix question {i}" for i in range(N)}
MIX = GenerationSettings(max_output_tokens=4096, regenerate="last_turn", thinking_share=SHARE, mode_seed=SEED)


def modes(data: Path) -> dict[str, tuple[bool, bool, float | None, int | None]]:
    """prompt_id -> (enable_thinking, has reasoning_content, thinking_share, mode_seed) of its committed row."""
    found = duckdb.sql(
        f"select prompt_id, enable_thinking, coalesce(reasoning_content, '') <> '', thinking_share, mode_seed "
        f"from read_parquet('{data}/completions/**/*.parquet', union_by_name = true)"
    ).fetchall()
    return {r[0]: tuple(r[1:]) for r in found}


def mix_main(argv: list[str]) -> int:
    """`generate` of the mix as a process's main (forked): a commit per row, so a kill -9 lands between commits."""
    data_dir, url = argv
    generate(Path(data_dir), [url], MIX, DispatchSettings(commit_rows=1, commit_seconds=0.05, load_sample_s=0))
    return 0


def test_single_mode_configs_keep_their_hash_and_the_mix_makes_its_own():
    one = GenerationSettings(regenerate="last_turn", cap_policy="fixed")
    assert one.config_hash("m") == "94807fd38570"  # the hash this config had before the mix existed
    assert MIX.config_hash("m") != MIX.model_copy(update={"thinking_share": None}).config_hash("m")
    assert MIX.config_hash("m") != MIX.model_copy(update={"mode_seed": SEED + 1}).config_hash("m")
    assert MIX.config_hash("m") != MIX.model_copy(update={"thinking_share": SHARE / 2}).config_hash("m")
    # each prompt's mode is its draw's: enable_thinking decides nothing in a mix
    assert MIX.config_hash("m") == MIX.model_copy(update={"enable_thinking": False}).config_hash("m")


def test_each_prompt_is_generated_in_its_seeded_mode_and_keeps_it_after_a_kill_and_a_resume(tmp_path):
    data = tmp_path / "data"
    with start_emulator(FAST) as emu:
        make_shard(data, [emu.url], PROMPTS)
        log = tmp_path / "killed.log"
        target = "tests.generation.test_mode_mix:mix_main"
        proc = Forked(target, [str(data), emu.url], dict(os.environ), None, log, log, session=True)
        deadline = time.monotonic() + 120
        while len(modes(data) if any((data / "completions").rglob("*.parquet")) else {}) < N // 4:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        set_faults(emu.url, {"hold": True})  # what is in flight stays in flight: the kill lands mid-run
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        set_faults(emu.url, {"hold": None})
        before = modes(data)
        assert 0 < len(before) < N
        run = generate(data, [emu.url], MIX)  # the same config, resumed
    after = modes(data)
    assert (run.completed, run.failed, len(after)) == (N, 0, N)
    expected = {p: thinks(p, SHARE, SEED) for p in PROMPTS}
    assert {p: m[0] for p, m in after.items()} == expected, "every row in its seeded mode"
    assert all(after[p] == m for p, m in before.items()), "a prompt committed before the kill kept its row"
    # the server generated each in that mode: a reasoning trace with thinking on, none with it off
    assert all(m[1] == m[0] for m in after.values())
    assert {(m[2], m[3]) for m in after.values()} == {(SHARE, SEED)}, "each row records the mix"
    on = sum(expected.values())
    assert abs(on - SHARE * N) <= 4 * math.sqrt(N * SHARE * (1 - SHARE)), on  # within the binomial bound
    # the configs table (dflash configs, the summary's `configs`) and the export's manifest give the shares
    [config] = list_configs(data, 4096)
    assert config.thinking == f"{on / N:.1%} on" and config.settings["thinking_share"] == SHARE, config
    export = export_training_set(data, tmp_path / "training", config_hash=None)
    kept, by_mode = export.manifest["rows"], export.manifest["rows_by_mode"]
    assert kept > N // 2 and set(by_mode) == {"thinking", "no_thinking"} and sum(by_mode.values()) == kept, by_mode
    # a mix is exported pre-tokenized (a thinking-off row's `</think>` is a prompt token there), each row in its mode
    assert export.manifest["form"] == "pretokenized" and export.manifest["recipe"]["validator"] is None


def test_a_mixed_config_is_continued_each_row_in_its_own_mode(tmp_path):
    data = tmp_path / "data"
    small = MIX.model_copy(update={"max_output_tokens": 64})  # most rows cut: the continuation's work
    with start_emulator(FAST) as emu:
        make_shard(data, [emu.url], dict(list(PROMPTS.items())[:40]))
        parent = generate(data, [emu.url], small)
        result = cont(data, [emu.url], parent.config_hash, 4096)  # rebuilt off its rows: the mix included
    rows = duckdb.sql(
        f"select prompt_id, config_hash, enable_thinking, thinking_share, mode_seed, coalesce(reasoning_content, '') "
        f"from read_parquet('{data}/completions/**/*.parquet', union_by_name = true)"
    ).fetchall()
    continued = [r for r in rows if r[1] == result.config_hash]
    assert result.continued > 0 and len(continued) == 40, result
    assert all(r[2] == thinks(r[0], SHARE, SEED) and (r[3], r[4]) == (SHARE, SEED) for r in continued)
    assert all(bool(r[5]) == r[2] for r in continued), "a thinking row's trace goes on as reasoning, the others not"
