"""Launch and emulated mode meet a prompt that kills its server (the emulator's crash_on fault, given as a server
flag, as a CUDA fault on one input): the run keeps its fleet up, relaunching a dead server at its port with the same
flags, so on one, two or three servers it quarantines the prompt after two deaths and commits every other, in one
run; the next run does not send the prompt again. Ctrl-C while the run relaunches a launched server ends the run.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import urllib.request

import duckdb
import pytest

from dflash_assets.fleet import registry
from dflash_assets.fleet.launcher import default_fleet_dir
from dflash_assets.generation.quarantine import QUARANTINED
from tests.support.cli import dflash, free_base_port
from tests.support.dagster_procs import PROJECT_DAGSTER_YAML
from tests.support.http import Http, requests_served

pytestmark = pytest.mark.long

MARKER = "POISON-launch-5e2a"
N = 12


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def run_messages(home) -> list[list[str]]:
    """The messages of each generating run's event log in the instance at `home`, oldest run first."""
    import dagster as dg

    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = [r for r in instance.get_runs() if r.job_name == "shard_pipeline"]
        runs.sort(key=lambda r: instance.get_run_record_by_id(r.run_id).create_timestamp)
        return [[e.user_message for e in instance.all_logs(r.run_id)] for r in runs]


def deaths(messages: list[str]) -> int:
    """Server deaths the run's quarantine saw (generation/quarantine.py says each once)."""
    return sum("died with requests in flight" in m for m in messages)


def prompts(path, prefix: str) -> None:
    """N prompts, the sixth poisoned."""
    lines = (
        {"id": f"{prefix}{i:02d}", "prompt": f"{prefix} question {i}" + (f" {MARKER}" if i == 5 else "")}
        for i in range(N)
    )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def completed_once(data) -> list[str]:
    rows = duckdb.sql(f"select prompt_id from read_parquet('{data}/completions/**/*.parquet')").fetchall()
    return sorted(r[0] for r in rows)


def quarantined(data) -> list[str]:
    found = duckdb.sql(f"select prompt_id, error from read_parquet('{data}/failures/**/*.parquet')").fetchall()
    return [prompt_id for prompt_id, error in found if error.startswith(QUARANTINED)] + [
        f"{prompt_id}: {error}" for prompt_id, error in found if not error.startswith(QUARANTINED)
    ]


BACKFILL = ["backfill", "--max-output-tokens", "256", "--max-attempts", "8", "--backoff-base-s", "0.05"]


