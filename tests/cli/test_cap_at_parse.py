"""A cap that leaves no prompt room in the servers' context is refused in one line before any run starts, when that
context is known: the emulated servers' flags, or attached servers that answer now. (A cap above any model's
context is refused by the settings: tests/cli/test_answer.py.)"""

from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from dflash_assets.cli.flags import request_cap
from dflash_assets.settings import RequestSettings, TrainerSettings
from tests.support.cli import dflash, home

pytestmark = pytest.mark.long


def runs_in(env: dict) -> int:
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(env["DAGSTER_HOME"])) as instance:
        return len(instance.get_run_records())


def test_a_cap_past_the_emulated_servers_context_is_refused_before_the_demo_starts(tmp_path):
    env = home(tmp_path, "home")
    result = dflash("demo", "--cap-policy", "fixed", "--max-output-tokens", "40000", env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line == (
        "dflash demo: max_output_tokens 40,000 leaves no room for a prompt in the servers' context length 32,768 "
        "(the emulated servers' flags: --reasoning-parser qwen3 --tool-call-parser qwen25; 2 tokens kept free): lower "
        "--max-output-tokens "
        "below 32,766, or give the servers --context-length 40,003 or more (dflash demo did not start)"
    )
    assert runs_in(env) == 0 and not Path(env["DFLASH_DATA_DIR"]).exists()


def test_a_cap_past_attached_servers_context_is_refused_for_backfill_and_continue(tmp_path, emulator):
    server = emulator("--context-length", "8192", "--decode-tokens-per-s", "0")
    env = home(tmp_path, "home") | {"DFLASH_FLEET_MODE": "attach", "DFLASH_FLEET_URLS": server.emu.url}
    said = "leaves no room for a prompt in the servers' context length 8,192 (read from the servers; "
    backfill = dflash("backfill", "--cap-policy", "fixed", "--max-output-tokens", "9000", env=env, cwd=tmp_path)
    assert backfill.returncode == 2 and said in backfill.stderr, backfill.stdout + backfill.stderr
    assert backfill.stderr.strip().endswith("(dflash backfill did not start)")
    again = dflash("continue", "--to", "8190", env=env, cwd=tmp_path)
    assert again.returncode == 2 and "max_output_tokens 8,190 " + said in again.stderr, again.stderr
    assert runs_in(env) == 0 and not Path(env["DFLASH_DATA_DIR"]).exists()


def test_under_the_window_policy_the_largest_request_is_the_windows_rest_not_the_cap():
    trainer = TrainerSettings(max_length=4096)
    window = RequestSettings(max_output_tokens=40000, cap_policy="window").model_dump()
    fixed = RequestSettings(max_output_tokens=40000, cap_policy="fixed").model_dump()
    assert request_cap(window, trainer) == 4096 - 1 + RequestSettings().overshoot
    assert request_cap(fixed, trainer) == 40000
