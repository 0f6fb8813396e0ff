"""The readers of a backfill's end, each on its own over a data dir (a kept `bench_scale.py --keep` run's): peak RSS,
its rise over the reader's start and CPU seconds, in one fresh process, one reader after another.

    uv run python benchmarks/bench_scale.py --prompts 1000000 --keep      # prints the folder it keeps
    uv run python benchmarks/bench_readers.py <that folder>/run-*/data
    DFLASH_DUCKDB_MEMORY_LIMIT=64MB uv run python benchmarks/bench_readers.py <data dir>

The readers are those of the run's end: the checks, the report and its histogram, the configs' table, the prompts
by source, the cap plan, the window plan, length quality, the answer (cap_answers), the latest order and the export
(of the latest config, to a temporary folder). The peak is the kernel's (highwater.py); before each reader the freed
memory goes back to the OS (release_memory), so each starts from the same floor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import highwater

PAGE = os.sysconf("SC_PAGE_SIZE")
T = TypeVar("T")


def rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir", type=Path)
    data = parser.parse_args().data_dir

    import dflash_assets  # noqa: F401 - Arrow's pool, as in every dflash process
    from dflash_assets.quality.checks.registry import run_checks
    from dflash_assets.quality.planning.planner import plan_caps
    from dflash_assets.quality.planning.window_plan import window_plan
    from dflash_assets.quality.report.answer import cap_answers
    from dflash_assets.quality.report.histogram import report_and_histogram
    from dflash_assets.quality.report.lengths import length_quality
    from dflash_assets.quality.report.sources import by_source
    from dflash_assets.quality.training.export import export_training_set
    from dflash_assets.settings import QualitySettings
    from dflash_assets.store.configs import latest_order, list_configs
    from dflash_assets.store.storage import release_memory

    q = QualitySettings()
    config = latest_order(data)[0][0]
    out = Path(tempfile.mkdtemp(prefix="bench-readers-"))
    trainer = q.trainer

    def run(name: str, reader: Callable[[], T]) -> T:
        release_memory()
        time.sleep(0.05)
        start, cpu = rss(), time.process_time()
        highwater.reset()
        result = reader()
        peak = highwater.peak()  # the kernel's: a sampling thread misses a peak inside a call that holds the GIL
        print(
            f"  {name:<26}{peak / 2**20:>6.0f} MB (+{(peak - start) / 2**20:.0f}){time.process_time() - cpu:>8.1f} CPU-s",
            flush=True,
        )
        return result

    print(f"the readers of a run's end over {data}, config {config}: peak RSS (rise over the start), CPU")
    run("checks", lambda: run_checks(data, config_hash=config, quality=q))
    run(
        "report and histogram",
        lambda: report_and_histogram(data, out / "h.png", None, trainer.max_length, q.runaway, config),
    )
    run("configs' table", lambda: list_configs(data, trainer.max_length))
    run("by source", lambda: by_source(data, config))
    plan = run("cap plan", lambda: plan_caps(data, config_hash=config, bootstrap=100, runaway=q.runaway))
    candidates = [e.cap for e in plan.estimates]
    run(
        "window plan",
        lambda: window_plan(data, config, plan.cap, trainer, plan.fit, q.runaway, candidates=candidates),
    )
    run("length quality", lambda: length_quality(data, max_length=trainer.max_length, runaway=q.runaway))
    run("the answer (cap_answers)", lambda: cap_answers(data, q))
    run("latest order", lambda: latest_order(data))
    run(
        "export",
        lambda: export_training_set(
            data,
            out / "training",
            config_hash=config,
            max_length=trainer.max_length,
            form=trainer.format,
            runaway=q.runaway,
            chat_template=trainer.chat_template,
            min_loss_tokens=trainer.min_loss_tokens,
            held_out_share=trainer.held_out_share,
            held_out_seed=trainer.held_out_seed,
            trainer=trainer.name,
        ),
    )
    shutil.rmtree(out)


if __name__ == "__main__":
    main()
