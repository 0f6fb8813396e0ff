"""When a CLI run fails, the terminal names the first cause in a line or two, never a later step's consequence."""

import os
import subprocess
import sys

from tests.support.dagster_procs import PROJECT_DAGSTER_YAML


def test_a_fleet_that_cannot_start_is_the_cause_on_the_terminal_with_the_servers_own_words(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    # as SGLang 0.5.23 does, the emulator refuses a context above the model's derived 32768 unless allowed
    env = {**os.environ, "DAGSTER_HOME": str(home), "DFLASH_DATA_DIR": str(tmp_path / "data"),
           "DFLASH_NUM_SERVERS": "1", "DFLASH_FLEET_MODE": "emulated",
           "DFLASH_EMULATOR_ARGS": "--reasoning-parser qwen3 --context-length 40960"}
    env.pop("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", None)
    result = subprocess.run([sys.executable, "-m", "dflash_assets.cli", "demo", "--max-output-tokens", "32768"],
                            capture_output=True, text=True, env=env, timeout=600)
    out = " ".join(result.stdout.split())  # rich wraps long lines
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Failed: shards 00000..00003: the run could not start: RuntimeError: the emulated fleet did not start" \
           in out, out
    assert "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in out, out  # the server's own last line, whole
    assert "no completions to export" not in out, "a later step's consequence stood in for the cause"
    assert "no figures (-): their run failed before completions committed any" in out, out
    assert "Next: fix the cause above" in out and "can pass" not in out, out
    assert "Traceback" not in result.stdout
