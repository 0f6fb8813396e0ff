"""`dflash report`: the length-quality summary of a data dir, read from its Parquet files (no webserver)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_assets.settings import TRAINER_FLAGS, Deployment, QualitySettings, TrainerSettings


def report(args: argparse.Namespace) -> int:
    from dflash_assets.cli.console import print_report
    from dflash_assets.cli.environment import as_printed, data_dir_of
    from dflash_assets.store.stores import parquet_files

    data_dir = data_dir_of(args)  # a path or an s3:// URI
    if not parquet_files(data_dir, "completions"):
        print(f"dflash report: no completions under {data_dir} (set --data-dir or DFLASH_DATA_DIR)", file=sys.stderr)
        return 2
    from dflash_assets.cli.console import console_for_output, print_answers, say_with_command, verbatim
    from dflash_assets.quality.report.rejects import read_rejects

    quality = QualitySettings(trainer=TrainerSettings.taken_from(args, prefix=TRAINER_FLAGS))
    console = console_for_output()
    answers = print_answers(
        data_dir,
        console,
        quality,
        full=args.full,
        command=as_printed("dflash backfill"),
        configs=as_printed("dflash configs", prompts=False),
        export=as_printed("dflash export --config HASH"),
    )
    pictures = report_pictures(data_dir, answers)
    if args.open:
        import webbrowser

        for picture in pictures:
            webbrowser.open(picture.resolve().as_uri())
    if pictures:
        verbatim(console, f"pictures: {pictures[0].parent}/")
    if not args.full:
        say_with_command(
            console, f"the cap plans, rejects and tables: {as_printed('dflash report --full', prompts=False)}"
        )
        return 0
    for picture in pictures:
        verbatim(console, f"  {picture.name}")
    for line in read_rejects(data_dir).lines(as_printed("dflash rejects", prompts=False)):
        say_with_command(console, line)
    console.print()
    print_report(data_dir, console, quality=quality)
    return 0


def report_pictures(data_dir: str, answers) -> list[Path]:
    """Each config's length histogram and cap plan, in the answers' order, after one of every config side by side
    when there are several; under the data dir's reports/ (DFLASH_LOCAL_DIR for an object store)."""
    from dflash_assets.quality.report.histogram import series, write_histogram
    from dflash_assets.quality.report.planner_plot import cap_plan_png
    from dflash_assets.store.storage import is_uri

    reports = Path(Deployment.LOCAL_DIR.value() if is_uri(data_dir) else data_dir) / "reports"
    every = series(data_dir)  # one read: a series per (config, cap)
    several = len({h for h, *_ in every}) > 1
    pictures = [write_histogram(every, reports / "completion_lengths.png", None)] if several else []
    for answer in answers:
        if own := [s for s in every if s[0] == answer.config_hash]:
            path = reports / f"completion_lengths-{answer.config_hash}.png"
            pictures.append(write_histogram(own, path, None, answer=answer.description()))
        if answer.plan is not None:
            path = reports / f"cap_plan-{answer.config_hash}.png"
            wp = answer.window_plan
            window = (wp.max_length, wp.window_at) if wp else None
            path.write_bytes(cap_plan_png(answer.plan, window, answer.description()))
            pictures.append(path)
    return pictures


def rejects(args: argparse.Namespace) -> int:
    """Every rejected prompt of a data dir, one line each: shard, line, stage, reason; the counts by reason first."""
    from dflash_assets.cli.environment import data_dir_of
    from dflash_assets.quality.report.rejects import read_rejects

    data_dir = data_dir_of(args)
    found = read_rejects(data_dir, first=None)
    if not found.total:
        print(f"dflash rejects: no rejects under {data_dir}")
        return 0
    for line in found.lines(""):
        print(line)
    return 0
