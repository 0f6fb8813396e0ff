"""The whole `dagster dev` (webserver, daemon, code server and the run workers they launched) SIGKILLed at once in the
middle of a UI backfill, then started again.

`dagster dev -w workspace.yaml` on a temporary DAGSTER_HOME with the project's dagster.yaml, one emulator attached by
URL (it is not in dagster dev's process group, as a GPU fleet is not). A backfill of 3 shards, one run per shard, is
launched with GraphQL `launchPartitionBackfill` (the UI's "Launch backfill"). The kill lands where it hurts, forced:
a part of completions is committed on disk, then the emulator holds every request in flight, and the group is killed
once every run of the backfill has reached its completions step (the pool's two holders generating, the third
waiting for the pool): three runs the instance still calls STARTED, holding slots.

On the next start, `dead_runs_sensor` fails the dead runs, with the reason, and frees their slots; the backfill then
ends with those partitions failed. The rest runs the way a person does it in the UI: the backfill re-executed from
its failed runs (`reexecutePartitionBackfill`, FROM_FAILURE: "Re-execute" on the backfill's page). It resumes from
the committed parts: every prompt once. (Dagster's run retries, which would resume by themselves, are not enabled:
they would also re-run every run a blocking check failed; docs/guarantees.md.)

Logs: test-artifacts/logs/whole_stack/ (both dagster dev's, the emulator's).
"""

from __future__ import annotations

import os
import signal
import time

import dagster as dg
import psutil
import pytest
from dagster._core.events import DagsterEventType

from dflash_assets.defs.pools import FLEET_POOL, PID_TAG, shard_pool
from tests.support.backfill import (
    FAST,
    REEXECUTE,
    TERMINAL,
    Fleet,
    Stack,
    backfill_runs,
    completion_rows,
    failures,
    launch_backfill,
    save,
    wait_backfill,
)
from tests.support.dagster_procs import (
    ARTIFACTS,
    add_shard_partitions,
    dagster_dev,
    dflash_env,
    fresh_dir,
    make_home,
)
from tests.support.shards import questions, write_prompts

pytestmark = [pytest.mark.timeout(600), pytest.mark.long]

