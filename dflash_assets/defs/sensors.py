"""dead_runs_sensor: fail the runs whose process died and free the pool slots they hold (every run's concern)."""

import dagster as dg

from dflash_assets.defs.pools import reap_dead_runs


@dg.sensor(
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Fails the runs of this host whose worker process is gone (SIGKILLed, crashed, its machine's "
    "`dagster dev` killed) and frees every pool slot an ended run still holds, so a dead run never "
    "blocks the next one (defs/pools.py).",
)
def dead_runs_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    released = reap_dead_runs(context.instance)
    if not released:
        return dg.SensorResult(skip_reason="no run of this host is dead, no ended run holds a pool slot")
    return dg.SensorResult(
        skip_reason="freed the slots of "
        + ", ".join(f"run {h.run_id} ({'its process died: failed' if h.dead else 'ended'})" for h in released)
    )