@pytest.mark.parametrize("servers", [1, 2, 3])
def test_a_launched_fleet_relaunches_the_server_a_prompt_killed_and_finishes_in_one_run(tmp_path, servers):
    """Launch mode (the emulator as `sglang serve`, the crash flag in DFLASH_SGLANG_ARGS so a relaunched server has
    it too): the run relaunches a dead server through the launcher (fleet/supervise.py), so the prompt's second
    death comes in the same run: exactly two deaths, the prompt quarantined and named on the terminal with
    `--retry-quarantined`, every other prompt committed once, in one run with no step retried. A second run, on the
    fleet `fleet up` brings back whole, sends nothing to any server and kills none."""
    home, data, src = tmp_path / "home", tmp_path / "data", tmp_path / "prompts.jsonl"
    home.mkdir()
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    prompts(src, "l")
    base, gpus = free_base_port(servers), ",".join(map(str, range(servers)))
    flags = f"--fault-crash-on {MARKER}"
    env = {"DAGSTER_HOME": str(home), "DFLASH_DATA_DIR": str(data), "DFLASH_PROMPTS": str(src)}
    env |= {"DFLASH_SHARD_SIZE": str(N), "DFLASH_RETRY_DELAY_S": "1", "DFLASH_FLEET_MODE": "launch"}
    env |= {"DFLASH_MODEL_PATH": "emulated/qwen3-27b", "DFLASH_GPUS": gpus, "DFLASH_BASE_PORT": str(base)}
    env |= {"DFLASH_SGLANG_COMMAND": "emulator", "DFLASH_SGLANG_ARGS": flags}
    up = ["fleet", "up", "--model-path", "emulated/qwen3-27b", "--gpus", gpus, "--command", "emulator"]
    up += ["--base-port", str(base), "--extra-args", flags]
    urls = [f"http://127.0.0.1:{base + i}" for i in range(servers)]
    try:
        first = dflash(*BACKFILL, env=env, timeout=600)  # the run launches the fleet itself
        said = first.stdout + first.stderr
        assert completed_once(data) == [f"l{i:02d}" for i in range(N) if i != 5], said
        assert quarantined(data) == ["l05"], said
        [messages] = run_messages(home)  # one run, and no step of it retried
        assert deaths(messages) == 2, messages
        assert not any("retry" in m.lower() for m in messages if m.startswith("Execution of step")), messages
        named = [line for line in first.stdout.splitlines() if line.startswith("Quarantined")]
        assert len(named) == 1 and "l05 (shard 00000)" in named[0], first.stdout
        retry = named[0].split("to send it again: ", 1)[1]
        assert " dflash backfill " in retry and " --retry-quarantined" in retry, named[0]

        assert dflash(*up, env=env).returncode == 0  # a server the last death left down is relaunched
        records = registry.load(default_fleet_dir(home))
        before = {url: requests_served(Http(url)) for url in urls}
        second = dflash(*BACKFILL, env=env, timeout=600)
        assert second.returncode == first.returncode, second.stdout + second.stderr  # 3: cut at the cap of 256
        assert all(healthy(u) for u in urls) and registry.load(default_fleet_dir(home)) == records, "none died"
        assert {url: requests_served(Http(url)) for url in urls} == before, "the second run sent nothing"
        assert deaths(run_messages(home)[1]) == 0
        assert completed_once(data) == [f"l{i:02d}" for i in range(N) if i != 5], "nothing generated twice"
    finally:
        down = dflash("fleet", "down", env=env)
        assert down.returncode == 0, down.stdout + down.stderr


def test_a_launched_server_that_loads_longer_than_the_no_server_timeout_is_waited_for_and_the_run_finishes(tmp_path):
    """A fleet of one, launched, whose relaunches load for 5 s (a real SGLang loads for minutes), against a
    --no-server-timeout-s of 1: the run waits for the server it relaunches as long as the launch waits for its
    /health, so the prompt's two deaths and every other prompt still come in one run, with no step retried (Dagster's
    retries, seconds apart, would not outlast a real load)."""
    from tests.support.cli import loading_after

    home, data, src = tmp_path / "home", tmp_path / "data", tmp_path / "prompts.jsonl"
    home.mkdir()
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    prompts(src, "s")
    command = shlex.join(loading_after(1, tmp_path / "starts", for_s=5))
    env = {"DAGSTER_HOME": str(home), "DFLASH_DATA_DIR": str(data), "DFLASH_PROMPTS": str(src)}
    env |= {"DFLASH_SHARD_SIZE": str(N), "DFLASH_RETRY_DELAY_S": "1", "DFLASH_FLEET_MODE": "launch"}
    env |= {"DFLASH_MODEL_PATH": "emulated/qwen3-27b", "DFLASH_GPUS": "0", "DFLASH_BASE_PORT": str(free_base_port(1))}
    env |= {"DFLASH_SGLANG_COMMAND": command, "DFLASH_SGLANG_ARGS": f"--fault-crash-on {MARKER}"}
    try:
        first = dflash(*BACKFILL, "--no-server-timeout-s", "1", env=env, timeout=600)
        said = first.stdout + first.stderr
        assert completed_once(data) == [f"s{i:02d}" for i in range(N) if i != 5], said
        assert quarantined(data) == ["s05"], said
        [messages] = run_messages(home)
        assert deaths(messages) == 2 and any("waits up to 1200s" in m for m in messages), messages
        assert not any("retry" in m.lower() for m in messages if m.startswith("Execution of step")), messages
        assert (tmp_path / "starts").read_text().count("start") == 3, "launched, then relaunched after each death"
    finally:
        down = dflash("fleet", "down", env=env)
        assert down.returncode == 0, down.stdout + down.stderr


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
    prompts(src, "e")
    env = {"DAGSTER_HOME": str(home), "DFLASH_DATA_DIR": str(data), "DFLASH_PROMPTS": str(src)}
    env |= {"DFLASH_SHARD_SIZE": str(N), "DFLASH_RETRY_DELAY_S": "1", "DFLASH_FLEET_MODE": "emulated"}
    env |= {"DFLASH_NUM_SERVERS": str(servers), "DFLASH_EMULATOR_ARGS": f"--fault-crash-on {MARKER}"}

    first = dflash(*BACKFILL, env=env, timeout=600)
    said = first.stdout + first.stderr
    assert completed_once(data) == [f"e{i:02d}" for i in range(N) if i != 5], said
    assert quarantined(data) == ["e05"], said
    assert any(line.startswith("Quarantined") and "e05" in line for line in first.stdout.splitlines()), said
    [messages] = run_messages(home)
    assert deaths(messages) == 2, messages
    relaunched = [m for m in messages if m.endswith("its process ended; relaunched at its port")]
    # a fleet of one finished, so its server came back; the second death's relaunch may come after the last request
    assert servers > 1 or len(relaunched) >= 1, relaunched
    assert len(relaunched) <= 2, relaunched

    second = dflash(*BACKFILL, env=env, timeout=600)
    assert second.returncode == first.returncode, second.stdout + second.stderr
    assert completed_once(data) == [f"e{i:02d}" for i in range(N) if i != 5], "nothing generated twice, nothing lost"
    assert deaths(run_messages(home)[1]) == 0, "none died"


