"""The pools a generating step holds, and the runs that died holding them.

Both live in the instance's concurrency tables (the UI's Concurrency page): `sglang_fleet`, at most
`concurrency.pools.default_limit` generating steps (dagster_home/dagster.yaml), and `shard:<key>`, one run per shard
(run-queue tag limits cannot: a backfill run's tags name only its range's ends). The step claims them itself, in one
global order (shards sorted, then the fleet: no deadlock), not through `@asset(pool=...)`, because:
- Dagster 1.13's `InstanceConcurrencyContext.interval_to_next_pending_claim_check` returns `min(0, ...)`: a waiting
  step polls at 100% CPU. This loop sleeps `POLL_S` between claims.
- A SIGKILLed in-process run never ends in the instance. While waiting, this loop frees the slots of ended runs and
  fails a run whose worker is gone (pid and start time in its tags, as fleet/processes.py compares them); a run on
  another host is left to Dagster's run monitoring.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import dagster as dg

from dflash_assets.fleet.processes import is_ours, start_time
from dflash_assets.generation.stopping import STOP

FLEET_POOL = "sglang_fleet"
SHARD_POOL_PREFIX = "shard:"
# A waiting step claims again, and judges the pool's holders, this often: waiting takes under 1% of a core
POLL_S, JUDGE_S = 2.0, 10.0
# the run's worker: recorded in its tags when it launches (the CLI) or first claims a pool (any launcher)
PID_TAG, START_TAG, HOST_TAG = "dflash/worker_pid", "dflash/worker_started", "dflash/worker_host"
# not finished; NOT_STARTED too: the CLI creates its run, then starts it (a kill can land in between)
ACTIVE = [
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]

# What a waiting step says goes to the run's event log and to this logger, which the CLI prints on the terminal.
log = logging.getLogger(__name__)


def shard_pool(shard: str) -> str:
    return SHARD_POOL_PREFIX + shard


def worker_tags() -> dict[str, str]:
    """This process as a run's worker: what another process needs to tell whether it is still alive."""
    return {PID_TAG: str(os.getpid()), START_TAG: repr(start_time(os.getpid())), HOST_TAG: socket.gethostname()}


@dataclass(frozen=True)
class Holder:
    """A run that holds or waits for a pool, as another process sees it."""

    run_id: str
    ended: bool  # the instance says the run is over: its slots are free to take
    dead: bool  # its worker process on this host is gone, though the instance still says it runs
    pid: int | None
    host: str | None

    def describe(self) -> str:
        if self.pid is None:
            return f"run {self.run_id} (no worker recorded: it may still be starting)"
        if self.host != socket.gethostname():
            return (
                f"run {self.run_id} on host {self.host} (not judged from here: run monitoring fails it if its "
                f"worker dies; terminate it in the UI to free it now)"
            )
        return (
            f"run {self.run_id} (alive, pid {self.pid} on this host; wait for it, or `kill {self.pid}` "
            f"to stop it: its committed rows are kept and the next run goes on from them)"
        )


def judge(instance: dg.DagsterInstance, run_id: str) -> Holder:
    run = instance.get_run_by_id(run_id)
    if run is None or run.is_finished:
        return Holder(run_id, ended=True, dead=False, pid=None, host=None)
    pid, host = run.tags.get(PID_TAG), run.tags.get(HOST_TAG)
    if pid is None:
        return Holder(run_id, ended=False, dead=False, pid=None, host=None)
    started = run.tags.get(START_TAG)
    dead = host == socket.gethostname() and not is_ours(
        int(pid), float(started) if started not in (None, "None") else None
    )
    return Holder(run_id, ended=False, dead=dead, pid=int(pid), host=host)


def release(instance: dg.DagsterInstance, holder: Holder, context: dg.AssetExecutionContext | None = None) -> None:
    """Free what an ended or dead run holds; a dead one is failed first, so the UI says why."""
    if holder.dead:
        run = instance.get_run_by_id(holder.run_id)
        if run is not None and not run.is_finished:
            instance.report_run_failed(
                run,
                message=(
                    f"Its worker process (pid {holder.pid} on {holder.host}) is gone: killed or crashed. Failed by "
                    f"dflash, and its pool slots freed; committed rows are kept: run the same command again."
                ),
            )
    instance.event_log_storage.free_concurrency_slots_for_run(holder.run_id)
    what = "died (its process is gone): failed it and" if holder.dead else "had ended:"
    say(context, f"run {holder.run_id} {what} freed the pool slots it held")


