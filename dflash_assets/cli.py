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


def _generate(args: argparse.Namespace) -> int:
    """One shard's completions without Dagster: the same engine the `completions` asset adapts."""
    import asyncio

    from dflash_assets.fleet.fleet import connect
    from dflash_assets.generation.config import ConfigError, DispatchSettings, GenerationConfig
    from dflash_assets.generation.engine import generate_shard

    config = GenerationConfig(max_output_tokens=args.max_output_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, enable_thinking=not args.no_thinking)
    settings = DispatchSettings(commit_rows=args.commit_rows, commit_seconds=args.commit_seconds,
                                progress_seconds=args.progress_seconds)
    try:
        config.validate()
        settings.validate()
    except ConfigError as e:
        print(f"dflash generate: {e}", file=sys.stderr)
        return 2
    urls = [u for u in args.urls.split(",") if u]

    async def go():
        fleet = await connect(urls, os.environ.get(args.api_key_env) or None)
        try:
            return await generate_shard(Path(args.data_dir), args.shard, fleet, config, settings,
                                        log=lambda m: print(m, flush=True))
        finally:
            await fleet.session.close()

    run = asyncio.run(go())
    print(f"shard {run.shard} config {run.config_hash}: {run.prompts} prompts = {run.completed} completed + "
          f"{run.rejected} rejected + {run.failed} failed ({run.elapsed_s:.1f}s)")
    return 0 if run.failed == 0 else 1


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

    gen = sub.add_parser("generate", help="generate one shard's completions without Dagster (the same engine)",
                         description="Needs the shard's prompt_shards file; resumes from committed parts.")
    gen.add_argument("--shard", required=True, help="shard key, e.g. 00003")
    gen.add_argument("--urls", required=True, help="comma-separated server base URLs")
    gen.add_argument("--data-dir", default=os.environ.get("DFLASH_DATA_DIR", "data"))
    gen.add_argument("--max-output-tokens", type=int, default=4096)
    gen.add_argument("--temperature", type=float, default=0.6)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--top-k", type=int, default=20)
    gen.add_argument("--no-thinking", action="store_true", help="chat_template_kwargs.enable_thinking = false")
    gen.add_argument("--commit-rows", type=int, default=512)
    gen.add_argument("--commit-seconds", type=float, default=10.0)
    gen.add_argument("--progress-seconds", type=float, default=30.0)
    gen.add_argument("--api-key-env", default="DFLASH_API_KEY", help="environment variable holding the API key")

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
    if args.command == "generate":
        return _generate(args)
    return _report(args)


if __name__ == "__main__":
    sys.exit(main())
