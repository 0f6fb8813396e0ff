"""`dflash`: the demo, the emulator, the quality report and the fleet, from a terminal."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _instance_environment(args: argparse.Namespace) -> None:
    """Settings go to the environment before Dagster is imported: definitions read them at load."""
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(Path("dagster_home").resolve())))
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DFLASH_DATA_DIR", "data")
    if args.prompts:
        os.environ["DFLASH_PROMPTS"] = str(Path(args.prompts).resolve())
    if args.shard_size:
        os.environ["DFLASH_SHARD_SIZE"] = str(args.shard_size)
    if args.servers:
        os.environ["DFLASH_NUM_SERVERS"] = str(args.servers)


def _demo(args: argparse.Namespace) -> int:
    _instance_environment(args)
    from dflash_assets.demo.run import run_demo

    return run_demo(max_output_tokens=args.max_output_tokens, verbose=args.verbose)


def _backfill(args: argparse.Namespace) -> int:
    _instance_environment(args)
    from dflash_assets.demo.run import run_backfill

    return run_backfill(args.first, args.last, max_output_tokens=args.max_output_tokens, verbose=args.verbose)


def _continue(args: argparse.Namespace) -> int:
    _instance_environment(args)
    from dflash_assets.demo.run import run_continue

    return run_continue(args.to_cap, args.first, args.last, verbose=args.verbose)


def _emulator(argv: list[str]) -> int:
    from dflash_assets.emulator import main

    return main(argv)


def _generate(args: argparse.Namespace) -> int:
    """One shard's completions without Dagster: the same engine the `completions` asset adapts."""
    import asyncio

    from dflash_assets.fleet.fleet import connect
    from dflash_assets.generation.config import ConfigError, DispatchSettings, GenerationConfig
    from dflash_assets.generation.engine import generate_shard

    config = GenerationConfig(max_output_tokens=args.max_output_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, enable_thinking=not args.no_thinking,
                              regenerate=args.regenerate)
    settings = DispatchSettings(commit_rows=args.commit_rows, commit_seconds=args.commit_seconds,
                                progress_seconds=args.progress_seconds)
    try:
        config.validate()
        settings.validate()
    except ConfigError as e:
        print(f"dflash generate: {e}", file=sys.stderr)
        return 2
    urls = [u for u in args.urls.split(",") if u]

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    async def go(progress: Progress):
        task = progress.add_task(f"shard {args.shard}", total=None)
        fleet = await connect(urls, os.environ.get(args.api_key_env) or None)
        try:
            return await generate_shard(args.data_dir, args.shard, fleet, config, settings,
                                        log=progress.console.print,
                                        on_answer=lambda done, total: progress.update(task, completed=done,
                                                                                      total=total))
        finally:
            await fleet.session.close()

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  transient=True, disable=not sys.stdout.isatty()) as progress:
        run = asyncio.run(go(progress))
    print(f"shard {run.shard} config {run.config_hash}: {run.prompts} prompts = {run.completed} completed + "
          f"{run.rejected} rejected + {run.failed} failed ({run.elapsed_s:.1f}s)")
    return 0 if run.failed == 0 else 1


