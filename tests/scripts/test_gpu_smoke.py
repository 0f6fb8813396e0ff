"""scripts/gpu_smoke.sh runs unchanged against the emulator (DFLASH_SGLANG_COMMAND=emulator), so it does not rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_assets.emulator.process import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_gpu_smoke_script_passes_against_the_emulator(tmp_path):
    env = {**os.environ, "DFLASH_SGLANG_COMMAND": "emulator", "DFLASH_PYTHON": sys.executable, "COLUMNS": "200"}
    env.pop("DFLASH_API_KEY", None)
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "gpu_smoke.sh"),
            "--model-path",
            "emulated/qwen3-27b",
            "--work-dir",
            str(tmp_path / "smoke"),
            "--port",
            str(free_port()),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "client and server agree" in out
    for row in (
        "generation requests",
        "prompt tokens",
        "generated tokens",
        "preflight rejects",
        "server rejects (HTTP 400)",
        "rows continued by token ids",
        "export: kept + excluded rows",
    ):
        assert row in out
    assert " NO " not in out
    assert "gpu0: stopped" in out, "the server it launched is stopped afterwards"


@pytest.mark.timeout(300)
def test_the_gpu_smoke_script_exits_1_and_says_what_disagrees_when_the_kv_pool_clamps(tmp_path):
    # a KV pool below the context: the prompt forced past preflight is clamped silently instead of refused
    env = {**os.environ, "DFLASH_SGLANG_COMMAND": "emulator", "DFLASH_PYTHON": sys.executable, "COLUMNS": "200"}
    env.pop("DFLASH_API_KEY", None)
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "gpu_smoke.sh"),
            "--model-path",
            "emulated/qwen3-27b",
            "--work-dir",
            str(tmp_path / "smoke"),
            "--port",
            str(free_port()),
            "--extra-args",
            "--max-total-tokens 1500",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "2 disagreement(s)" in out
    disagreeing = [line.split("│")[1].strip() for line in out.splitlines() if "│ NO" in line]
    assert disagreeing == ["'length' rows below their cap", "server rejects (HTTP 400)"]
