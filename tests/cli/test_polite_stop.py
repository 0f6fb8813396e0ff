"""Ctrl-C (SIGINT to the process group) and SIGTERM (to the process) of `dflash demo`: a polite stop.

Each stop lands after a part of completions is committed, with the fleet slowed a thousandfold for every request
that arrives after that: without the stop the command would not end within the test's bound. The command must end
with 130 / 143, one line and no traceback; the server saw its requests in flight ended (aborted); the run is
CANCELED with its pool slots free; the same command again finishes with every (prompt_id, turn) once.
"""

from __future__ import annotations

import os
import signal

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from tests.cli.test_kill_resume import (
    BOUND_S,
    SLOW,
    accepted_prompt_ids,
    completion_rows,
    project,  # noqa: F401 - the fixture
    wait_until,
)
from tests.support.cli import start
from tests.support.forks import start_emulator
from tests.support.http import Http, aborted, requests_served, set_faults, settled

pytestmark = pytest.mark.long

ARGS = ("demo", "--max-output-tokens", "2048")


def stop_mid_completions(tmp_path, env, data, emu, how: str) -> tuple[int, str]:
    """Run `dflash demo` until a part is committed, slow the fleet, wait for a slowed request, then stop it."""
    out = tmp_path / f"{how}.txt"
    proc = start(*ARGS, out=out, env=env)
    wait_until(lambda: completion_rows(data), "a part of completions committed", proc, out)
    http = Http(emu.url)
    seen = requests_served(http)
    set_faults(emu.url, {"slow_factor": 1000})  # every later request decodes at 0.4 tok/s: in flight for good
    wait_until(lambda: requests_served(http) > seen, "a slowed request in flight", proc, out)
    if how == "sigint":
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
    else:
        proc.send_signal(signal.SIGTERM)  # systemd, Kubernetes: the process
    status = proc.wait(timeout=BOUND_S)  # the fleet is slowed for good: only the stop ends it
    return status, out.read_text()


def runs(home) -> list[dg.DagsterRun]:
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        return list(instance.get_runs())


def claimed_slots(home) -> list:
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        storage = instance.event_log_storage
        infos = storage.get_concurrency_infos(sorted(storage.get_concurrency_keys())).values()
        return [s for info in infos for s in info.claimed_slots]


@pytest.mark.parametrize(("how", "status"), [("sigint", 130), ("sigterm", 143)])
def test_a_polite_stop_of_the_demo_ends_its_requests_keeps_its_answers_cancels_its_run_and_resumes(
    tmp_path,
    project,  # noqa: F811 - the fixture imported above
    how,
    status,
):
    home, data, env = project
    with start_emulator([*SLOW, "--enable-metrics"]) as emu:
        env = {**env, "DFLASH_FLEET_URLS": emu.url}
        got, text = stop_mid_completions(tmp_path, env, data, emu, how)
        assert got == status, text
        assert "Traceback" not in text, text
        kept = completion_rows(data)
        name = "SIGINT (Ctrl-C)" if how == "sigint" else "SIGTERM"
        assert f"dflash demo stopped by {name}" in text and f"{len(kept)} completion rows are committed" in text, text
        assert "resume with: dflash demo --max-output-tokens 2048" in text, text
        assert settled(Http(emu.url))["num_running_reqs"] == 0, "a request went on decoding for a client gone"
        assert aborted(Http(emu.url)) >= 1, "the requests in flight were ended on the server"
        stopped = [r for r in runs(home) if r.job_name == "shard_pipeline"]
        assert stopped[0].status == dg.DagsterRunStatus.CANCELED, [(r.run_id, r.status) for r in stopped]
        assert not [r for r in runs(home) if not r.is_finished], "a run is left STARTED"
        assert claimed_slots(home) == [], "the stopped run's pool slots were freed"

        set_faults(emu.url, {"slow_factor": None})
        again = start(*ARGS, out=tmp_path / "again.txt", env=env)
        assert again.wait(timeout=BOUND_S * 2) in (0, 3), (tmp_path / "again.txt").read_text()
    rows = completion_rows(data)
    assert set(kept) <= set(rows), "what the stopped run committed is kept"
    assert len(rows) == len(set(rows)), "a (prompt_id, config_hash, turn) was committed twice"
    assert {r[0] for r in rows} == accepted_prompt_ids(data), "a prompt was lost"