def _fleet(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dflash_assets.fleet import launcher, status
    from dflash_assets.fleet.launch_config import build_spec

    fleet_dir = Path(args.fleet_dir) if args.fleet_dir else launcher.default_fleet_dir()
    console = Console(width=None if sys.stdout.isatty() else 160)  # piped output is not cut to 80 columns
    try:
        if args.fleet_command == "up":
            spec = build_spec(
                model_path=args.model_path, gpus=args.gpus, command=args.server_command, base_port=args.base_port,
                api_key_env=args.api_key_env, health_timeout_s=args.health_timeout, extra_args=args.extra_args,
                served_model_name=args.served_model_name, host=args.host, tp_size=args.tp_size,
                context_length=args.context_length, max_running_requests=args.max_running_requests,
                max_mamba_cache_size=args.max_mamba_cache_size, mem_fraction_static=args.mem_fraction_static,
                chunked_prefill_size=args.chunked_prefill_size, reasoning_parser=args.reasoning_parser,
                enable_metrics=args.enable_metrics, max_queued_requests=args.max_queued_requests)
            with console.status(f"bringing up {len(spec.servers())} server(s); waiting for /health"):
                records = launcher.up(spec, fleet_dir, replace=args.replace, on_event=console.print)
            console.print("fleet up: " + ",".join(r.url for r in records))
            console.print(f"attach with DFLASH_FLEET_MODE=attach DFLASH_FLEET_URLS={','.join(r.url for r in records)}")
        elif args.fleet_command == "status":
            statuses = status.fleet_status(fleet_dir, args.urls or (), api_key_env=args.api_key_env)
            if not statuses:
                console.print(f"no servers: nothing in {fleet_dir / 'registry.json'} and no --urls")
                return 1
            console.print(status.status_table(statuses))
            if args.watch:
                console.print(_tuning(statuses, args.watch, args.api_key_env, console))
            return 0 if all(s.healthy for s in statuses) else 1
        else:
            stopped = launcher.down(fleet_dir, args.names or None, on_event=console.print)
            console.print(f"fleet down: {len(stopped)} server(s) stopped")
    except (launcher.FleetError, ValueError) as e:
        console.print(f"[red]dflash fleet {args.fleet_command}:[/] {e}")
        return 2
    return 0


def _tuning(statuses, seconds: float, api_key_env: str, console):
    """Sample every server's /v1/loads for `seconds` and turn what it shows into advice."""
    import asyncio
    import time

    from rich.progress import Progress

    from dflash_assets.fleet.client import ServerClient
    from dflash_assets.fleet.fleet import open_session
    from dflash_assets.fleet.tuning import LoadSampler, advise, summarize, tuning_table

    async def sample():
        async with open_session() as session:
            clients = [ServerClient(session, s.url, os.environ.get(api_key_env) or None) for s in statuses
                       if s.workers is None]  # a gateway has no loads of its own: its workers' rows are sampled
            sampler = await LoadSampler(clients, interval_s=1.0).start()
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task(f"sampling /v1/loads for {seconds:.0f}s", total=seconds)
                start = time.monotonic()
                while (elapsed := time.monotonic() - start) < seconds:
                    progress.update(task, completed=elapsed)
                    await asyncio.sleep(0.5)
            infos = [await c.info() for c in clients]
            return await sampler.stop(), infos

    samples, infos = asyncio.run(sample())
    return tuning_table(summarize(samples, infos), advise(samples, infos))


def _report(args: argparse.Namespace) -> int:
    from dflash_assets.quality import print_report
    from dflash_assets.quality.tables import parquet_files

    data_dir = args.data_dir or os.environ.get("DFLASH_DATA_DIR", "data")  # a path or an s3:// URI
    if not parquet_files(data_dir, "completions"):
        print(f"dflash report: no completions under {data_dir} (set --data-dir or DFLASH_DATA_DIR)", file=sys.stderr)
        return 2
    from rich.console import Console

    from dflash_assets.quality.console import print_answers

    console = Console(width=None if sys.stdout.isatty() else 120)  # piped output is not cut to 80 columns
    answers = print_answers(data_dir, console)
    pictures = _report_pictures(data_dir, answers)
    for picture in pictures:
        console.print(f"picture: {picture}", highlight=False)
    if args.open:
        import webbrowser

        for picture in pictures:
            webbrowser.open(picture.resolve().as_uri())
    console.print()
    print_report(data_dir, console)
    return 0


def _report_pictures(data_dir: str, answers) -> list[Path]:
    """The histogram of completion lengths and each config's cap plan (survival curve), written beside the report:
    under the data dir's reports/ (DFLASH_LOCAL_DIR when the data dir is an object store)."""
    from dflash_assets.generation.storage import is_uri
    from dflash_assets.quality import completion_histogram_png
    from dflash_assets.quality.planner_plot import cap_plan_png

    reports = Path(os.environ.get("DFLASH_LOCAL_DIR", "data") if is_uri(data_dir) else data_dir) / "reports"
    pictures = [completion_histogram_png(data_dir, reports / "completion_lengths.png")]
    for answer in answers:
        if answer.plan is not None:
            path = reports / f"cap_plan-{answer.config_hash}.png"
            path.write_bytes(cap_plan_png(answer.plan))
            pictures.append(path)
    return pictures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the whole pipeline through Dagster on an emulated SGLang fleet",
                          description="Materialise every shard of the bundled demo prompts (or --prompts) through "
                                      "Dagster on emulated SGLang servers, run the checks and print a summary. "
                                      "Re-running resumes: committed completions are not generated again.")
    backfill = sub.add_parser("backfill", help="materialise a range of shards through Dagster, as a UI backfill does",
                              description="Runs of up to DFLASH_SHARDS_PER_RUN shards (each streaming its shards "
                                          "through one dispatcher), executed here one after the other on the "
                                          "instance in DAGSTER_HOME with the fleet of DFLASH_FLEET_MODE. A failed "
                                          "run is resumed by running the same range again.")
    backfill.add_argument("--from", dest="first", help="first shard key (default: the first)")
    backfill.add_argument("--to", dest="last", help="last shard key (default: the last)")
    backfill.add_argument("--max-output-tokens", type=int, default=4096, help="the cap (default 4096)")
    for p in (demo, backfill):
        if p is demo:
            p.add_argument("--max-output-tokens", type=int, default=16384,
                           help="the cap (default 16384; try 4096 to watch the truncation check fail)")
        p.add_argument("--prompts", help="a JSONL or Parquet prompt source (default: DFLASH_PROMPTS, else the "
                                         "bundled demo prompts)")
        p.add_argument("--shard-size", type=int, help="prompts per shard (default 100, or DFLASH_SHARD_SIZE)")
        p.add_argument("--servers", type=int, help="emulated servers (default 2, or DFLASH_NUM_SERVERS)")
        p.add_argument("--verbose", action="store_true",
                       help="also print Dagster's event stream here (it always goes to the run's event log)")

    cont = sub.add_parser("continue", help="raise the cap without bias: continue cut rows from where they stopped",
                          description="Runs continued_completions over the shards through Dagster: every row cut at "
                                      "the smaller cap is taken on to --to from where it stopped, every row that "
                                      "stopped is copied, so the new config's lengths are those of a clean run at "
                                      "the larger cap. Rows without token ids are continued by their text (the "
                                      "chat route's continue_final_message).")
    cont.add_argument("--to", dest="to_cap", type=int, required=True, help="the new cap, e.g. 8192")
    cont.add_argument("--from-shard", dest="first", help="first shard key (default: the first)")
    cont.add_argument("--to-shard", dest="last", help="last shard key (default: the last)")
    cont.add_argument("--prompts", help=argparse.SUPPRESS)
    cont.add_argument("--shard-size", type=int, help=argparse.SUPPRESS)
    cont.add_argument("--servers", type=int, help="emulated servers (default 2, or DFLASH_NUM_SERVERS)")
    cont.add_argument("--verbose", action="store_true", help="also print Dagster's event stream here")

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
    gen.add_argument("--regenerate", choices=("last_turn", "all_turns"), default="last_turn",
                     help="the final assistant turn of each conversation, or every one in order")
    gen.add_argument("--commit-rows", type=int, default=512)
    gen.add_argument("--commit-seconds", type=float, default=10.0)
    gen.add_argument("--progress-seconds", type=float, default=30.0)
    gen.add_argument("--api-key-env", default="DFLASH_API_KEY", help="environment variable holding the API key")

    fleet = sub.add_parser("fleet", help="launch, inspect and stop SGLang servers (launch mode)",
                           description="Servers started by `fleet up` are detached: they outlive this command and "
                                       "every run, and later `up`s reuse them while healthy with the same args.")
    fleet.add_argument("--fleet-dir", help="registry and logs (default: $DAGSTER_HOME/fleet)")
    fleet.add_argument("--api-key-env", default="DFLASH_API_KEY", help="environment variable holding the API key")
    fsub = fleet.add_subparsers(dest="fleet_command", required=True)
    fup = fsub.add_parser("up", help="start (or reuse) one server per GPU and wait until healthy")
    fup.add_argument("--model-path", required=True)
    fup.add_argument("--gpus", default="0", help="comma-separated GPU ids (default 0)")
    fup.add_argument("--command", dest="server_command", default="sglang",
                     help="'sglang' (sglang serve), 'launch_server' (python -m sglang.launch_server), 'emulator', "
                          "or a full command line such as '/opt/sgl/bin/sglang serve'")
    fup.add_argument("--base-port", type=int, default=30000, help="the server on GPU g listens on base+g")
    fup.add_argument("--host", default="127.0.0.1")
    fup.add_argument("--replace", action="store_true", help="replace servers whose args differ")
    fup.add_argument("--health-timeout", type=float, default=1200.0, help="seconds to wait for /health")
    fup.add_argument("--served-model-name")
    fup.add_argument("--tp-size", type=int, default=1)
    fup.add_argument("--context-length", type=int)
    fup.add_argument("--max-running-requests", type=int)
    fup.add_argument("--max-mamba-cache-size", type=int)
    fup.add_argument("--mem-fraction-static", type=float)
    fup.add_argument("--chunked-prefill-size", type=int)
    fup.add_argument("--reasoning-parser", default="qwen3")
    fup.add_argument("--enable-metrics", action="store_true")
    fup.add_argument("--max-queued-requests", type=int)
    fup.add_argument("--extra-args", default="", help="more sglang serve flags, quoted as one string")
    fstatus = fsub.add_parser("status", help="health, context length, max running requests, load of each server")
    fstatus.add_argument("--urls", help="also (or only) these attached servers, comma-separated")
    fstatus.add_argument("--watch", type=float, metavar="SECONDS",
                         help="sample /v1/loads for this long and print tuning advice (slots, KV, queue)")
    fdown = fsub.add_parser("down", help="stop servers started by `fleet up`")
    fdown.add_argument("names", nargs="*", help="server names (default: all), e.g. gpu0")

    sub.add_parser("emulator", help="run one SGLang 0.5.23 emulator server (SGLang's flag names)", add_help=False)

    report = sub.add_parser("report", help="print the length-quality summary of a data dir",
                            description="Reads the Parquet files directly; works without the webserver.")
    report.add_argument("--data-dir", help="default: DFLASH_DATA_DIR, else data/")
    report.add_argument("--open", action="store_true",
                        help="open the pictures (length histogram, cap plan survival curve) in a browser")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["emulator"]:
        return _emulator(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command in ("demo", "backfill"):
        if args.max_output_tokens <= 0:
            build_parser().error(f"--max-output-tokens must be a positive integer, got {args.max_output_tokens}")
        return _demo(args) if args.command == "demo" else _backfill(args)
    if args.command == "continue":
        return _continue(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "fleet":
        return _fleet(args)
    return _report(args)


if __name__ == "__main__":
    sys.exit(main())
