"""The UI's Terminate on a daemon-launched `completions` run: the same polite stop as Ctrl-C.

`terminateRun` (the GraphQL mutation behind the UI's button) marks the run CANCELING, then the code server sends
SIGINT into the run worker. The generating step hears it (generation/stopping.py), ends the requests in flight on
the server, commits what was answered and ends the run CANCELED, its pool slots free; the next backfill of the same
shard finishes it with every prompt once. The stop lands after a committed row, with every later request held by the
fleet (the emulator's hold_after): without the stop the run would not end within the test's bound.
"""

from __future__ import annotations

import time

import dagster as dg
import pytest

from tests.engines.conftest import ONE_AT_A_TIME, held_after_a_row
from tests.support.backfill import (
    BLOCKED_WITHIN_S,
    POOL,
    SHARD_SIZE,
    backfill_runs,
    completion_rows,
    failures,
    launch_backfill,
    open_stack,
    wait_backfill,
)
from tests.support.dagster_procs import ARTIFACTS
from tests.support.http import Http, aborted, set_faults, settled

pytestmark = [pytest.mark.timeout(420), pytest.mark.long]

SHARD = "00000"
TERMINATE = """mutation($runId: String!) { terminateRun(runId: $runId) { __typename
  ... on TerminateRunSuccess { run { runId } } ... on PythonError { message } ... on RunNotFoundError { message }
  ... on UnauthorizedError { message } ... on TerminateRunFailure { message } } }"""


def test_terminate_in_the_ui_cancels_a_daemon_launched_run_and_the_next_backfill_finishes_it_once(tmp_path):
    with open_stack(tmp_path, logs=ARTIFACTS / "logs" / "terminate") as stack:
        first, _ = held_after_a_row(stack, SHARD, "terminate: the UI's button", "--enable-metrics")
        [run] = backfill_runs(stack.instance, first)
        result = stack.server.gql(TERMINATE, {"runId": run.run_id})["terminateRun"]
        assert result["__typename"] == "TerminateRunSuccess", result
        deadline = time.monotonic() + BLOCKED_WITHIN_S
        while not (stopped := stack.instance.get_run_by_id(run.run_id)).is_finished:
            assert time.monotonic() < deadline, f"the terminated run is still {stopped.status}"
            time.sleep(0.5)
        assert stopped.status == dg.DagsterRunStatus.CANCELED, stopped.status
        http = Http(stack.fleet.url)
        assert settled(http)["num_running_reqs"] == 0 and aborted(http) >= 1, "the request in flight was ended"
        storage = stack.instance.event_log_storage
        pools = {p: storage.get_concurrency_info(p).claimed_slots for p in (POOL, f"shard:{SHARD}")}
        assert not [p for p, slots in pools.items() if any(s.run_id == run.run_id for s in slots)], pools
        committed = completion_rows(stack.data_dir, SHARD)
        assert 0 < len(committed) < SHARD_SIZE, committed

        set_faults(stack.fleet.url, {"hold_after": None})  # the same shard again, nothing held
        again = launch_backfill(stack.server, [SHARD], "terminate: again", ONE_AT_A_TIME)
        backfill = wait_backfill(stack, again)
        assert (backfill["status"], failures(stack.instance, again)) == ("COMPLETED_SUCCESS", []), backfill
        rows = completion_rows(stack.data_dir, SHARD)
        assert len(set(rows)) == len(rows) == SHARD_SIZE and set(committed) <= set(rows), rows
