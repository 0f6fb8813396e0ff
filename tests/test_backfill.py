"""Backfills through Dagster's own API, as the UI launches them, on a fleet that must not be oversubscribed.

A real `dagster-webserver` and `dagster-daemon run` share a temporary DAGSTER_HOME whose dagster.yaml is the
project's (run queue, `concurrency.pools.default_limit` for the `sglang_fleet` pool, run monitoring). The fleet
is one SGLang emulator attached by URL (DFLASH_FLEET_MODE=attach, DFLASH_FLEET_URLS) with instant decode.
Backfills are launched with GraphQL `launchPartitionBackfill`, the mutation behind the UI's "Launch
backfill"; the daemon runs them.

1. A backfill over twice as many shards as the pool limit, one run per shard: every partition materialised,
   every check evaluated; the event log shows never more `completions` steps running at once than the limit,
   and steps of the other runs waiting ("waiting for pool sglang_fleet", defs/pools.py). The contention is
   forced, not hoped for: the emulator holds every generation request (its `hold` fault) until the event log
   shows a step blocked by the pool, and only then lets the held steps finish, so however slowly runs start on
   the machine, the first steps are certainly still running when a later one reaches the pool.
2. A shard whose fleet goes down mid-run (the server crashes after two requests) fails its completions step;
   the rows committed before the crash stay; the server is back on the same URL before Dagster retries the
   step (the asset's RetryPolicy), and the retry resumes where it stopped: only the missing prompts are
   generated, no row twice.
3. Two runs of the same shard launched at once (through the run queue and the daemon, as two clicks on
   "Materialize" would): one writes the shard, the other waits for it (one run per shard across the
   deployment, held in the instance's concurrency slots), then finds every row committed and generates none.
   The overlap is forced: the first run's requests are held until the second run says it waits.

What was measured is written to test-artifacts/backfill/ (pool.json, resume.json); the webserver, daemon and
emulator logs to test-artifacts/logs/backfill/.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import duckdb
import psutil
import pytest
from dagster._core.events import DagsterEventType

from dagster_procs import (ARTIFACTS, PROJECT_DAGSTER_YAML, Webserver, add_shard_partitions, daemon, dflash_env,
                           free_port, fresh_dir, make_home, project_pool_limit, wait_daemon_healthy, webserver)
from dflash_assets.emulator.process import start_emulator
from dflash_assets.quality import CHECKS

pytestmark = pytest.mark.timeout(420)

POOL = "sglang_fleet"
SHARD_ASSETS = ["prompt_shards", "completions", "length_quality_report"]
SHARD_SIZE = 6
POOL_SHARDS = [f"{i:05d}" for i in range(4)]  # twice the pool limit
RESUME_SHARD = "00004"
SHARED_SHARD = "00005"  # two runs of it at once: one writes, the other waits for it
KILLED_SHARD = "00006"  # its run worker SIGKILLed mid-completions, then backfilled again
# instant decode; outputs under the default 4096 cap, so the truncation check passes with the default config
FAST = ["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "0", "--length-max", "3000"]
# How long the held generation steps may wait for a later run to reach the full pool: a bound on a slow
# machine, never a timing the test relies on (the hold ends as soon as a step is seen blocked).
BLOCKED_WITHIN_S = 240.0
# Steps run in the run's process: the definitions' executor is `in_process` (a multiprocess step would start a
# new Python process importing Dagster, ~10 s each on a 2-core machine). The pool is enforced the same way by
# either executor: a step claims a slot of its pool from the instance before it starts and frees it at its end.
IN_PROCESS: dict = {}
TERMINAL = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
OUT = ARTIFACTS / "backfill"


class Fleet:
    """One emulator on a fixed port, so the URL the daemon was given stays the same across restarts."""

    def __init__(self, log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.proc = None
        self.starts = 0

    def start(self, *flags: str) -> None:
        self.stop()
        self.starts += 1
        self.proc = start_emulator(list(flags), port=self.port, log_path=self.log_dir / f"emulator-{self.starts}.log")

    def release_hold(self) -> None:
        """Let the held generation requests go (the emulator's fault route)."""
        request = urllib.request.Request(f"{self.url}/_emulator/faults", data=json.dumps({"hold": None}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


@dataclass
class Stack:
    server: Webserver
    instance: dg.DagsterInstance
    fleet: Fleet
    data_dir: Path
    samples: list[dict] = field(default_factory=list)


def write_prompts(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({"id": f"p{i:04d}", "prompt": f"Question {i}: explain topic {i * 7 % 13}."})
                            + "\n" for i in range(n)))


@contextmanager
def open_stack(base: Path, dagster_yaml: Path = PROJECT_DAGSTER_YAML, logs: Path = ARTIFACTS / "logs" / "backfill"):
    """The webserver, the daemon and the held emulator on an instance made from `dagster_yaml`."""
    logs = fresh_dir(logs)  # webserver, daemon and emulator logs, kept for CI
    home = make_home(base / "dagster_home", dagster_yaml)
    write_prompts(base / "prompts.jsonl", SHARD_SIZE * (len(POOL_SHARDS) + 3))
    fleet = Fleet(logs)
    # DFLASH_SHARDS_PER_RUN=1: one run per shard, so a backfill of N shards is N runs competing for the pool
    env = dflash_env(home, data_dir=base / "data", prompts=base / "prompts.jsonl", shard_size=SHARD_SIZE,
                     fleet_mode="attach", fleet_urls=fleet.url, shards_per_run=1)
    fleet.start(*FAST, "--fault-hold")
    try:
        # the daemon boots while the webserver loads the code location
        with daemon(home, env, log_dir=logs) as daemon_proc, webserver(home, env, log_dir=logs) as server:
            wait_daemon_healthy(server, daemon_proc)
            add_shard_partitions(server, [*POOL_SHARDS, RESUME_SHARD, SHARED_SHARD, KILLED_SHARD])
            with dg.DagsterInstance.from_config(str(home)) as instance:
                yield Stack(server, instance, fleet, base / "data")
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with open_stack(tmp_path_factory.mktemp("backfill")) as opened:
        yield opened


# --- GraphQL ----------------------------------------------------------------------------------------------

LAUNCH = """mutation($params: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $params) {
  __typename ... on LaunchBackfillSuccess { backfillId } ... on Error { message } } }"""

REEXECUTE = """mutation($params: ReexecutionParams!) { reexecutePartitionBackfill(reexecutionParams: $params) {
  __typename ... on LaunchBackfillSuccess { backfillId } ... on Error { message } } }"""

STATUS = """query($id: String!) { partitionBackfillOrError(backfillId: $id) { __typename
  ... on PartitionBackfill { id status numPartitions timestamp endTimestamp error { message }
    assetBackfillData { assetBackfillStatuses { ... on AssetPartitionsStatusCounts { assetKey { path }
      numPartitionsTargeted numPartitionsInProgress numPartitionsMaterialized numPartitionsFailed } } } }
  ... on Error { message } } }"""

POOL_USAGE = """query($pool: String!) { instance { concurrencyLimit(concurrencyKey: $pool) {
  slotCount limit activeSlotCount pendingStepCount claimedSlots { runId stepKey } } } }"""


def launch_backfill(server: Webserver, shards: list[str], title: str, run_config: dict | None = None) -> str:
    params = {"title": title, "partitionsByAssets": [
        {"assetKey": {"path": [asset]}, "partitions": {"range": {"start": shards[0], "end": shards[-1]}}}
        for asset in SHARD_ASSETS]}
    if run_config:
        params["runConfigData"] = run_config
    result = server.gql(LAUNCH, {"params": params})["launchPartitionBackfill"]
    assert result["__typename"] == "LaunchBackfillSuccess", result
    return result["backfillId"]


def wait_backfill(stack: Stack, backfill_id: str, timeout_s: float = 240.0) -> dict:
    """Poll the backfill until it ends, sampling the pool's slot usage meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        backfill = stack.server.gql(STATUS, {"id": backfill_id})["partitionBackfillOrError"]
        assert backfill["__typename"] == "PartitionBackfill", backfill
        usage = stack.server.gql(POOL_USAGE, {"pool": POOL})["instance"]["concurrencyLimit"]
        stack.samples.append({"t": time.time(), "backfill": backfill_id, **usage})
        if backfill["status"] in TERMINAL:
            return backfill
        assert time.monotonic() < deadline, f"backfill {backfill_id} still {backfill['status']} after {timeout_s}s"
        time.sleep(1.0)


def counts_by_asset(backfill: dict) -> dict[str, dict]:
    return {s["assetKey"]["path"][-1]: s for s in backfill["assetBackfillData"]["assetBackfillStatuses"]}


# --- the event log --------------------------------------------------------------------------------------

def backfill_runs(instance: dg.DagsterInstance, backfill_id: str) -> list:
    return list(instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id})))


def step_intervals(instance: dg.DagsterInstance, run_ids: list[str], step_key: str) -> list[tuple[float, float]]:
    """(start, end) of every execution of `step_key` in the runs, from STEP_START to STEP_SUCCESS/FAILURE."""
    kinds = {DagsterEventType.STEP_START, DagsterEventType.STEP_SUCCESS, DagsterEventType.STEP_FAILURE}
    intervals = []
    for run_id in run_ids:
        start = None
        for entry in instance.all_logs(run_id, of_type=kinds):
            if entry.step_key != step_key:
                continue
            if entry.dagster_event.event_type == DagsterEventType.STEP_START:
                start = entry.timestamp
            elif start is not None:
                intervals.append((start, entry.timestamp))
                start = None
        assert start is None, f"run {run_id}: {step_key} started and never ended"
    return intervals


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at t comes before a start at t)."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, delta in edges:
        running += delta
        peak = max(peak, running)
    return peak


def pool_blocked_events(instance: dg.DagsterInstance, run_ids: list[str]) -> int:
    return sum(f"waiting for pool {POOL}" in (entry.user_message or "")
               for run_id in run_ids for entry in instance.all_logs(run_id))


def pool_intervals(instance: dg.DagsterInstance, run_ids: list[str], step_key: str = "completions") -> list:
    """(start, end) of every hold of the fleet's pool, from the step's log (a step that waits for the pool has
    started, and waits inside it: defs/pools.py): "holds pool" is written after the claim, "releasing pools" before
    the slots are freed, so each interval lies within the real hold."""
    intervals = []
    for run_id in run_ids:
        start = None
        for entry in instance.all_logs(run_id):
            if entry.step_key != step_key:
                continue
            if entry.user_message == f"holds pool {POOL}":
                start = entry.timestamp
            elif (entry.user_message or "").startswith("releasing pools") and start is not None:
                intervals.append((start, entry.timestamp))
                start = None
    return intervals


def failures(instance: dg.DagsterInstance, backfill_id: str) -> list[str]:
    """The step failures of a backfill's runs, for assertion messages."""
    found = []
    for run in backfill_runs(instance, backfill_id):
        for entry in instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_FAILURE):
            error = entry.dagster_event.event_specific_data.error
            found.append(f"{run.run_id[:8]} {entry.step_key}: {error.to_string()[-1500:] if error else entry.message}")
    return found


def check_evaluations(instance: dg.DagsterInstance, run_id: str) -> dict[str, bool]:
    return {e.dagster_event.event_specific_data.check_name: e.dagster_event.event_specific_data.passed
            for e in instance.all_logs(run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION)}


def completion_rows(data_dir: Path, shard: str) -> list[str]:
    files = sorted((data_dir / "completions" / f"shard={shard}").glob("*.parquet"))
    if not files:
        return []
    return [r[0] for r in duckdb.sql(f"select prompt_id from read_parquet({[str(f) for f in files]})").fetchall()]


def latest_completions_metadata(instance: dg.DagsterInstance, shard: str) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[shard]), limit=1).records
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def save(name: str, payload: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(json.dumps(payload, indent=2, default=str) + "\n")


# --- the tests ------------------------------------------------------------------------------------------

def test_a_backfill_wider_than_the_pool_never_runs_more_generation_steps_than_the_limit(stack):
    limit = project_pool_limit()
    assert len(POOL_SHARDS) > limit, "the backfill must be wider than the pool to test it"
    backfill_id = launch_backfill(stack.server, POOL_SHARDS, f"pool: shards {POOL_SHARDS[0]}-{POOL_SHARDS[-1]}",
                                  IN_PROCESS)
    # the first steps to claim the pool hold the fleet (their requests are held) until a later run's
    # completions step is blocked by the full pool; then they are let go
    deadline = time.monotonic() + BLOCKED_WITHIN_S
    while not pool_blocked_events(stack.instance, [r.run_id for r in backfill_runs(stack.instance, backfill_id)]):
        assert time.monotonic() < deadline, f"no step was blocked by the pool within {BLOCKED_WITHIN_S}s"
        time.sleep(0.5)
    stack.fleet.release_hold()
    backfill = wait_backfill(stack, backfill_id)

    counts = counts_by_asset(backfill)
    assert backfill["status"] == "COMPLETED_SUCCESS", (backfill, failures(stack.instance, backfill_id))
    for asset in SHARD_ASSETS:
        assert counts[asset]["numPartitionsTargeted"] == len(POOL_SHARDS), counts[asset]
        assert counts[asset]["numPartitionsMaterialized"] == len(POOL_SHARDS), counts[asset]
        assert counts[asset]["numPartitionsFailed"] == 0, counts[asset]

    runs = backfill_runs(stack.instance, backfill_id)
    run_ids = [r.run_id for r in runs]
    assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
    # every run evaluated every check, and the blocking ones passed
    for run_id in run_ids:
        evaluations = check_evaluations(stack.instance, run_id)
        assert set(evaluations) == {c.name for c in CHECKS}, run_id
        assert all(evaluations[c.name] for c in CHECKS if c.blocking), (run_id, evaluations)
    # rows: every prompt of every shard once
    for shard in POOL_SHARDS:
        rows = completion_rows(stack.data_dir, shard)
        assert len(rows) == len(set(rows)) == SHARD_SIZE, shard

    # the pool: never more completions steps at once than the limit, though more runs than that were live
    intervals = pool_intervals(stack.instance, run_ids)
    assert len(intervals) == len(step_intervals(stack.instance, run_ids, "completions")) == len(POOL_SHARDS)
    assert len(run_ids) > limit
    peak = max_overlap(intervals)
    runs_overlap = max_overlap([(r.start_time, r.end_time) for r in stack.instance.get_run_records(
        filters=dg.RunsFilter(run_ids=run_ids))])
    blocked = pool_blocked_events(stack.instance, run_ids)
    sampled = [s for s in stack.samples if s["backfill"] == backfill_id]
    summary = {
        "pool": POOL, "limit": limit, "shards": len(POOL_SHARDS), "runs": len(run_ids),
        "max_concurrent_fleet_pool_holds": peak, "max_concurrent_runs": runs_overlap,
        "steps_blocked_by_pool_events": blocked,
        "max_sampled_active_slots": max(s["activeSlotCount"] for s in sampled),
        "max_sampled_pending_steps": max(s["pendingStepCount"] for s in sampled),
        "backfill_seconds": round(backfill["endTimestamp"] - backfill["timestamp"], 1),
        "completions_steps": sorted((round(s - intervals[0][0], 2), round(e - s, 2)) for s, e in intervals),
    }
    save("pool.json", summary)
    print("\npool behaviour:", json.dumps({k: v for k, v in summary.items() if k != "completions_steps"}))
    assert peak <= limit, summary
    assert max(s["activeSlotCount"] for s in sampled) <= limit, summary
    assert sampled[-1]["slotCount"] == limit and sampled[-1]["claimedSlots"] == [], "slots freed after the backfill"
    # not vacuous: the fleet was used up to the limit, and steps of the other runs waited for the pool
    assert peak == limit and blocked > 0, summary


RESUME_CONFIG = {**IN_PROCESS, "ops": {"completions": {"config": {
    "commit_rows": 1,  # commit every row, so the crash leaves committed rows behind
    "max_in_flight_per_server": 2, "max_attempts": 2, "no_server_timeout_s": 3}}}}


def test_a_partition_whose_fleet_goes_down_is_retried_by_dagster_and_resumes(stack):
    # the server crashes when generation request 3 arrives: a row or two committed, then no server; the step fails
    stack.fleet.start(*FAST, "--fault-crash-after", "2")
    backfill_id = launch_backfill(stack.server, [RESUME_SHARD], "resume: fleet goes down", RESUME_CONFIG)
    deadline = time.monotonic() + BLOCKED_WITHIN_S
    while not (retries := [e for r in backfill_runs(stack.instance, backfill_id)
                           for e in stack.instance.all_logs(r.run_id, of_type=DagsterEventType.STEP_UP_FOR_RETRY)]):
        assert time.monotonic() < deadline, f"the failed step was not put up for retry within {BLOCKED_WITHIN_S}s"
        time.sleep(0.5)
    [retry] = retries
    error = retry.dagster_event.event_specific_data.error
    assert retry.step_key == "completions" and "no healthy server" in error.to_string(), error.to_string()
    assert not stack.fleet.alive(), "the emulator was to crash"
    committed = completion_rows(stack.data_dir, RESUME_SHARD)
    assert 0 < len(committed) < SHARD_SIZE, committed

    # the server is back on the same URL before the retry (RetryPolicy delay): Dagster retries the step itself
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
    save("resume.json", {"retried_after": error.message.strip(),
                         "committed_before_crash": len(committed), "already_done_on_retry": meta["already_done"],
                         "rows_after_retry": len(rows), "backfill": backfill_id,
                         "backfill_seconds": round(backfill["endTimestamp"] - backfill["timestamp"], 1)})


def run_logs(instance: dg.DagsterInstance, run_id: str, text: str) -> list:
    return [e for e in instance.all_logs(run_id) if text in (e.user_message or "")]


def test_two_runs_of_the_same_shard_at_once_write_it_one_after_the_other(stack):
    stack.fleet.start(*FAST, "--fault-hold")  # the writer's generation requests are held until released
    run_ids = [stack.server.client.submit_job_execution("shard_pipeline", run_config=IN_PROCESS,
                                                        tags={"dagster/partition": SHARED_SHARD})
               for _ in range(2)]
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
    written = {m.event_log_entry.run_id: {k: v.value for k, v in m.asset_materialization.metadata.items()}
               for m in stack.instance.fetch_materializations(dg.AssetRecordsFilter(
                   asset_key=dg.AssetKey("completions"), asset_partitions=[SHARED_SHARD]), limit=2).records}
    # the waiter found every row committed: it generated only after the writer had finished the shard
    assert (written[writer]["completed"], written[waiter]["already_done"]) == (SHARD_SIZE, SHARD_SIZE), written
    pool = stack.instance.event_log_storage.get_concurrency_info(f"shard:{SHARED_SHARD}")
    assert pool.slot_count == 1 and pool.claimed_slots == [], "the shard's slot is freed after both runs"


def test_a_run_whose_worker_is_sigkilled_mid_completions_never_blocks_the_next_backfill_of_its_range(stack):
    # slow decoding, one request at a time, a part per row: the kill lands after a committed row, mid-shard
    stack.fleet.start(*FAST[:2], "--decode-tokens-per-s", "300", "--length-max", "3000")
    config = {**IN_PROCESS, "ops": {"completions": {"config": {"commit_rows": 1, "max_in_flight_per_server": 1}}}}
    first = launch_backfill(stack.server, [KILLED_SHARD], "kill: the run worker", config)
    wait = time.monotonic() + BLOCKED_WITHIN_S
    while not completion_rows(stack.data_dir, KILLED_SHARD):
        assert time.monotonic() < wait, f"no row of shard {KILLED_SHARD} committed within {BLOCKED_WITHIN_S}s"
        time.sleep(0.2)
    [run] = backfill_runs(stack.instance, first)
    tags = stack.instance.get_run_by_id(run.run_id).tags
    worker = int(tags["dflash/worker_pid"])  # the run worker the launcher started, as it recorded itself
    assert worker != os.getpid() and psutil.pid_exists(worker)
    os.kill(worker, signal.SIGKILL)
    committed = completion_rows(stack.data_dir, KILLED_SHARD)
    assert 0 < len(committed) < SHARD_SIZE, committed
    # the same range again, at once: it must not wait on what the dead run held
    second = launch_backfill(stack.server, [KILLED_SHARD], "kill: the same range again", config)
    backfill = wait_backfill(stack, second)
    assert backfill["status"] == "COMPLETED_SUCCESS", (backfill, failures(stack.instance, second))
    killed = stack.instance.get_run_by_id(run.run_id)
    assert killed.status == dg.DagsterRunStatus.FAILURE, killed.status  # failed through the instance
    rows = completion_rows(stack.data_dir, KILLED_SHARD)
    assert len(rows) == len(set(rows)) == SHARD_SIZE and set(committed) <= set(rows), rows
    for pool in (POOL, f"shard:{KILLED_SHARD}"):
        held = {s.run_id for s in stack.instance.event_log_storage.get_concurrency_info(pool).claimed_slots}
        assert run.run_id not in held, f"the dead run still holds {pool}"