def test_ctrl_c_while_the_run_relaunches_a_launched_server_ends_the_run_and_fleet_down_leaves_nothing(tmp_path):
    """A backfill whose only server died under the poisoned prompt, the run relaunching it, the relaunched server still
    loading (it never answers /health; the launch waits up to its health timeout, 1200 s, and the run up to
    --no-server-timeout-s, 3600 s): Ctrl-C ends the run with 130 in one last line, no traceback, within the bound.
    The loading server is the registry's, left running as launched servers are; `fleet down` stops it and nothing of
    the fleet is left."""
    from dflash_assets.fleet import processes
    from tests.cli.test_kill_resume import BOUND_S, wait_until
    from tests.support.cli import loading_after, start

    home, data, src = tmp_path / "home", tmp_path / "data", tmp_path / "prompts.jsonl"
    home.mkdir()
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    prompts(src, "c")
    command = shlex.join(loading_after(1, tmp_path / "starts"))  # the first start serves, the relaunch loads for good
    env = {"DAGSTER_HOME": str(home), "DFLASH_DATA_DIR": str(data), "DFLASH_PROMPTS": str(src)}
    env |= {"DFLASH_SHARD_SIZE": str(N), "DFLASH_RETRY_DELAY_S": "1", "DFLASH_FLEET_MODE": "launch"}
    env |= {"DFLASH_MODEL_PATH": "emulated/qwen3-27b", "DFLASH_GPUS": "0", "DFLASH_BASE_PORT": str(free_base_port(1))}
    env |= {"DFLASH_SGLANG_COMMAND": command, "DFLASH_SGLANG_ARGS": f"--fault-crash-on {MARKER}"}
    fleet_dir, out = default_fleet_dir(home), tmp_path / "backfill.txt"
    proc = start(*BACKFILL, "--no-server-timeout-s", "3600", out=out, env=env)
    try:
        relaunched = lambda: (fleet_dir / "logs" / "gpu0.log.1").exists()  # noqa: E731  # a relaunch keeps the old log
        wait_until(lambda: relaunched() and "gpu0" in registry.load(fleet_dir), "the relaunch", proc, out)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
        assert proc.wait(timeout=BOUND_S) == 130, out.read_text()
        text = out.read_text()
        lines = [line for line in text.splitlines() if line.strip()]
        assert "Traceback" not in text and "dflash backfill stopped by SIGINT" in lines[-1], text
        [loading] = registry.load(fleet_dir).values()
        assert processes.is_ours(loading.pid, loading.proc_start), "a launched server outlives the run"
        assert (tmp_path / "starts").read_text().count("start") == 2, "launched, relaunched once, and no more"
    finally:
        down = dflash("fleet", "down", env=env)
        assert down.returncode == 0, down.stdout + down.stderr
    assert registry.load(fleet_dir) == {} and not processes.group_alive(loading.pid), "nothing of the fleet is left"
