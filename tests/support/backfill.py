"""The backfill stack the engine tests share: a real `dagster-webserver` and `dagster-daemon run` on a temporary
DAGSTER_HOME made from a given dagster.yaml, one held SGLang emulator attached by URL, and the GraphQL and
event-log readers that judge a backfill (tests/engines/test_backfill.py, test_postgres_instance.py, test_celery.py).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import duckdb
from dagster._core.events import DagsterEventType

from dflash_assets.emulator.process import free_port
from dflash_assets.quality import CHECKS
from tests.support.dagster_procs import (
    ARTIFACTS,
    PROJECT_DAGSTER_YAML,
    Webserver,
    add_shard_partitions,
    daemon,
    dflash_env,
    fresh_dir,
    make_home,
    project_pool_limit,
    wait_daemon_healthy,
    webserver,
)
from tests.support.forks import start_emulator
from tests.support.http import Http, set_faults
from tests.support.shards import questions, write_prompts

POOL = "sglang_fleet"
SHARD_ASSETS = ["prompt_shards", "completions", "length_quality_report"]
SHARD_SIZE = 6
# one more than the pool limit (dagster.yaml: 2): two runs hold the fleet's slots, the third's step waits for one;
# a fourth run would assert nothing more and cost a run process (Dagster and the definitions imported, a report drawn)
POOL_SHARDS = [f"{i:05d}" for i in range(3)]
RESUME_SHARD = "00003"
SHARED_SHARD = "00004"  # two runs of it at once: one writes, the other waits for it
KILLED_SHARD = "00005"  # its run worker SIGKILLed mid-completions, then backfilled again
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

    def faults(self) -> dict:
        """The emulator's fault state and counters (its fault route)."""
        status, body = Http(self.url).get("/_emulator/faults")
        assert status == 200, body
        return body

    def hold(self, on: bool | None) -> None:
        """Hold every generation request from now on (True), or let the held ones go (None)."""
        set_faults(self.url, {"hold": on})

    def release_hold(self) -> None:
        self.hold(None)

    def release_fast(self) -> None:
        """Let the held requests go and decode from now on a hundred times faster (the emulator's slow factor): what
        is left after the moment a test forced, whose speed is not what it tests."""
        set_faults(self.url, {"hold": None, "slow_factor": 0.01})

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


@contextmanager
def open_stack(base: Path, dagster_yaml: Path = PROJECT_DAGSTER_YAML, logs: Path = ARTIFACTS / "logs" / "backfill"):
    """The webserver, the daemon and the held emulator on an instance made from `dagster_yaml`."""
    logs = fresh_dir(logs)  # webserver, daemon and emulator logs, kept for CI
    home = make_home(base / "dagster_home", dagster_yaml)
    write_prompts(base / "prompts.jsonl", questions(SHARD_SIZE * (len(POOL_SHARDS) + 3), end="."))
    fleet = Fleet(logs)
    # DFLASH_SHARDS_PER_RUN=1: one run per shard, so a backfill of N shards is N runs competing for the pool;
    # DFLASH_RETRY_DELAY_S=1: a failed step is retried within 0-2 s (10 s by default, give or take 10: Dagster's
    # jitter), and a retry that comes before the test has started its fleet again waits for it at connect
    env = dflash_env(
        home,
        data_dir=base / "data",
        prompts=base / "prompts.jsonl",
        shard_size=SHARD_SIZE,
        fleet_mode="attach",
        fleet_urls=fleet.url,
        shards_per_run=1,
        retry_delay_s=1,
    )
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
    params = {
        "title": title,
        "partitionsByAssets": [
            {"assetKey": {"path": [asset]}, "partitions": {"range": {"start": shards[0], "end": shards[-1]}}}
            for asset in SHARD_ASSETS
        ],
    }
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
    return sum(
        f"waiting for pool {POOL}" in (entry.user_message or "")
        for run_id in run_ids
        for entry in instance.all_logs(run_id)
    )


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
    return {
        e.dagster_event.event_specific_data.check_name: e.dagster_event.event_specific_data.passed
        for e in instance.all_logs(run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION)
    }


def completion_rows(data_dir: Path, shard: str) -> list[str]:
    files = sorted((data_dir / "completions" / f"shard={shard}").glob("*.parquet"))
    if not files:
        return []
    return [r[0] for r in duckdb.sql(f"select prompt_id from read_parquet({[str(f) for f in files]})").fetchall()]


def latest_completions_metadata(instance: dg.DagsterInstance, shard: str) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[shard]), limit=1
    ).records
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def save(name: str, payload: dict, out: Path = OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def run_logs(instance: dg.DagsterInstance, run_id: str, text: str) -> list:
    return [e for e in instance.all_logs(run_id) if text in (e.user_message or "")]


def check_pool_backfill(stack: Stack, out: Path = OUT) -> None:
    """A backfill over more shards than the pool limit, as the UI launches it: every partition materialised,
    every check evaluated, never more `completions` steps at once than the limit, and steps that waited for it."""
    limit = project_pool_limit()
    assert len(POOL_SHARDS) > limit, "the backfill must be wider than the pool to test it"
    backfill_id = launch_backfill(
        stack.server, POOL_SHARDS, f"pool: shards {POOL_SHARDS[0]}-{POOL_SHARDS[-1]}", IN_PROCESS
    )
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
    runs_overlap = max_overlap(
        [(r.start_time, r.end_time) for r in stack.instance.get_run_records(filters=dg.RunsFilter(run_ids=run_ids))]
    )
    blocked = pool_blocked_events(stack.instance, run_ids)
    sampled = [s for s in stack.samples if s["backfill"] == backfill_id]
    summary = {
        "pool": POOL,
        "limit": limit,
        "shards": len(POOL_SHARDS),
        "runs": len(run_ids),
        "max_concurrent_fleet_pool_holds": peak,
        "max_concurrent_runs": runs_overlap,
        "steps_blocked_by_pool_events": blocked,
        "max_sampled_active_slots": max(s["activeSlotCount"] for s in sampled),
        "max_sampled_pending_steps": max(s["pendingStepCount"] for s in sampled),
        "backfill_seconds": round(backfill["endTimestamp"] - backfill["timestamp"], 1),
        "completions_steps": sorted((round(s - intervals[0][0], 2), round(e - s, 2)) for s, e in intervals),
    }
    save("pool.json", summary, out)
    print("\npool behaviour:", json.dumps({k: v for k, v in summary.items() if k != "completions_steps"}))
    assert peak <= limit, summary
    assert max(s["activeSlotCount"] for s in sampled) <= limit, summary
    assert sampled[-1]["slotCount"] == limit and sampled[-1]["claimedSlots"] == [], "slots freed after the backfill"
    # not vacuous: the fleet was used up to the limit, and steps of the other runs waited for the pool
    assert peak == limit and blocked > 0, summary
