"""Backfills through Dagster's own API, as the UI launches them, on a fleet that must not be oversubscribed.

A real `dagster-webserver` and `dagster-daemon run` share a temporary DAGSTER_HOME whose dagster.yaml is the
project's (run queue, `concurrency.pools.default_limit` for the `sglang_fleet` pool, run monitoring). The fleet
is one SGLang emulator attached by URL (DFLASH_FLEET_MODE=attach, DFLASH_FLEET_URLS) with instant decode.
Backfills are launched with GraphQL `launchPartitionBackfill`, the mutation behind the UI's "Launch
backfill"; the daemon runs them.

1. A backfill over more shards than the pool limit, one run per shard: every partition materialised,
   every check evaluated; the event log shows never more `completions` steps running at once than the limit,
   and steps of the other runs waiting ("waiting for pool sglang_fleet", defs/pools.py). The contention is
   forced, not hoped for: the emulator holds every generation request (its `hold` fault) until the event log
   shows a step blocked by the pool, and only then lets the held steps finish, so however slowly runs start on
   the machine, the first steps are certainly still running when a later one reaches the pool.
2. A shard whose fleet goes down mid-run (the server crashes after two requests) fails its completions step;
   the rows committed before the crash stay; the server is back on the same URL by the time Dagster's retry of
   the step (the asset's RetryPolicy) connects, and the retry resumes where it stopped: only the missing prompts
   are generated, no row twice.
3. Two runs of the same shard launched at once (through the run queue and the daemon, as two clicks on
   "Materialize" would): one writes the shard, the other waits for it (one run per shard across the
   deployment, held in the instance's concurrency slots), then finds every row committed and generates none.
   The overlap is forced: the first run's requests are held until the second run says it waits.

What was measured is written to test-artifacts/backfill/ (pool.json, resume.json); the webserver, daemon and
emulator logs to test-artifacts/logs/backfill/.
"""

from __future__ import annotations

import os
import signal
import time

import dagster as dg
import psutil
import pytest
from dagster._core.events import DagsterEventType

from dflash_assets.quality import CHECKS
from tests.engines.conftest import ONE_AT_A_TIME, held_after_a_row
from tests.support.backfill import (
    BLOCKED_WITHIN_S,
    FAST,
    IN_PROCESS,
    KILLED_SHARD,
    POOL,
    RESUME_SHARD,
    SHARD_SIZE,
    SHARED_SHARD,
    backfill_runs,
    check_evaluations,
    check_pool_backfill,
    completion_rows,
    counts_by_asset,
    failures,
    latest_completions_metadata,
    launch_backfill,
    open_stack,
    run_logs,
    save,
    step_intervals,
    wait_backfill,
)

pytestmark = [pytest.mark.timeout(420), pytest.mark.long]  # six minutes: the whole suite's longest file


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with open_stack(tmp_path_factory.mktemp("backfill")) as opened:
        yield opened


def test_a_backfill_wider_than_the_pool_never_runs_more_generation_steps_than_the_limit(stack):
    check_pool_backfill(stack)


RESUME_CONFIG = {
    **IN_PROCESS,
    "ops": {
        "completions": {
            "config": {
                "commit_rows": 1,  # commit every row, so the crash leaves committed rows behind
                "max_in_flight_per_server": 2,
                "max_attempts": 2,
                "no_server_timeout_s": 3,
            }
        }
    },
}


def test_a_partition_whose_fleet_goes_down_is_retried_by_dagster_and_resumes(stack):
    # the server crashes when generation request 3 arrives: a row or two committed, then no server; the step fails
    stack.fleet.start(*FAST, "--fault-crash-after", "2")
    backfill_id = launch_backfill(stack.server, [RESUME_SHARD], "resume: fleet goes down", RESUME_CONFIG)
    deadline = time.monotonic() + BLOCKED_WITHIN_S
    while not (
        retries := [
            e
            for r in backfill_runs(stack.instance, backfill_id)
            for e in stack.instance.all_logs(r.run_id, of_type=DagsterEventType.STEP_UP_FOR_RETRY)
        ]
    ):
        assert time.monotonic() < deadline, f"the failed step was not put up for retry within {BLOCKED_WITHIN_S}s"
        time.sleep(0.5)
    [retry] = retries
    error = retry.dagster_event.event_specific_data.error
    assert retry.step_key == "completions" and "no healthy server" in error.to_string(), error.to_string()
    assert not stack.fleet.alive(), "the emulator was to crash"
    committed = completion_rows(stack.data_dir, RESUME_SHARD)
    assert 0 < len(committed) < SHARD_SIZE, committed

    # the server is back on the same URL for the retry (it waits for the fleet at connect): Dagster retries the step
    stack.fleet.start(*FAST)
    backfill = wait_backfill(stack, backfill_id)
    counts = counts_by_asset(backfill)
    assert backfill["status"] == "COMPLETED_SUCCESS", (backfill, failures(stack.instance, backfill_id))
    assert counts["completions"]["numPartitionsMaterialized"] == 1
    assert counts["length_quality_report"]["numPartitionsMaterialized"] == 1
    [run] = backfill_runs(stack.instance, backfill_id)
    assert run.status == dg.DagsterRunStatus.SUCCESS

    # completions resumed: the committed rows were kept, only the rest generated, no prompt twice
    rows = completion_rows(stack.data_dir, RESUME_SHARD)
    assert len(rows) == len(set(rows)) == SHARD_SIZE
    assert set(committed) <= set(rows)
    meta = latest_completions_metadata(stack.instance, RESUME_SHARD)
    assert meta["already_done"] == len(committed), meta
    assert meta["completed"] == SHARD_SIZE and meta["failed"] == 0, meta
    evaluations = check_evaluations(stack.instance, run.run_id)
    assert all(evaluations[c.name] for c in CHECKS if c.blocking), evaluations
    save(
        "resume.json",
        {
            "retried_after": error.message.strip(),
            "committed_before_crash": len(committed),
            "already_done_on_retry": meta["already_done"],
            "rows_after_retry": len(rows),
            "backfill": backfill_id,
            "backfill_seconds": round(backfill["endTimestamp"] - backfill["timestamp"], 1),
        },
    )


