"""When a CLI run fails, the terminal names the first cause in a line or two, never a later step's consequence."""

from tests.support.cli import dflash, home


def test_a_fleet_that_cannot_start_is_the_cause_on_the_terminal_with_the_servers_own_words(tmp_path):
    # as SGLang 0.5.23 does, the emulator refuses a context above the model's derived 32768 unless allowed
    env = home(tmp_path, "home") | {
        "DFLASH_NUM_SERVERS": "1",
        "DFLASH_FLEET_MODE": "emulated",
        "DFLASH_EMULATOR_ARGS": "--reasoning-parser qwen3 --context-length 40960",
        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": None,
    }
    result = dflash("demo", "--max-output-tokens", "32768", env=env, cwd=tmp_path, timeout=600)
    out = " ".join(result.stdout.split())  # rich wraps long lines
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "Failed: shards 00000..00003: the run could not start: RuntimeError: the emulated fleet did not start" in out
    ), out
    assert "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in out, out  # the server's own last line, whole
    assert "no completions to export" not in out, "a later step's consequence stood in for the cause"
    assert "no figures (-): their run failed before completions committed any" in out, out
    assert "Next: fix the cause above" in out and "can pass" not in out, out
    assert "Traceback" not in result.stdout