# one more than the fleet pool's limit (2): runs killed holding its slots and a run killed waiting for one
SHARDS = [f"{i:05d}" for i in range(3)]
SHARD_SIZE = 4
# decoding takes a second or two per row, one row in flight, a part per row: the kill lands mid-shard
SLOW = ["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "300", "--length-max", "600"]
CONFIG = {"ops": {"completions": {"config": {"commit_rows": 1, "max_in_flight_per_server": 1}}}}
BOUND_S = 240.0  # a bound on a slow machine, never a timing the test relies on


def until(what, message: str, bound_s: float = BOUND_S):
    deadline = time.monotonic() + bound_s
    while not (value := what()):
        assert time.monotonic() < deadline, f"{message} (not within {bound_s:.0f}s)"
        time.sleep(0.5)
    return value


def committed(data) -> dict[str, list[str]]:
    return {shard: completion_rows(data, shard) for shard in SHARDS}


def held_by(instance: dg.DagsterInstance, run_ids: set[str]) -> dict[str, set[str]]:
    """pool -> the given runs that still claim a slot of it."""
    pools = [FLEET_POOL, *(shard_pool(s) for s in SHARDS)]
    infos = instance.event_log_storage.get_concurrency_infos(pools)
    return {p: {s.run_id for s in i.claimed_slots} & run_ids for p, i in infos.items()}


def test_the_whole_dagster_dev_killed_mid_backfill_then_started_again_fails_the_dead_runs_and_loses_nothing(tmp_path):
    logs = fresh_dir(ARTIFACTS / "logs" / "whole_stack")
    home, data = make_home(tmp_path / "dagster_home"), tmp_path / "data"
    write_prompts(tmp_path / "prompts.jsonl", questions(SHARD_SIZE * len(SHARDS), end="."))
    fleet = Fleet(logs)
    env = dflash_env(
        home,
        data_dir=data,
        prompts=tmp_path / "prompts.jsonl",
        shard_size=SHARD_SIZE,
        fleet_mode="attach",
        fleet_urls=fleet.url,
        shards_per_run=1,
    )
    fleet.start(*SLOW)
    t0, at = time.monotonic(), {}  # seconds from the start to each step, saved for the record
    try:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            with dagster_dev(home, env, log_dir=logs / "first") as (server, dev):
                add_shard_partitions(server, SHARDS)
                backfill_id = launch_backfill(server, SHARDS, "whole stack: killed", CONFIG)
                until(lambda: any(committed(data).values()), "a part of completions committed on disk")
                fleet.hold(True)  # what is in flight stays in flight: the runs die holding their slots
                runs = until(
                    lambda: (
                        (r := backfill_runs(instance, backfill_id))
                        and len(r) == len(SHARDS)
                        and all(PID_TAG in instance.get_run_by_id(x.run_id).tags for x in r)
                        and r
                    ),
                    "every run of the backfill in its completions step",
                )
                workers = [int(instance.get_run_by_id(r.run_id).tags[PID_TAG]) for r in runs]
                at["killed"] = time.monotonic() - t0
                os.killpg(dev.pid, signal.SIGKILL)  # webserver, daemon, code server, run workers: the group
                dev.wait(timeout=30)
                until(lambda: not any(psutil.pid_exists(p) for p in workers), "the run workers died with the group", 30)
            kept = committed(data)
            dead = {r.run_id for r in runs}
            assert 0 < sum(map(len, kept.values())) < SHARD_SIZE * len(SHARDS), kept
            assert {instance.get_run_by_id(r).status for r in dead} == {dg.DagsterRunStatus.STARTED}
            assert held_by(instance, dead)[FLEET_POOL], "the killed runs were to die holding the fleet's slots"
            fleet.start(*FAST)  # the same URL, the hold gone, instant decode: the rest runs fast

            with dagster_dev(home, env, log_dir=logs / "again") as (server, _):
                stack = Stack(server, instance, fleet, data)
                at["started_again"] = time.monotonic() - t0
                # dead_runs_sensor: the dead runs failed, with the reason, and what they held freed
                until(
                    lambda: all(instance.get_run_by_id(r).status == dg.DagsterRunStatus.FAILURE for r in dead),
                    "the dead runs failed on the next start",
                )
                at["dead_runs_failed"] = time.monotonic() - t0
                for run_id in dead:
                    [failed] = instance.all_logs(run_id, of_type=DagsterEventType.RUN_FAILURE)
                    assert "is gone: killed or crashed" in failed.message, failed.message
                assert not any(held_by(instance, dead).values()), held_by(instance, dead)
                first = wait_backfill(stack, backfill_id)
                assert first["status"] in TERMINAL - {"COMPLETED_SUCCESS"}, first
                at["backfill_ended"] = time.monotonic() - t0
                # the rest: the backfill re-executed from its failed runs, as the UI's "Re-execute" does
                again = server.gql(REEXECUTE, {"params": {"parentRunId": backfill_id, "strategy": "FROM_FAILURE"}})
                again = again["reexecutePartitionBackfill"]
                assert again["__typename"] == "LaunchBackfillSuccess", again
                rest = wait_backfill(stack, again["backfillId"])
                assert rest["status"] == "COMPLETED_SUCCESS", (rest, failures(instance, again["backfillId"]))
                at["reexecuted_backfill_done"] = time.monotonic() - t0
                assert not any(
                    held_by(instance, {r.run_id for r in backfill_runs(instance, again["backfillId"])}).values()
                )
    finally:
        fleet.stop()
    rows = committed(data)
    save(
        "whole_stack.json",
        {
            "seconds": {k: round(v, 1) for k, v in at.items()},
            "rows_committed_before_the_kill": sum(map(len, kept.values())),
            "runs_killed": len(dead),
            "first_backfill_status": first["status"],
            "rows_after": sum(map(len, rows.values())),
        },
    )
    for shard in SHARDS:
        assert len(rows[shard]) == len(set(rows[shard])) == SHARD_SIZE, (shard, rows[shard])
        assert set(kept[shard]) <= set(rows[shard]), "a committed row was lost"
