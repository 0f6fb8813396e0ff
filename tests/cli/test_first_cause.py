"""When a CLI run fails, the terminal names the first cause in a line or two, never a later step's consequence."""

import fcntl
from pathlib import Path

import dagster as dg
from dagster._core.events import DagsterEventType
from dagster._core.instance.ref import InstanceRef

from dflash_assets.cli.runner import Stops, record_failures
from tests.support.cli import demo_slice, dflash, home


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


def test_a_failure_retried_to_exhaustion_shows_the_last_attempts_cause_and_its_attempts(tmp_path):
    # another writer holds shard 00000 (its flock, as a second `dflash generate` would): every attempt of
    # completions fails alike, and the retry policy retries it (DFLASH_RETRY_DELAY_S=0: no minute of waiting)
    env = home(tmp_path, "home") | {
        "DFLASH_NUM_SERVERS": "1",
        "DFLASH_FLEET_MODE": "emulated",
        "DFLASH_PROMPTS": str(demo_slice(tmp_path, 20)),
        "DFLASH_RETRY_DELAY_S": "0",
    }
    shard = Path(env["DFLASH_DATA_DIR"]) / "completions" / "shard=00000"
    shard.mkdir(parents=True)
    with open(shard / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("pid 4242 on the test")
        lock.flush()
        result = dflash("demo", env=env, cwd=tmp_path, timeout=600)
    out = " ".join(result.stdout.split())
    assert result.returncode == 1, result.stdout + result.stderr
    cause = f"RuntimeError: {shard} is being written by pid 4242 on the test; wait for it or stop it"
    assert f"Failed: shards 00000..00000, step completions: {cause}, after 3 attempts" in out, out
    assert "RetryRequestedFromPolicy" not in out and "Exceeded max_retries" not in out, out
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(env["DAGSTER_HOME"])) as instance:
        [run] = instance.get_runs(filters=dg.RunsFilter(job_name="shard_pipeline"))
        retries = instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_UP_FOR_RETRY)
        [step] = instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_FAILURE)
        [failed] = instance.all_logs(run.run_id, of_type=DagsterEventType.RUN_FAILURE)
    assert [e.step_key for e in retries] == ["completions", "completions"]  # 3 attempts: retried, then named
    assert step.dagster_event.event_specific_data.user_failure_data.description == f"{cause}, after 3 attempts"
    assert f"{cause}, after 3 attempts" in failed.dagster_event.event_specific_data.error.message  # the UI's text


def test_retries_run_out_in_an_asset_that_names_nothing_the_terminal_unwraps_dagsters_wrapper():
    # Dagster's own "Exceeded max_retries of 1" (a RetryRequestedFromPolicy whose cause is the last attempt's)
    attempts = []

    @dg.asset(retry_policy=dg.RetryPolicy(max_retries=1))
    def flaky():
        attempts.append(1)
        raise ValueError(f"attempt {len(attempts)} went wrong")

    result = dg.materialize([flaky], instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    [step] = [e for e in result.all_events if e.is_step_failure]
    assert step.step_failure_data.error.cls_name == "RetryRequestedFromPolicy"  # what Dagster says, as is
    stops = Stops()
    record_failures(result, "the test", stops)
    [error] = stops.errors
    assert error.message == "ValueError: attempt 2 went wrong, after 2 attempts", error