def say(context: dg.AssetExecutionContext | None, message: str) -> None:
    """To the run's event log (the UI) and to this module's logger (the CLI prints it on the terminal)."""
    if context is not None:
        context.log.info(message)
    log.info(message)


def reap_dead_runs(instance: dg.DagsterInstance) -> list[Holder]:
    """Fail this host's runs whose worker is gone, and free the slots that ended runs hold."""
    storage = instance.event_log_storage
    # one batched read for every pool: a large prompt set has a shard pool per shard
    infos = storage.get_concurrency_infos(sorted(storage.get_concurrency_keys())).values()
    holding_runs = {s.run_id for info in infos for s in info.claimed_slots} | {
        p.run_id for info in infos for p in info.pending_steps
    }
    active = {r.run_id for r in instance.get_runs(dg.RunsFilter(statuses=ACTIVE))}
    released = []
    for run_id in sorted(active | holding_runs):
        holder = judge(instance, run_id)
        if holder.dead or (holder.ended and run_id in holding_runs):
            release(instance, holder)
            released.append(holder)
    return released


def _limit(instance: dg.DagsterInstance, pool: str) -> int | None:
    """A shard's pool holds one run; the fleet's its own limit, else the instance's default; None: no limit."""
    storage = instance.event_log_storage
    info = storage.get_concurrency_info(pool)
    if pool.startswith(SHARD_POOL_PREFIX):
        if info.slot_count != 1:
            storage.set_concurrency_slots(pool, 1)
        return 1
    default = instance.global_op_concurrency_default_limit
    if default is not None and (info.slot_count == 0 or (info.using_default_limit and info.slot_count != default)):
        storage.initialize_concurrency_limit_to_default(pool)
        info = storage.get_concurrency_info(pool)
    return info.slot_count or None


def _claim(context: dg.AssetExecutionContext, pool: str, holder_key: str) -> None:
    instance, storage, run_id = context.instance, context.instance.event_log_storage, context.run.run_id
    limit = _limit(instance, pool)
    if limit is None:
        return
    said: set[str] = set()
    judged_at = None
    while not storage.claim_concurrency_slot(pool, run_id, holder_key).is_claimed:
        if judged_at is None or time.monotonic() - judged_at >= JUDGE_S:
            judged_at = time.monotonic()
            info = storage.get_concurrency_info(pool)
            claimed = {s.run_id for s in info.claimed_slots}
            others = sorted((claimed | {p.run_id for p in info.pending_steps}) - {run_id})
            holders = [judge(instance, o) for o in others]
            if gone := [h for h in holders if h.ended or h.dead]:
                for h in gone:
                    release(instance, h, context)
                continue
            line = f"waiting for pool {pool} ({limit} slot{'s' if limit != 1 else ''}), held by " + "; ".join(
                h.describe() for h in holders if h.run_id in claimed
            )
            if line not in said:  # once per change of who holds it
                say(context, line)
                said.add(line)
        time.sleep(POLL_S)
        STOP.check()  # a signal while waiting: nothing held yet but what `holding` frees
    if said:
        say(context, f"pool {pool} is free: run {run_id} goes on")
    context.log.info(f"holds pool {pool}")  # the event log's mark of when the step began to hold it


@contextmanager
def holding(context: dg.AssetExecutionContext, shards: Sequence[str] = (), fleet: bool = True) -> Iterator[None]:
    """Hold a slot of each shard's pool and of the fleet's for this step; wait (idle) while others hold them."""
    instance, run_id = context.instance, context.run.run_id
    if context.run.tags.get(PID_TAG) != str(os.getpid()):
        instance.add_run_tags(run_id, worker_tags())  # a launcher's worker: say who we are before we hold anything
    holder_key = context.op_execution_context.op.name
    pools = [shard_pool(s) for s in sorted(set(shards))] + ([FLEET_POOL] if fleet else [])
    try:
        for pool in pools:
            _claim(context, pool, holder_key)
        yield
    finally:
        context.log.info(f"releasing pools {', '.join(pools)}")  # before: the log's hold is within the real one
        instance.event_log_storage.free_concurrency_slot_for_step(run_id, holder_key)
