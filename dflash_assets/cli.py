"""`dflash`: the demo, the emulator, the quality report and the fleet, from a terminal."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    # Settings go to the environment before Dagster is imported: definitions read them at load.
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(Path("dagster_home").resolve())))
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DFLASH_DATA_DIR", "data")
    if args.prompts:
        os.environ["DFLASH_PROMPTS"] = str(Path(args.prompts).resolve())
    if args.shard_size:
        os.environ["DFLASH_SHARD_SIZE"] = str(args.shard_size)
    if args.servers:
        os.environ["DFLASH_NUM_SERVERS"] = str(args.servers)

    from dflash_assets.demo.run import run_demo

    return run_demo(max_output_tokens=args.max_output_tokens)


def _emulator(argv: list[str]) -> int:
    from dflash_assets.fleet.emulator import main

    return main(argv)


def _report(args: argparse.Namespace) -> int:
    from dflash_assets.quality.report import print_report

    data_dir = Path(args.data_dir or os.environ.get("DFLASH_DATA_DIR", "data"))
    if not (data_dir / "completions").exists():
        print(f"dflash report: no completions under {data_dir} (set --data-dir or DFLASH_DATA_DIR)", file=sys.stderr)
        return 2
    print_report(data_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the whole pipeline through Dagster on an emulated SGLang fleet",
                          description="Materialise every shard of the bundled demo prompts (or --prompts) through "
                                      "Dagster on emulated SGLang servers, run the checks and print a summary. "
                                      "Re-running resumes: committed completions are not generated again.")
    demo.add_argument("--max-output-tokens", type=int, default=16384,
                      help="the cap (default 16384; try 4096 to watch the truncation check fail)")
    demo.add_argument("--prompts", help="a JSONL or Parquet prompt source (default: the bundled demo prompts)")
    demo.add_argument("--shard-size", type=int, help="prompts per shard (default 100, or DFLASH_SHARD_SIZE)")
    demo.add_argument("--servers", type=int, help="emulated servers (default 2, or DFLASH_NUM_SERVERS)")

    sub.add_parser("emulator", help="run one SGLang 0.5.23 emulator server (SGLang's flag names)", add_help=False)

    report = sub.add_parser("report", help="print the length-quality summary of a data dir",
                            description="Reads the Parquet files directly; works without the webserver.")
    report.add_argument("--data-dir", help="default: DFLASH_DATA_DIR, else data/")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["emulator"]:
        return _emulator(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        if args.max_output_tokens <= 0:
            build_parser().error(f"--max-output-tokens must be a positive integer, got {args.max_output_tokens}")
        return _demo(args)
    return _report(args)


if __name__ == "__main__":
    sys.exit(main())
