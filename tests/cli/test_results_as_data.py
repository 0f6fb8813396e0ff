"""The terminal reads results as data (metadata, typed errors), never our own messages back: a check or the preflight
may say things in other words and every command still ends with the same figures and next command."""

import ast
import importlib
import json
import os
import sys
from pathlib import Path

import pytest

import dflash_assets.cli
from dflash_assets.generation import preflight

pytestmark = pytest.mark.long

CLI = Path(dflash_assets.cli.__file__).parent


def test_no_regular_expression_in_cli_reads_a_message_of_ours():
    """`re` is for argparse's own messages only (parser.py's usage_problem); no class name is compared as a string."""
    found = []
    for path in sorted(CLI.glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "re":
                    found.append(f"{path.name}:{fn.name}")
        names = {c.value for c in ast.walk(tree) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        assert not {"DagsterAssetCheckFailedError", "FleetDown", "ServerError", "preflight: "} & names, path.name
    assert set(found) == {"parser.py:usage_problem"}, found


@pytest.fixture
def in_process(tmp_path):
    """`dflash` run in this process (so a monkeypatch reaches the checks and the preflight), on a fresh instance and
    data dir; the definitions are loaded again for its environment, and again after it."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"say {i}"}) + "\n" for i in range(60)))

    def run(*argv: str, **env: str) -> int:
        saved = dict(os.environ)  # the command sets its settings in the environment: all of it is put back after
        for name in ("DFLASH_DATA_DIR", "DFLASH_PROMPTS", "DFLASH_SHARD_SIZE"):
            os.environ.pop(name, None)
        os.environ |= {"DAGSTER_HOME": str(tmp_path / "home"), "DFLASH_NUM_SERVERS": "1", **env}
        args = ["--prompts", str(prompts), "--data-dir", str(tmp_path / "data"), "--shard-size", "60"]
        # the command loads the definitions once it has set its environment (cli/runner.py), as a new process does
        sys.modules.pop("dflash_assets.definitions", None)
        try:
            return dflash_assets.cli.main([*argv, *args])
        finally:
            os.environ.clear()
            os.environ.update(saved)
            sys.modules.pop("dflash_assets.definitions", None)
            importlib.import_module("dflash_assets.definitions")

    return run


def test_a_preflight_refusal_in_other_words_still_ends_with_the_context_length_that_fits(
    in_process, monkeypatch, capsys
):
    said = {}

    def reworded(budget, cap, overflowing, total, largest):
        error = preflight.overflow_error(budget, cap, overflowing, total, largest)
        said["needed"] = error.context_length_needed
        return preflight.PreflightError("nothing fits here, in new words", error.context_length_needed)

    monkeypatch.setattr("dflash_assets.generation.plan.overflow_error", reworded)
    status = in_process(
        "demo",
        "--full",
        "--cap-policy",
        "fixed",
        "--max-output-tokens",
        "8189",  # a prompt may have 1 token: past the check before the run, refused by the preflight
        DFLASH_EMULATOR_ARGS="--reasoning-parser qwen3 --context-length 8192",
    )
    out = capsys.readouterr().out
    assert status == 2, out
    assert "nothing fits here, in new words" in out and str(said["needed"]) not in out.partition("Next:")[0]
    assert out.strip().splitlines()[-1] == (
        f"Next: restart the servers with --context-length {said['needed']} (or lower --max-output-tokens)."
    )


def test_a_checks_summary_in_other_words_still_stops_the_run_with_the_plan_and_the_next_command(
    in_process, monkeypatch, capsys
):
    monkeypatch.setattr("dflash_assets.quality.checks.lengths.verdict", lambda rate, limit: "said differently")
    status = in_process("demo", "--full", "--max-output-tokens", "2048", "--trainer-max-length", "8192")
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert status == 3, out
    assert "Stopped by the blocking check truncation_rate (shards 00000)" in flat and "said differently" in flat, out
    assert "recommended cap:" in flat and "dflash continue --to " in flat, out