def test_two_runs_of_the_same_shard_at_once_write_it_one_after_the_other(stack):
    stack.fleet.start(*FAST, "--fault-hold")  # the writer's generation requests are held until released
    run_ids = [
        stack.server.client.submit_job_execution(
            "shard_pipeline", run_config=IN_PROCESS, tags={"dagster/partition": SHARED_SHARD}
        )
        for _ in range(2)
    ]
    waiting = f"waiting for pool shard:{SHARED_SHARD}"
    deadline = time.monotonic() + BLOCKED_WITHIN_S
    while not any(run_logs(stack.instance, run_id, waiting) for run_id in run_ids):
        assert time.monotonic() < deadline, f"no run waited for shard {SHARED_SHARD} within {BLOCKED_WITHIN_S}s"
        time.sleep(0.5)
    stack.fleet.release_hold()
    deadline = time.monotonic() + BLOCKED_WITHIN_S
    while not all(stack.instance.get_run_by_id(r).is_finished for r in run_ids):
        assert time.monotonic() < deadline, "the two runs did not finish"
        time.sleep(1.0)

    assert [stack.instance.get_run_by_id(r).status for r in run_ids] == [dg.DagsterRunStatus.SUCCESS] * 2
    [waiter] = [r for r in run_ids if run_logs(stack.instance, r, waiting)]
    [writer] = [r for r in run_ids if r != waiter]
    [said] = run_logs(stack.instance, waiter, waiting)
    assert writer in said.user_message, said.user_message  # it names the run that holds the shard
    [(waiter_start, _)] = step_intervals(stack.instance, [waiter], "completions")
    assert waiter_start < said.timestamp, "it waited inside its completions step"
    rows = completion_rows(stack.data_dir, SHARED_SHARD)
    assert len(rows) == len(set(rows)) == SHARD_SIZE, "every prompt once: the two runs never wrote at once"
    written = {
        m.event_log_entry.run_id: {k: v.value for k, v in m.asset_materialization.metadata.items()}
        for m in stack.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[SHARED_SHARD]), limit=2
        ).records
    }
    # the waiter found every row committed: it generated only after the writer had finished the shard
    assert (written[writer]["completed"], written[waiter]["already_done"]) == (SHARD_SIZE, SHARD_SIZE), written
    pool = stack.instance.event_log_storage.get_concurrency_info(f"shard:{SHARED_SHARD}")
    assert pool.slot_count == 1 and pool.claimed_slots == [], "the shard's slot is freed after both runs"


def test_a_run_whose_worker_is_sigkilled_mid_completions_never_blocks_the_next_backfill_of_its_range(stack):
    # a part per row, one request at a time: the kill lands after a committed row, mid-shard, with the next request
    # held on the fleet (the emulator's hold_after), so the dead run certainly left rows to generate
    first, _ = held_after_a_row(stack, KILLED_SHARD, "kill: the run worker")
    [run] = backfill_runs(stack.instance, first)
    tags = stack.instance.get_run_by_id(run.run_id).tags
    worker = int(tags["dflash/worker_pid"])  # the run worker the launcher started, as it recorded itself
    assert worker != os.getpid() and psutil.pid_exists(worker)
    os.kill(worker, signal.SIGKILL)
    committed = completion_rows(stack.data_dir, KILLED_SHARD)
    assert 0 < len(committed) < SHARD_SIZE, committed
    # the same URL, the hold gone, instant decode: how fast the rest is generated is not what is tested
    stack.fleet.start(*FAST)
    # the same range again, at once: it must not wait on what the dead run held
    second = launch_backfill(stack.server, [KILLED_SHARD], "kill: the same range again", ONE_AT_A_TIME)
    backfill = wait_backfill(stack, second)
    assert backfill["status"] == "COMPLETED_SUCCESS", (backfill, failures(stack.instance, second))
    killed = stack.instance.get_run_by_id(run.run_id)
    assert killed.status == dg.DagsterRunStatus.FAILURE, killed.status  # failed through the instance
    rows = completion_rows(stack.data_dir, KILLED_SHARD)
    assert len(rows) == len(set(rows)) == SHARD_SIZE and set(committed) <= set(rows), rows
    for pool in (POOL, f"shard:{KILLED_SHARD}"):
        held = {s.run_id for s in stack.instance.event_log_storage.get_concurrency_info(pool).claimed_slots}
        assert run.run_id not in held, f"the dead run still holds {pool}"
