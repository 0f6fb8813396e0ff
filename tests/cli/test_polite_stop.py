"""Ctrl-C (SIGINT to the process group) and SIGTERM (to the process) of `dflash demo` and `dflash backfill`: a
polite stop.

One demo is stopped by Ctrl-C, the same command again (resuming) by SIGTERM, a backfill of the same config by Ctrl-C,
then the demo finishes. Each stop
lands after a part of completions is committed, with every later request held by the fleet (the emulator's
hold_after): without the stop the command would not end within the test's bound. The command must end with 130 / 143,
one line and no traceback; the server saw its requests in flight ended (aborted); the run is CANCELED with its pool
slots free; the same command again finishes with every (prompt_id, turn) once.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
from dataclasses import dataclass

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from tests.cli.test_kill_resume import BOUND_S, accepted_prompt_ids, completion_rows, wait_until
from tests.support.backfill import FAST
from tests.support.cli import start
from tests.support.dagster_procs import PROJECT_DAGSTER_YAML
from tests.support.forks import start_emulator
from tests.support.http import Http, aborted, set_faults, settled

pytestmark = pytest.mark.long

ARGS = ("demo", "--max-output-tokens", "2048", "--commit-rows", "1")  # a part per row: the first answer is committed
BACKFILL = ("backfill", *ARGS[1:])  # the same config through `dflash backfill`
STOPS = {"sigint": ARGS, "sigterm": ARGS, "backfill-sigint": BACKFILL}  # in this order, each resuming the one before
PROMPTS = 6  # one shard


@dataclass
class Stop:
    status: int
    text: str
    kept: list  # the committed rows after the stop
    running: int  # requests still running on the server once settled
    aborted: float  # requests the server aborted during this command
    run: dg.DagsterRun  # the command's run
    unfinished: list  # runs left STARTED
    slots: list  # pool slots still claimed


def runs(home) -> list[dg.DagsterRun]:
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        return list(instance.get_runs())


def claimed_slots(home) -> list:
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        storage = instance.event_log_storage
        infos = storage.get_concurrency_infos(sorted(storage.get_concurrency_keys())).values()
        return [s for info in infos for s in info.claimed_slots]


def stop_after_a_committed_row(tmp_path, home, data, env, emu, how: str) -> Stop:
    """Run STOPS[how] with the fleet answering one request and holding every later one; once that answer is
    committed and a later request held, stop it (`how`: sigint or sigterm, after the command's name)."""
    http = Http(emu.url)
    before = (len(completion_rows(data)), aborted(http))
    set_faults(emu.url, {"hold_after": 1})
    out = tmp_path / f"{how}.txt"
    proc = start(*STOPS[how], out=out, env=env)
    wait_until(lambda: len(completion_rows(data)) > before[0], "a part of completions committed", proc, out)
    wait_until(lambda: Http(emu.url).get("/_emulator/faults")[1]["injected"]["hold"], "a request held", proc, out)
    if how.endswith("sigint"):
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
    else:
        proc.send_signal(signal.SIGTERM)  # systemd, Kubernetes: the process
    status = proc.wait(timeout=BOUND_S)  # every later request is held for good: only the stop ends it
    [run, *_] = [r for r in runs(home) if r.job_name == "shard_pipeline"]
    return Stop(
        status,
        out.read_text(),
        completion_rows(data),
        settled(http)["num_running_reqs"],
        aborted(http) - before[1],
        run,
        [r.run_id for r in runs(home) if not r.is_finished],
        claimed_slots(home),
    )


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A demo stopped by Ctrl-C, the same command stopped by SIGTERM, a backfill of the same config stopped by Ctrl-C,
    then the demo to its end."""
    tmp = tmp_path_factory.mktemp("polite")
    home, data, src = tmp / "home", tmp / "data", tmp / "prompts.jsonl"
    home.mkdir()
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    src.write_text(
        "".join(json.dumps({"id": f"s{i}", "prompt": f"stop test prompt {i}"}) + "\n" for i in range(PROMPTS))
    )
    env = {
        "DAGSTER_HOME": str(home),
        "DFLASH_DATA_DIR": str(data),
        "DFLASH_FLEET_MODE": "attach",
        "DFLASH_PROMPTS": str(src),
        "DFLASH_SHARD_SIZE": str(PROMPTS),
        "DFLASH_RETRY_DELAY_S": "3600",  # a stop that waited out the step's retry policy would outlast the bound
    }
    with start_emulator([*FAST, "--enable-metrics"]) as emu:
        env["DFLASH_FLEET_URLS"] = emu.url
        stops = {how: stop_after_a_committed_row(tmp, home, data, env, emu, how) for how in STOPS}
        set_faults(emu.url, {"hold_after": None})
        again = start(*ARGS, out=tmp / "again.txt", env=env)
        assert again.wait(timeout=BOUND_S) in (0, 3), (tmp / "again.txt").read_text()
    yield stops, completion_rows(data), accepted_prompt_ids(data)


@pytest.mark.parametrize(("how", "status"), [("sigint", 130), ("sigterm", 143), ("backfill-sigint", 130)])
def test_a_polite_stop_of_the_demo_ends_its_requests_keeps_its_answers_and_cancels_its_run(stopped, how, status):
    stops, _, _ = stopped
    stop = stops[how]
    assert stop.status == status, stop.text
    assert "Traceback" not in stop.text, stop.text
    name = "SIGINT (Ctrl-C)" if how.endswith("sigint") else "SIGTERM"
    said = f"dflash {STOPS[how][0]} stopped by {name}"
    assert said in stop.text and f"{len(stop.kept)} completion rows are committed" in stop.text, stop.text
    lines = [line for line in stop.text.splitlines() if line.strip()]
    assert said in lines[-1] and sum(said in line for line in lines) == 1, "one line, the last"
    assert f"dflash {shlex.join(STOPS[how])} --data-dir " in stop.text.split("resume with: ")[1], stop.text
    assert stop.running == 0, "a request went on decoding for a client gone"
    assert stop.aborted >= 1, "the requests in flight were ended on the server"
    assert stop.run.status == dg.DagsterRunStatus.CANCELED, stop.run
    assert stop.unfinished == [], "a run is left STARTED"
    assert stop.slots == [], "the stopped run's pool slots were freed"


def test_after_the_stops_the_same_command_finishes_with_every_prompt_once(stopped):
    stops, rows, accepted = stopped
    kept = [len(stops[how].kept) for how in STOPS]
    assert 0 < kept[0] < kept[1] < kept[2] < PROMPTS, "each stop kept its answers and left rows to generate"
    assert set(stops["backfill-sigint"].kept) <= set(rows), "what the stopped runs committed is kept"
    assert len(rows) == len(set(rows)), "a (prompt_id, config_hash, turn) was committed twice"
    assert {r[0] for r in rows} == accepted and len(accepted) == PROMPTS, "a prompt was lost"
