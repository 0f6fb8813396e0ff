"""scripts/gpu_smoke.sh runs unchanged against the emulator (DFLASH_SGLANG_COMMAND=emulator), so it does not rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_assets.emulator.process import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_the_gpu_smoke_script_passes_against_the_emulator(tmp_path):
    env = {**os.environ, "DFLASH_SGLANG_COMMAND": "emulator", "DFLASH_PYTHON": sys.executable,
           "COLUMNS": "200"}
    env.pop("DFLASH_API_KEY", None)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_smoke.sh"), "--model-path", "emulated/qwen3-27b",
                           "--work-dir", str(tmp_path / "smoke"), "--port", str(free_port())],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "client and server agree" in out
    for row in ("generation requests", "prompt tokens", "generated tokens", "preflight rejects",
                "server rejects (HTTP 400)", "rows continued by token ids", "export: kept + excluded rows"):
        assert row in out
    assert " NO " not in out
    assert "gpu0: stopped" in out, "the server it launched is stopped afterwards"
