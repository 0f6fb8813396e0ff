"""Runs on several workers: deploy/dagster-celery.yaml (Postgres instance, Dagster's Celery run launcher over a
Redis broker) with two `dagster-celery worker start` processes (deploy/celery-worker.yaml), the webserver and the
daemon, all on loopback: the engine the README recommends past one machine, as a user deploys it.

Why the run launcher and not the Celery executor is said in deploy/dagster-celery.yaml. Each worker runs one run
at a time (-c 1); a worker is told apart by its process group (each is started in its own session), and the
process that executed a step by the pid Dagster records on the step's events.

1. A backfill of three shards (one run each, more than the workers): the runs' steps execute in the workers, both
   workers take runs (the emulator holds generation until two `completions` steps are running, so neither worker can
   take them all), and every shard's rows are exactly once.
2. (Runs last: a killed run keeps its `sglang_fleet` slot until run monitoring frees it, 300 s later.)
   The worker process executing `completions` is SIGKILLed after rows were committed, with requests in flight
   (held by the emulator): Celery reports the task failed, run monitoring fails the run, a re-execution from
   failure (the UI's button) runs on a worker, the step runs again from the committed parts, and the shard's rows
   equal an uninterrupted run's, row for row.
3. Two runs of one shard at once (a re-execution during a backfill), the first held mid-generation on one
   worker: the second, on the other worker, waits in its `completions` step for the shard's one-slot pool in the
   shared Postgres instance (defs/pools.py) and says so; once the first is released and done, the
   second finds every row committed and generates nothing. The rows exactly once.

Logs: test-artifacts/logs/celery/ (workers, webserver, daemon, emulator); figures: test-artifacts/celery/.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import duckdb
import pytest
import yaml
from dagster._core.events import DagsterEventType

from tests.support import backfill, waiting
from tests.support.dagster_procs import (
    ARTIFACTS,
    PROJECT_DAGSTER_YAML,
    ROOT,
    Webserver,
    add_shard_partitions,
    daemon,
    dflash_env,
    fresh_dir,
    make_home,
    materialize_shards,
    start_group,
    stop_groups,
    wait_daemon_healthy,
    webserver,
)
from tests.support.services import environ
from tests.support.shards import questions, write_prompts

pytestmark = pytest.mark.timeout(420)

DEPLOY_CELERY_YAML = ROOT / "deploy" / "dagster-celery.yaml"
WORKER_YAML = ROOT / "deploy" / "celery-worker.yaml"
LOGS = ARTIFACTS / "logs" / "celery"
OUT = ARTIFACTS / "celery"
SHARD_SIZE = 8
SPREAD = [f"{i:05d}" for i in range(3)]  # one run more than the workers: a fourth would assert nothing more
KILLED, TWICE = "00003", "00004"
SHARDS = [*SPREAD, KILLED, TWICE]
# decode slow enough that a shard takes a few seconds: rows are committed one by one while others are in flight
FLEET = ["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "600", "--length-max", "900"]
# rows committed one by one, and two requests in flight at a time, so some are sent after the hold is set
ONE_ROW_COMMITS = {"ops": {"completions": {"config": {"commit_rows": 1, "max_in_flight_per_server": 2}}}}
WORKERS = 2


@dataclass
class Cluster:
    server: Webserver
    instance: dg.DagsterInstance
    fleet: backfill.Fleet
    workers: dict[int, str]  # process group -> worker name
    data_dir: Path
    env: dict[str, str]
    base: Path
    samples: list = field(default_factory=list)  # pool usage, sampled by tests.support.backfill.wait_backfill


def test_the_celery_instance_has_the_run_queue_and_pool_of_the_local_one():
    local, deploy = (yaml.safe_load(p.read_text()) for p in (PROJECT_DAGSTER_YAML, DEPLOY_CELERY_YAML))
    assert deploy["concurrency"] == local["concurrency"]
    assert deploy["run_monitoring"].items() >= local["run_monitoring"].items()
    assert deploy["run_launcher"]["class"] == "CeleryRunLauncher" and set(deploy["storage"]) == {"postgres"}
    worker = yaml.safe_load(WORKER_YAML.read_text())["execution"]["config"]
    assert worker["config_source"] == deploy["run_launcher"]["config"]["config_source"]
    # Kubernetes is not exercised here; its instance differs from this tested one by the run launcher only
    k8s = yaml.safe_load((ROOT / "deploy" / "dagster-k8s.yaml").read_text())
    assert {k: v for k, v in k8s.items() if k != "run_launcher"} == {
        k: v for k, v in deploy.items() if k != "run_launcher"
    }


wait_for = functools.partial(waiting.wait_for, timeout_s=180.0, every_s=0.5, hint=f"logs: {LOGS}")


@pytest.fixture(scope="module")
def cluster(postgres, redis_broker, tmp_path_factory):
    base = tmp_path_factory.mktemp("celery")
    logs = fresh_dir(LOGS)
    settings = {
        **postgres.database("celery"),
        "DAGSTER_CELERY_BROKER_URL": redis_broker.url,
        "DAGSTER_CELERY_BACKEND_URL": redis_broker.url,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    with environ(settings):
        home = make_home(base / "dagster_home", DEPLOY_CELERY_YAML)
        write_prompts(base / "prompts.jsonl", questions(SHARD_SIZE * len(SHARDS), end="."))
        fleet = backfill.Fleet(logs)
        env = dflash_env(
            home,
            data_dir=base / "data",
            prompts=base / "prompts.jsonl",
            shard_size=SHARD_SIZE,
            fleet_mode="attach",
            fleet_urls=fleet.url,
            shards_per_run=1,
        )
        fleet.start(*FLEET, "--fault-hold")
        procs = [
            start_group(
                [
                    "dagster-celery",
                    "worker",
                    "start",
                    "-A",
                    "dagster_celery.app",
                    "-y",
                    str(WORKER_YAML),
                    "-n",
                    f"worker{i}",
                    "--",
                    "-c",
                    "1",
                ],
                env,
                logs / f"worker{i}.log",
            )
            for i in range(WORKERS)
        ]
        try:
            with daemon(home, env, log_dir=logs) as daemon_proc, webserver(home, env, log_dir=logs) as server:
                wait_daemon_healthy(server, daemon_proc)
                add_shard_partitions(server, SHARDS)
                with dg.DagsterInstance.from_config(str(home)) as instance:
                    celery = instance.run_launcher.celery
                    wait_for("both Celery workers answer", lambda: len(celery.control.ping(timeout=1.0)) == WORKERS)
                    yield Cluster(
                        server,
                        instance,
                        fleet,
                        {p.pid: f"worker{i}" for i, p in enumerate(procs)},
                        base / "data",
                        env,
                        base,
                    )
        finally:
            stop_groups(procs)
            fleet.stop()


def step_pids(instance: dg.DagsterInstance, run_id: str, step_key: str) -> list[int]:
    return [
        e.dagster_event.pid
        for e in instance.all_logs(run_id, of_type=DagsterEventType.STEP_START)
        if e.step_key == step_key
    ]


def worker_of(cluster: Cluster, pid: int) -> str:
    """The worker whose process group holds `pid` (each worker, with its pool processes, is its own session)."""
    try:
        return cluster.workers.get(os.getpgid(pid), f"not a worker (pid {pid})")
    except ProcessLookupError:
        return f"gone (pid {pid})"


def runs_of(cluster: Cluster, backfill_id: str) -> list:
    return backfill.backfill_runs(cluster.instance, backfill_id)


def rows(data_dir: Path, shard: str, columns: str = "prompt_id") -> list[tuple]:
    files = sorted((data_dir / "completions" / f"shard={shard}").glob("*.parquet"))
    if not files:
        return []
    return duckdb.sql(f"select {columns} from read_parquet({[str(f) for f in files]}) order by prompt_id").fetchall()


def runs_said(cluster: Cluster, *backfill_ids: str) -> str:
    """Each run of the backfills: its status, the worker of its completions step, and its last events."""
    lines = []
    for backfill_id in backfill_ids:
        for run in runs_of(cluster, backfill_id):
            on = [worker_of(cluster, pid) for pid in step_pids(cluster.instance, run.run_id, "completions")]
            lines.append(f"backfill {backfill_id}, run {run.run_id}: {run.status.value}, completions on {on}")
            events = cluster.instance.all_logs(run.run_id)[-8:]
            lines += [
                f"    {e.step_key or '-'}: {(e.user_message or e.dagster_event_type or '')[:300]}" for e in events
            ]
    return "\n".join(lines)


def save(name: str, payload: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def test_the_runs_of_a_backfill_execute_on_both_workers_and_each_shard_is_written_once(cluster):
    backfill_id = backfill.launch_backfill(cluster.server, SPREAD, "celery: three shards")

    def completions_running() -> int:
        return sum(bool(step_pids(cluster.instance, r.run_id, "completions")) for r in runs_of(cluster, backfill_id))

    # each worker runs one run at a time: while two completions steps are held, two workers are busy
    wait_for("two completions steps running", lambda: completions_running() >= 2)
    cluster.fleet.release_fast()
    result = backfill.wait_backfill(cluster, backfill_id)
    assert result["status"] == "COMPLETED_SUCCESS", (result, backfill.failures(cluster.instance, backfill_id))

    placed = {}
    for run in runs_of(cluster, backfill_id):
        assert run.status == dg.DagsterRunStatus.SUCCESS
        shard = run.tags["dagster/asset_partition_range_start"]  # one shard per run (DFLASH_SHARDS_PER_RUN=1)
        placed[shard] = {
            step: [worker_of(cluster, pid) for pid in step_pids(cluster.instance, run.run_id, step)]
            for step in backfill.SHARD_ASSETS
        }
    save("placement.json", placed)
    for shard in SPREAD:
        ids = [r[0] for r in rows(cluster.data_dir, shard)]
        assert len(ids) == len(set(ids)) == SHARD_SIZE, shard
        # a run executes whole on one worker: its steps in that worker's process
        [worker] = {w for workers in placed[shard].values() for w in workers}
        assert worker in cluster.workers.values(), placed
    assert {placed[s]["completions"][0] for s in SPREAD} == set(cluster.workers.values()), placed


def test_two_runs_of_one_shard_at_once_never_write_it_together(cluster):
    held_before = cluster.fleet.faults()["injected"]["hold"]
    cluster.fleet.hold(True)
    first = backfill.launch_backfill(cluster.server, [TWICE], "celery: a shard")
    wait_for("the first run generating", lambda: cluster.fleet.faults()["injected"]["hold"] > held_before)
    second = backfill.launch_backfill(cluster.server, [TWICE], "celery: the same shard again")
    waiting = f"waiting for pool shard:{TWICE}"
    wait_for(
        "the second run waiting for the shard",
        lambda: any(backfill.run_logs(cluster.instance, r.run_id, waiting) for r in runs_of(cluster, second)),
        explain=lambda: runs_said(cluster, first, second),
    )
    cluster.fleet.release_fast()
    for backfill_id in (first, second):
        backfill.wait_backfill(cluster, backfill_id)
    [first_run], [second_run] = runs_of(cluster, first), runs_of(cluster, second)
    ids = [r[0] for r in rows(cluster.data_dir, TWICE)]
    [said] = backfill.run_logs(cluster.instance, second_run.run_id, waiting)
    on = {
        name: [worker_of(cluster, pid) for pid in step_pids(cluster.instance, run.run_id, "completions")]
        for name, run in (("first", first_run), ("second", second_run))
    }
    written = {
        m.event_log_entry.run_id: {k: v.value for k, v in m.asset_materialization.metadata.items()}
        for m in cluster.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[TWICE]), limit=2
        ).records
    }
    save(
        "same_shard.json",
        {
            "first": first_run.status,
            "second": second_run.status,
            "completions_on": on,
            "second_said": said.user_message,
            "rows": len(ids),
            "second_already_done": written[second_run.run_id]["already_done"],
        },
    )
    assert (first_run.status, second_run.status) == (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.SUCCESS)
    assert on["first"] != on["second"], on  # one held a worker, so the other run went to the other worker
    assert first_run.run_id in said.user_message, said.user_message  # it names the run writing the shard
    assert len(ids) == len(set(ids)) == SHARD_SIZE
    # the second found every row committed: it wrote nothing while the first was writing
    assert (written[first_run.run_id]["completed"], written[second_run.run_id]["already_done"]) == (
        SHARD_SIZE,
        SHARD_SIZE,
    ), written


def recovered(cluster: Cluster, backfill_id: str) -> str:
    """Run monitoring sees the killed run's Celery task failed and fails the run, the backfill ends failed; then
    "Re-execute from failure", as in the UI, until that backfill succeeds. Its id."""
    failed = backfill.wait_backfill(cluster, backfill_id)
    assert failed["status"] in {"COMPLETED_FAILED", "FAILED"}, failed
    reexecuted = cluster.server.gql(
        backfill.REEXECUTE, {"params": {"parentRunId": backfill_id, "strategy": "FROM_FAILURE"}}
    )
    reexecuted = reexecuted["reexecutePartitionBackfill"]
    assert reexecuted["__typename"] == "LaunchBackfillSuccess", reexecuted
    result = backfill.wait_backfill(cluster, reexecuted["backfillId"])
    assert result["status"] == "COMPLETED_SUCCESS", (result, backfill.failures(cluster.instance, result["id"]))
    return reexecuted["backfillId"]


def test_a_worker_killed_mid_completions_is_re_executed_from_its_parts_to_rows_equal_to_an_uninterrupted_run(cluster):
    cluster.fleet.start(*FLEET)  # no hold: rows get committed one by one
    backfill_id = backfill.launch_backfill(cluster.server, [KILLED], "celery: a worker is killed", ONE_ROW_COMMITS)
    wait_for("rows committed", lambda: len(rows(cluster.data_dir, KILLED)) >= 2)
    cluster.fleet.hold(True)  # what is sent from now on stays in flight
    wait_for("a request in flight", lambda: cluster.fleet.faults()["injected"]["hold"] >= 1)
    [run] = runs_of(cluster, backfill_id)
    [pid] = step_pids(cluster.instance, run.run_id, "completions")
    killed_on = worker_of(cluster, pid)
    committed = len(rows(cluster.data_dir, KILLED))
    os.kill(pid, signal.SIGKILL)  # the run's worker process dies mid-step
    cluster.fleet.release_fast()  # the rest, and the uninterrupted reference run below, decoded fast: same rows
    # the same shard, uninterrupted, in process on another data dir and instance, made while the cluster recovers
    reference_env = {
        **cluster.env,
        "DAGSTER_HOME": str(make_home(cluster.base / "reference_home")),
        "DFLASH_DATA_DIR": str(cluster.base / "reference"),
    }
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(materialize_shards, reference_env, {KILLED: 4096}, LOGS / "reference.log")
        reexecuted = recovered(cluster, backfill_id)
        outcome = uninterrupted.result()
    assert outcome[KILLED]["success"]
    [retry] = runs_of(cluster, reexecuted)
    killed = cluster.instance.get_run_by_id(run.run_id)
    pids = step_pids(cluster.instance, retry.run_id, "completions")
    meta = backfill.latest_completions_metadata(cluster.instance, KILLED)
    after = rows(cluster.data_dir, KILLED, "prompt_id, content, reasoning_content, completion_tokens, finish_reason")
    reference = rows(
        cluster.base / "reference", KILLED, "prompt_id, content, reasoning_content, completion_tokens, finish_reason"
    )
    save(
        "killed_worker.json",
        {
            "killed_on": killed_on,
            "rows_committed_before_the_kill": committed,
            "killed_run": killed.status,
            "killed_run_failure": [
                e.message[:200] for e in cluster.instance.all_logs(run.run_id, of_type=DagsterEventType.RUN_FAILURE)
            ],
            "retry_run": retry.status,
            "retry_completions_on": [worker_of(cluster, p) for p in pids],
            "already_done_on_retry": meta.get("already_done"),
            "rows": len(after),
        },
    )
    assert killed.status == dg.DagsterRunStatus.FAILURE and retry.status == dg.DagsterRunStatus.SUCCESS
    assert len(pids) == 1 and worker_of(cluster, pids[0]) in cluster.workers.values(), "completions ran again"
    assert 2 <= committed < SHARD_SIZE and meta["already_done"] >= committed, meta  # resumed from the parts
    assert after == reference and len(after) == SHARD_SIZE
