"""Launch mode meets a prompt that kills its server: `dflash fleet up` starts three servers (the emulator as the
`sglang serve` command), each told at run time to exit hard on a marker (the crash_on fault, as a CUDA fault on
one input). A backfill quarantines the prompt after two servers died under it and commits every other; the next
`fleet up` relaunches the two dead servers, and the next backfill does not send the prompt again: all three stay up.
"""

from __future__ import annotations

import json
import urllib.request

import duckdb
import pytest

from dflash_assets.generation.quarantine import QUARANTINED
from tests.support.cli import dflash, free_base_port
from tests.support.dagster_procs import PROJECT_DAGSTER_YAML
from tests.support.http import set_faults

pytestmark = pytest.mark.long

MARKER = "POISON-launch-5e2a"
N = 12


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def test_in_launch_mode_a_poisoned_prompt_costs_two_servers_and_the_relaunched_fleet_is_spared(tmp_path):
    home, data, src = tmp_path / "home", tmp_path / "data", tmp_path / "prompts.jsonl"
    home.mkdir()
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    src.write_text(
        "".join(
            json.dumps({"id": f"l{i:02d}", "prompt": f"launch question {i}" + (f" {MARKER}" if i == 5 else "")}) + "\n"
            for i in range(N)
        )
    )
    base = free_base_port(3)
    launch = {
        "DFLASH_FLEET_MODE": "launch",
        "DFLASH_MODEL_PATH": "emulated/qwen3-27b",
        "DFLASH_GPUS": "0,1,2",
        "DFLASH_BASE_PORT": str(base),
        "DFLASH_SGLANG_COMMAND": "emulator",
    }
    env = {"DAGSTER_HOME": str(home), "DFLASH_DATA_DIR": str(data), "DFLASH_PROMPTS": str(src)}
    env |= {"DFLASH_SHARD_SIZE": str(N), "DFLASH_RETRY_DELAY_S": "1"} | launch
    up = ["fleet", "up", "--model-path", "emulated/qwen3-27b", "--gpus", "0,1,2", "--command", "emulator"]
    up += ["--base-port", str(base), "--health-timeout-s", "60"]
    urls = [f"http://127.0.0.1:{base + i}" for i in range(3)]
    backfill = ["backfill", "--max-output-tokens", "256", "--max-attempts", "8", "--backoff-base-s", "0.05"]
    try:
        first_up = dflash(*up, env=env)
        assert first_up.returncode == 0, first_up.stdout + first_up.stderr
        for url in urls:
            set_faults(url, {"crash_on": MARKER})
        first = dflash(*backfill, env=env, timeout=600)
        said = first.stdout + first.stderr
        assert sum(not healthy(u) for u in urls) == 2, said
        rows = duckdb.sql(f"select prompt_id from read_parquet('{data}/completions/**/*.parquet')").fetchall()
        assert sorted(r[0] for r in rows) == [f"l{i:02d}" for i in range(N) if i != 5], said
        [(prompt_id, error)] = duckdb.sql(
            f"select prompt_id, error from read_parquet('{data}/failures/**/*.parquet')"
        ).fetchall()
        assert prompt_id == "l05" and error.startswith(QUARANTINED), said
        named = [line for line in first.stdout.splitlines() if line.startswith("Quarantined")]
        assert len(named) == 1 and "l05 (shard 00000)" in named[0], first.stdout
        retry = named[0].split("to send it again: ", 1)[1]
        assert " dflash backfill " in retry and " --retry-quarantined" in retry, named[0]

        again_up = dflash(*up, env=env)  # the dead ones relaunched, the live one reused
        said = again_up.stdout
        assert (said.count(": relaunched"), said.count(": reused")) == (2, 1), said
        assert all(healthy(u) for u in urls), again_up.stdout
        for url in urls:
            set_faults(url, {"crash_on": MARKER})  # the marker would kill any of them again
        second = dflash(*backfill, env=env, timeout=600)
        assert all(healthy(u) for u in urls), "the next run did not send the quarantined prompt\n" + second.stdout
        again = duckdb.sql(f"select prompt_id from read_parquet('{data}/completions/**/*.parquet')").fetchall()
        assert sorted(again) == sorted(rows), "nothing generated twice, nothing lost"
    finally:
        down = dflash("fleet", "down", env=env)
        assert down.returncode == 0, down.stdout + down.stderr


def run_messages(home) -> list[str]:
    """Every message of every run's event log in the instance at `home`, oldest run first."""
    import dagster as dg

    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = sorted(instance.get_runs(), key=lambda r: instance.get_run_record_by_id(r.run_id).create_timestamp)
        return [e.user_message for r in runs for e in instance.all_logs(r.run_id)]


@pytest.mark.parametrize("servers", [1, 2])
def test_an_emulated_fleet_of_one_or_two_relaunches_the_server_a_prompt_killed_and_finishes_in_one_run(
    tmp_path, servers
):
    """The fleet the run starts is kept up: a server the poisoned prompt killed is relaunched at its port with the
    same flags (fleet/supervise.py), so the prompt's second death comes in the same run, and the run quarantines it
    and commits every other prompt once, on a fleet of one as on two. A second run sends it nowhere."""
    home, data, src = tmp_path / "home", tmp_path / "data", tmp_path / "prompts.jsonl"
    home.mkdir()
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    src.write_text(
        "".join(
            json.dumps({"id": f"e{i:02d}", "prompt": f"emulated question {i}" + (f" {MARKER}" if i == 5 else "")})
            + "\n"
            for i in range(N)
        )
    )
    env = {"DAGSTER_HOME": str(home), "DFLASH_DATA_DIR": str(data), "DFLASH_PROMPTS": str(src)}
    env |= {"DFLASH_SHARD_SIZE": str(N), "DFLASH_RETRY_DELAY_S": "1", "DFLASH_FLEET_MODE": "emulated"}
    env |= {"DFLASH_NUM_SERVERS": str(servers), "DFLASH_EMULATOR_ARGS": f"--fault-crash-on {MARKER}"}
    backfill = ["backfill", "--max-output-tokens", "256", "--max-attempts", "8", "--backoff-base-s", "0.05"]

    first = dflash(*backfill, env=env, timeout=600)
    said = first.stdout + first.stderr
    rows = duckdb.sql(f"select prompt_id from read_parquet('{data}/completions/**/*.parquet')").fetchall()
    assert sorted(r[0] for r in rows) == [f"e{i:02d}" for i in range(N) if i != 5], said
    [(prompt_id, error)] = duckdb.sql(
        f"select prompt_id, error from read_parquet('{data}/failures/**/*.parquet')"
    ).fetchall()
    assert prompt_id == "e05" and error.startswith(QUARANTINED), said
    assert any(line.startswith("Quarantined") and "e05" in line for line in first.stdout.splitlines()), said
    relaunched = [m for m in run_messages(home) if m.endswith("its process ended; relaunched at its port")]
    # a fleet of one finished, so its server came back; the second death's relaunch may come after the last request
    assert servers > 1 or len(relaunched) >= 1, relaunched
    assert len(relaunched) <= 2, relaunched

    second = dflash(*backfill, env=env, timeout=600)
    assert second.returncode == first.returncode, second.stdout + second.stderr
    again = duckdb.sql(f"select prompt_id from read_parquet('{data}/completions/**/*.parquet')").fetchall()
    assert sorted(again) == sorted(rows), "nothing generated twice, nothing lost"
    assert len([m for m in run_messages(home) if "relaunched at its port" in m]) == len(relaunched), "none died"
