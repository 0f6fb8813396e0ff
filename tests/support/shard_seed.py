"""Shards materialised the way `dflash demo` does: the shard_pipeline job, in process, on the instance in
DAGSTER_HOME. Run in a child forked warm (tests/support/forks.py, `dagster_procs.materialize_shards`): the definitions
read the DFLASH_* settings when they are imported, so they are imported there, in the child's environment."""

import json


def main(argv: list[str]) -> int:
    """argv: the plan as JSON, {shard: cap or null}. Adds the shard partitions, runs shard_pipeline for each shard
    with a cap (max_output_tokens) and prints a JSON line per run: shard, success, run_id, checks."""
    import dagster as dg

    from dflash_assets.definitions import defs

    [plan_json] = argv
    plan = json.loads(plan_json)
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions("shards", sorted(plan))
        job = defs.resolve_job_def("shard_pipeline")
        for shard, cap in sorted(plan.items()):
            if cap is None:
                continue
            result = job.execute_in_process(
                partition_key=shard,
                instance=instance,
                raise_on_error=False,
                run_config={
                    "ops": {"completions": {"config": {"max_output_tokens": cap, "cap_policy": "fixed"}}},
                    "loggers": {"console": {"config": {"log_level": "ERROR"}}},
                },
            )
            checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
            print(json.dumps({"shard": shard, "success": result.success, "run_id": result.run_id, "checks": checks}))
    return 0
