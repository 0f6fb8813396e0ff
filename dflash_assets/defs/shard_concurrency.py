"""One run per shard at a time across the whole deployment, enforced by the Dagster instance.

A step that writes shards claims one concurrency slot per shard (pool `shard:<key>`, limit 1) in the
instance's own concurrency tables, the ones Dagster's pools use: on Postgres they are shared by every host,
so two runs that hold the same shard, whether single-shard runs or overlapping backfill ranges, never write it
at once; the second waits, and says so in its log. Run-queue tag limits cannot do this: a backfill run carries
only the first and last key of its range (`dagster/asset_partition_range_start/_end`), not the shards in it.
Slots are claimed in sorted order (no two runs can each hold what the other waits for) and freed when the step
ends. A run that died holding them (its worker SIGKILLed) has ended in the instance's eyes once run monitoring
failed it: the next run of the shard frees what that ended run still holds and goes on, instead of waiting for
`run_monitoring.free_slots_after_run_end_seconds` (dagster_home/dagster.yaml), so a re-execution from failure
starts at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

POOL_PREFIX = "shard:"
POLL_S = 1.0  # how often a waiting step asks again; the run of a shard lasts minutes


def shard_pool(shard: str) -> str:
    return POOL_PREFIX + shard


@contextmanager
def one_run_per_shard(context: dg.AssetExecutionContext, shards: list[str]) -> Iterator[None]:
    """Hold every shard of `shards` for this step: wait while another run holds one of them."""
    storage = context.instance.event_log_storage
    run_id = context.run.run_id
    # our own step key, so freeing these slots never frees the step's fleet pool slot (or the reverse)
    holder = f"{context.op_execution_context.op.name}/shards"
    try:
        for shard in sorted(set(shards)):
            pool = shard_pool(shard)
            if storage.get_concurrency_info(pool).slot_count != 1:
                storage.set_concurrency_slots(pool, 1)
            said = False
            while not storage.claim_concurrency_slot(pool, run_id, holder).is_claimed:
                owners = {s.run_id for s in storage.get_concurrency_info(pool).claimed_slots}
                ended = {o for o in owners if (run := context.instance.get_run_by_id(o)) is None or run.is_finished}
                for owner in ended:  # a dead run's slots: nobody will free them sooner
                    context.log.info(f"shard {shard}: run {owner} has ended but still held it; freeing its slots")
                    storage.free_concurrency_slots_for_run(owner)
                if ended:
                    continue
                if not said:
                    context.log.info(f"waiting for shard {shard}: run {', '.join(sorted(owners)) or '?'} is "
                                     f"writing it (one run per shard at a time, pool {pool})")
                    said = True
                time.sleep(POLL_S)
            if said:
                context.log.info(f"shard {shard} is free: this run writes it now")
        yield
    finally:
        storage.free_concurrency_slot_for_step(run_id, holder)
