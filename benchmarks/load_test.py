"""Load test: 8 emulated servers, 50,000 prompts, one backfill run through Dagster.

    uv run python benchmarks/load_test.py [--prompts 50000] [--servers 8] [--shard-size 1000]

The backfill is the `shard_pipeline` job over the whole range of shards in one run (what a backfill run
does), on the instance of a temporary DAGSTER_HOME, attached to emulator processes that decode at a fixed
rate per request. Prints throughput, fleet utilisation (from the emulators' exact slot timelines) and the
peak memory of the process that ran Dagster and the dispatcher.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path


def vm_hwm_mb() -> float:
    return int([line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=50_000)
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--decode-tokens-per-s", type=float, default=500.0)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="dflash-load-"))
    os.environ["DAGSTER_HOME"] = str(tmp / "home")
    (tmp / "home").mkdir()
    src = tmp / "prompts.jsonl"
    with open(src, "w") as f:
        for i in range(args.prompts):
            f.write(json.dumps({"id": f"L{i:07d}", "prompt": f"Load test prompt {i}: explain item {i % 97}."}) + "\n")

    import dagster as dg

    from dflash_assets.definitions import defs
    from dflash_assets.defs.partitions import shard_partitions
    from dflash_assets.defs.resources import DataDirResource, FleetResource, PromptSourceResource, QualityResource
    from dflash_assets.emulator.process import start_emulator

    flags = [
        "--reasoning-parser",
        "qwen3",
        "--decode-tokens-per-s",
        str(args.decode_tokens_per_s),
        "--max-running-requests",
        "32",
        "--length-median",
        "200",
        "--length-sigma",
        "0.8",
        "--length-max",
        "2000",
    ]
    with ExitStack() as stack:
        servers = [stack.enter_context(start_emulator(flags)) for _ in range(args.servers)]
        urls = [s.url for s in servers]
        shards = [f"{k:05d}" for k in range(-(-args.prompts // args.shard_size))]
        resources = {
            "fleet": FleetResource(mode="attach", urls=",".join(urls)),
            "prompt_source": PromptSourceResource(path=str(src), shard_size=args.shard_size),
            "data_dir": DataDirResource(path=str(tmp / "data")),
            "quality": QualityResource(),
        }
        instance = dg.DagsterInstance.get()
        instance.add_dynamic_partitions(shard_partitions.name, shards)
        job = defs.get_repository_def().get_job("shard_pipeline")
        print(
            f"load test: {args.prompts:,} prompts in {len(shards)} shards, {args.servers} emulated servers x 32 "
            f"slots, decode {args.decode_tokens_per_s:.0f} tok/s per request",
            flush=True,
        )
        start = time.monotonic()
        result = job.execute_in_process(
            instance=instance,
            resources=resources,
            raise_on_error=False,
            run_config={
                "ops": {"completions": {"config": {"max_output_tokens": 4096, "progress_seconds": 15}}},
                "loggers": {"console": {"config": {"log_level": "WARNING"}}},
            },
            tags={"dagster/asset_partition_range_start": shards[0], "dagster/asset_partition_range_end": shards[-1]},
        )
        wall = time.monotonic() - start
        steps = [
            (st.step_key, st.end_time - st.start_time)
            for st in instance.get_run_step_stats(result.run_id)
            if st.start_time and st.end_time
        ]
        mats = result.asset_materializations_for_node("completions")
        meta = {m.partition: {k: v.value for k, v in m.metadata.items()} for m in mats}
        completed = sum(m["completed"] for m in meta.values())
        tokens = sum(m["output_tokens"] for m in meta.values())
        first = min(m["elapsed_s"] for m in meta.values())
        busy = avail = 0.0
        for url in urls:
            with urllib.request.urlopen(url + "/_emulator/stats", timeout=10) as r:
                stats = json.load(r)
            for rank in stats["ranks"]:
                timeline = rank["timeline"]
                t0 = next(t for t, running in timeline if running > 0)
                t1 = timeline[-1][0]
                for (t, running), (t_next, _) in zip(timeline, timeline[1:] + [[t1, 0]]):
                    busy += running * (t_next - t)
                avail += rank["max_running_requests"] * (t1 - t0)
    print("\n| figure | value |\n|---|---|")
    print(f"| run | {'success' if result.success else 'FAILED'}; {len(mats)} shard materialisations |")
    print(f"| completions | {completed:,} of {args.prompts:,} |")
    print(f"| wall time (prompt_shards + completions + reports + checks) | {wall:.0f} s |")
    print(f"| completions/s over the whole run | {completed / wall:,.0f} |")
    print(f"| output tokens/s over the whole run | {tokens / wall:,.0f} |")
    print(f"| fleet utilisation (first to last busy slot, all servers) | {busy / avail:.2%} |")
    print(f"| peak RSS of the Dagster + dispatcher process | {vm_hwm_mb():.0f} MB |")
    print(f"| first shard's completions committed after | {first:.0f} s |")
    for key, seconds in steps:  # where the wall time went
        print(f"| step {key} | {seconds:.0f} s |")


if __name__ == "__main__":
    main()
