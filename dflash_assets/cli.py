"""`dflash`: the demo, the emulator, the quality report, the configs and their export, the length probe and the
fleet, from a terminal."""

from __future__ import annotations

import argparse
import os
import re
import sys
import typing
from pathlib import Path

from dflash_assets.settings import (
    TRAINER_FLAGS,
    Deployment,
    DispatchSettings,
    FleetSettings,
    GenerationSettings,
    LaunchSettings,
    ProbeSettings,
    QualitySettings,
    RequestSettings,
    Settings,
    SettingsError,
    TrainerSettings,
)


class BadInput(Exception):
    """Input or settings that cannot work, found before any work: one line, exit 2."""


class Parser(argparse.ArgumentParser):
    """A usage error is one line: the wrong flag, what it takes, and `--help` for more; never the whole usage."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {usage_problem(message)}; `{self.prog} --help` for more\n")


KINDS = {"int": "a whole number", "float": "a number"}


def usage_problem(message: str) -> str:
    """argparse's message, said as what was given and what the flag takes."""
    if m := re.fullmatch(r"argument (\S+): invalid (\w+) value: (.+)", message):
        flag, kind, value = m.groups()
        return f"{flag} takes {KINDS.get(kind, kind)}, got {value}"
    if m := re.fullmatch(r"argument (\S+): invalid choice: (.+?) \(choose from (.+)\)", message):
        flag, value, choices = m.groups()
        choices = choices.replace("'", "")
        if not flag.startswith("-"):  # a subcommand
            return f"{value} is not a command; the commands are {choices}"
        return f"{flag} takes one of {choices}, got {value}"
    return message.removeprefix("argument ")


# the project's instance settings (telemetry and the community modal off, the run queue, the fleet's pool)
PROJECT_DAGSTER_YAML = Path(__file__).resolve().parent.parent / "dagster_home" / "dagster.yaml"


def _instance_environment(args: argparse.Namespace) -> None:
    """Settings go to the environment before Dagster is imported: definitions read them at load."""
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(Path("dagster_home").resolve())))
    home.mkdir(parents=True, exist_ok=True)
    _set_up_instance(home)
    os.environ.setdefault(Deployment.DATA_DIR.name, Deployment.DATA_DIR.default)
    if args.prompts:
        os.environ[Deployment.PROMPTS.name] = str(Path(args.prompts).resolve())
    _readable_source(Path(Deployment.PROMPTS.value()), "--prompts" if args.prompts else Deployment.PROMPTS.name)
    if args.shard_size:
        os.environ[Deployment.SHARD_SIZE.name] = str(args.shard_size)
    if args.servers:
        os.environ[Deployment.NUM_SERVERS.name] = str(args.servers)


def _set_up_instance(home: Path) -> None:
    """An empty DAGSTER_HOME gets the project's dagster.yaml, said in one line (Dagster would warn and default)."""
    if not PROJECT_DAGSTER_YAML.is_file() or any(home.iterdir()):
        return  # an instance already there keeps its own settings; an installed wheel has no project file
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    print(
        f"DAGSTER_HOME={home} was empty: wrote the project's dagster.yaml there (telemetry off, the run queue, "
        f"the fleet's concurrency pool)"
    )


def _readable_source(path: Path, given_by: str) -> None:
    """A prompt source that cannot be read stops the command at once, saying which and how to fix it."""
    from dflash_assets.generation.prompts import SourceError, check_source

    try:
        check_source(path)
    except SourceError as e:
        raise BadInput(f"{e} (given by {given_by}): give a JSONL or Parquet file of prompts") from None


# `dflash demo` and `dflash backfill` store token ids (`dflash continue` takes cut rows on by them); the demo's cap
# is generous (`--max-output-tokens 4096` reproduces the story). Every other default is settings.py's.
SHARD_RUN_DEFAULTS = {"store_token_ids": True}
DEMO_DEFAULTS = {**SHARD_RUN_DEFAULTS, "max_output_tokens": 16384}


def _completions_config(command: str, args: argparse.Namespace) -> tuple[dict, TrainerSettings] | None:
    """The `completions` run config of the flags (every request and dispatch setting) and the trainer's settings
    (its window, which the window policy sizes requests to, and its form), or None when one is bad (said on
    stderr)."""
    if (groups := _run_settings(command, args)) is None:
        return None
    trainer, generation, dispatch = groups
    return {**RequestSettings.taken_from(generation).model_dump(), **dispatch.model_dump()}, trainer


def _run_settings(
    command: str, args: argparse.Namespace
) -> tuple[TrainerSettings, GenerationSettings, DispatchSettings] | None:
    """The trainer's settings of the --trainer-* flags, the generation settings sized to its window and the dispatch
    settings; None when one is bad, said in one line on stderr (the caller exits 2)."""
    try:
        trainer = TrainerSettings.taken_from(args, prefix=TRAINER_FLAGS)
        return trainer, GenerationSettings.of(args, trainer), DispatchSettings.taken_from(args)
    except SettingsError as e:
        print(f"dflash {command}: {e}", file=sys.stderr)
        return None


def trainer_flags(trainer: TrainerSettings) -> dict:
    """The trainer's settings under their flags' names (trainer_max_length: --trainer-max-length)."""
    return {TRAINER_FLAGS + name: value for name, value in trainer.model_dump().items()}


def repeated_flags(command: str, config: dict) -> str:
    """The flags that give `config` again (trainer_flags among them), leaving out the cap and what the command's
    defaults already give: the next command a run suggests (another cap) must generate with the same settings, or
    it makes another config, and be judged and exported for the same trainer."""
    import json
    import shlex

    defaults = vars(build_parser().parse_args([command]))
    flags = []
    for name, value in config.items():
        if name == "max_output_tokens" or value == defaults[name]:
            continue
        flag = "--" + name.replace("_", "-")
        text = json.dumps(value) if isinstance(value, dict) else str(value)
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, shlex.quote(text)]
    return "".join(" " + f for f in flags)


def _demo(args: argparse.Namespace) -> int:
    if (given := _completions_config("demo", args)) is None:
        return 2
    config, trainer = given
    _instance_environment(args)
    from dflash_assets.demo.run import run_demo

    flags = {**config, **trainer_flags(trainer)}
    return run_demo(
        config,
        trainer=trainer,
        verbose=args.verbose,
        again=lambda overrides: repeated_flags("demo", {**flags, **overrides}),
    )


def _backfill(args: argparse.Namespace) -> int:
    if (given := _completions_config("backfill", args)) is None:
        return 2
    config, trainer = given
    _instance_environment(args)
    from dflash_assets.demo.run import run_backfill

    flags = {**config, **trainer_flags(trainer)}
    return run_backfill(
        args.first,
        args.last,
        config,
        trainer=trainer,
        verbose=args.verbose,
        again=lambda overrides: repeated_flags("backfill", {**flags, **overrides}),
    )


def _continue(args: argparse.Namespace) -> int:
    _instance_environment(args)
    from dflash_assets.demo.run import run_continue

    if (args.to_cap is None) == (args.to_window is None):
        build_parser().error(
            "dflash continue: give one of --to (a larger cap) and --to-window (a larger trainer's window)"
        )
    return run_continue(args.to_cap, args.first, args.last, verbose=args.verbose, to_window=args.to_window)


def _configs(args: argparse.Namespace) -> int:
    """The configs of a data dir side by side (store/configs.py), the latest first."""
    from dflash_assets.quality.console import configs_table, console_for_output
    from dflash_assets.store.configs import list_configs

    data_dir = args.data_dir or Deployment.DATA_DIR.value()
    try:
        trainer = TrainerSettings.taken_from(args, prefix=TRAINER_FLAGS)
    except SettingsError as e:
        print(f"dflash configs: {e}", file=sys.stderr)
        return 2
    configs = list_configs(data_dir, trainer.max_length)
    if not configs:
        print(f"dflash configs: no completions under {data_dir} (set --data-dir or DFLASH_DATA_DIR)", file=sys.stderr)
        return 2
    console = console_for_output()
    console.print(configs_table(configs))
    console.print(
        f"latest (the export's default when no run names its own): {configs[0].config_hash}. "
        f"Export one: dflash export --config HASH",
        highlight=False,
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    _instance_environment(args)
    from dflash_assets.demo.run import Window, run_export

    try:
        trainer = TrainerSettings.taken_from(args, prefix=TRAINER_FLAGS)
    except SettingsError as e:
        print(f"dflash export: {e}", file=sys.stderr)
        return 2
    return run_export(args.config, verbose=args.verbose, window=Window(trainer=trainer))


def _emulator(argv: list[str]) -> int:
    from dflash_assets.emulator import main

    return main(argv)


def _settings(
    command: str, args: argparse.Namespace, *models: type[Settings], skip: tuple[str, ...] = ()
) -> list | None:
    """Each settings group of the flags (but `skip`), checked as it is built, before any work; None when one is
    bad, said in one line on stderr naming it (the caller exits 2)."""
    try:
        return [model.taken_from(args, skip) for model in models]
    except SettingsError as e:
        print(f"dflash {command}: {e}", file=sys.stderr)
        return None


def _generate(args: argparse.Namespace) -> int:
    """One shard's completions without Dagster: the same engine the `completions` asset adapts."""
    from dflash_assets.fleet.fleet import run
    from dflash_assets.generation.engine import generate_shard

    if (groups := _run_settings("generate", args)) is None:
        return 2
    _, generation, dispatch = groups
    _known_shards(args.data_dir, [args.shard])
    urls = args.urls

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    async def go(progress: Progress):
        task = progress.add_task(f"shard {args.shard}", total=None)
        async with _connected(urls, args) as fleet:
            return await generate_shard(
                args.data_dir,
                args.shard,
                fleet,
                generation,
                dispatch,
                log=progress.console.print,
                on_answer=lambda done, total: progress.update(task, completed=done, total=total),
            )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        transient=True,
        disable=not sys.stdout.isatty(),
    ) as progress:
        shard = run(go(progress))
    print(
        f"shard {shard.shard} config {shard.config_hash}: {shard.prompts} prompts = {shard.completed} completed + "
        f"{shard.rejected} rejected + {shard.failed} failed ({shard.elapsed_s:.1f}s)"
    )
    return 0 if shard.failed == 0 else 1


def _probe(args: argparse.Namespace) -> int:
    """The length probe without Dagster: the same code path (generation/probe.py) the `length_probe` asset adapts."""
    from functools import partial

    from dflash_assets.fleet.fleet import run
    from dflash_assets.generation.preflight import PreflightError
    from dflash_assets.generation.probe import run_length_probe
    from dflash_assets.quality.probe_summary import cut_rows_for_probe, probe_summary

    # the probe's cap is ProbeSettings.max_output_tokens (0: the largest the context allows), not the run's
    if (groups := _settings("probe", args, ProbeSettings, DispatchSettings)) is None:
        return 2
    if (sampling := _settings("probe", args, GenerationSettings, skip=("max_output_tokens",))) is None:
        return 2
    (probe, dispatch), (generation,) = groups, sampling
    shards = _known_shards(args.data_dir, [s for s in (args.shards or "").split(",") if s])
    urls = args.urls

    async def go():
        async with _connected(urls, args) as fleet:
            return await run_length_probe(
                args.data_dir,
                shards,
                fleet,
                generation,
                probe,
                dispatch,
                log=print,
                cut_rows=partial(cut_rows_for_probe, args.data_dir),
            )

    try:
        result = run(go())
    except (SettingsError, PreflightError, FileNotFoundError) as e:
        print(f"dflash probe: {e}", file=sys.stderr)
        return 2
    print(probe_summary(result, args.data_dir, urls, shards))
    return 0 if result.run.failed == 0 else 1


def _known_shards(data_dir: str, asked: list[str]) -> list[str]:
    """The prompt shards of a data dir, or `asked` when each is one of them; else BadInput naming the first that is
    not and the ones there are (before any server is waited for)."""
    from dflash_assets.generation.probe import prompt_shard_keys

    there = prompt_shard_keys(data_dir)
    build = "build them first: dflash backfill, or the prompt_shards asset"
    if not there:
        raise BadInput(f"no prompt shards under {data_dir}: {build} (or give --data-dir a data dir that has them)")
    if missing := [s for s in asked if s not in there]:
        listed = f"{there[0]}..{there[-1]}" if len(there) > 2 else ", ".join(there)
        raise BadInput(
            f"no shard {missing[0]} under {data_dir}: the shards there are {listed} ({len(there)}); give one "
            f"of them, or {build}"
        )
    return asked or there


def _connected(urls: list[str], args: argparse.Namespace):
    """The fleet of --urls, its wait for /health said on stderr."""
    from dflash_assets.fleet.fleet import connected

    fleet = FleetSettings.taken_from(args, ATTACHED)
    return connected(
        urls,
        Deployment.API_KEY.value() or None,
        health_timeout_s=fleet.health_timeout_s,
        request_timeout_s=fleet.request_timeout_s,
        connect_refused_s=fleet.connect_refused_s,
        say=lambda text: print(text, file=sys.stderr, flush=True),
    )


def _fleet(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dflash_assets.fleet import launcher, status
    from dflash_assets.fleet.launcher import build_spec

    fleet_dir = Path(args.fleet_dir) if args.fleet_dir else launcher.default_fleet_dir()
    console = Console(width=None if sys.stdout.isatty() else 160)  # piped output is not cut to 80 columns
    try:
        if args.fleet_command == "up":
            spec = build_spec(LaunchSettings.taken_from(args))
            with console.status(f"bringing up {len(spec.servers())} server(s); waiting for /health"):
                records = launcher.up(spec, fleet_dir, replace=args.replace, on_event=console.print)
            console.print("fleet up: " + ",".join(r.url for r in records))
            console.print(f"attach with DFLASH_FLEET_MODE=attach DFLASH_FLEET_URLS={','.join(r.url for r in records)}")
        elif args.fleet_command == "status":
            statuses = status.fleet_status(fleet_dir, args.urls or (), api_key_env=Deployment.API_KEY.name)
            if not statuses:
                console.print(f"no servers: nothing in {fleet_dir / 'registry.json'} and no --urls")
                return 1
            console.print(status.status_table(statuses))
            if args.watch:
                console.print(_tuning(statuses, args.watch, console))
            return 0 if all(s.healthy for s in statuses) else 1
        else:
            stopped = launcher.down(fleet_dir, args.names or None, on_event=console.print)
            console.print(f"fleet down: {len(stopped)} server(s) stopped")
    except (launcher.FleetError, ValueError) as e:
        console.print(f"[red]dflash fleet {args.fleet_command}:[/] {e}")
        return 2
    return 0


def _tuning(statuses, seconds: float, console):
    """Sample every server's /v1/loads for `seconds` and turn what it shows into advice."""
    import asyncio
    import time

    from rich.progress import Progress

    from dflash_assets.fleet.client import ServerClient
    from dflash_assets.fleet.fleet import open_session
    from dflash_assets.fleet.tuning import LoadSampler, advise, summarize, tuning_table

    async def sample():
        async with open_session() as session:
            clients = [
                ServerClient(session, s.url, Deployment.API_KEY.value() or None) for s in statuses if s.workers is None
            ]  # a gateway has no loads of its own: its workers' rows are sampled
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

    data_dir = args.data_dir or Deployment.DATA_DIR.value()  # a path or an s3:// URI
    if not parquet_files(data_dir, "completions"):
        print(f"dflash report: no completions under {data_dir} (set --data-dir or DFLASH_DATA_DIR)", file=sys.stderr)
        return 2
    from dflash_assets.quality.console import console_for_output, print_answers, verbatim
    from dflash_assets.quality.rejects import read_rejects

    try:
        quality = QualitySettings(trainer=TrainerSettings.taken_from(args, prefix=TRAINER_FLAGS))
    except SettingsError as e:
        print(f"dflash report: {e}", file=sys.stderr)
        return 2
    console = console_for_output()
    answers = print_answers(data_dir, console, quality)
    pictures = _report_pictures(data_dir, answers)
    for line in read_rejects(data_dir).lines(f"{data_dir}/rejects/"):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    for picture in pictures:
        verbatim(console, f"picture: {picture}")
    if args.open:
        import webbrowser

        for picture in pictures:
            webbrowser.open(picture.resolve().as_uri())
    console.print()
    print_report(data_dir, console, quality=quality)
    return 0


def _report_pictures(data_dir: str, answers) -> list[Path]:
    """Each config's histogram of completion lengths and cap plan (survival curve), in the answers' order (the
    latest config first), after one histogram of every config side by side when there are several; written beside
    the report, under the data dir's reports/ (DFLASH_LOCAL_DIR when the data dir is an object store)."""
    from dflash_assets.quality.histogram import series, write_histogram
    from dflash_assets.quality.planner_plot import cap_plan_png
    from dflash_assets.store.storage import is_uri

    reports = Path(Deployment.LOCAL_DIR.value() if is_uri(data_dir) else data_dir) / "reports"
    every = series(data_dir)  # one read: a series per (config, cap)
    several = len({h for h, *_ in every}) > 1
    pictures = [write_histogram(every, reports / "completion_lengths.png", None)] if several else []
    for answer in answers:
        if own := [s for s in every if s[0] == answer.config_hash]:
            pictures.append(write_histogram(own, reports / f"completion_lengths-{answer.config_hash}.png", None))
        if answer.plan is not None:
            path = reports / f"cap_plan-{answer.config_hash}.png"
            wp = answer.window_plan
            path.write_bytes(cap_plan_png(answer.plan, (wp.max_length, wp.window_at) if wp else None))
            pictures.append(path)
    return pictures


def _urls(text: str) -> list[str]:
    """--urls, checked by the one URL parser (fleet/attach.py: no duplicates, no credentials in a URL)."""
    from dflash_assets.fleet.attach import AttachError, parse_urls

    try:
        return parse_urls(text)
    except AttachError as e:
        raise argparse.ArgumentTypeError(str(e)) from None  # argparse shows only this kind's message


def _json_object(text: str) -> dict:
    """A dict setting's flag (chat_template_kwargs): a JSON object."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": true}}', got {text!r}")
    return value


def settings_flags(
    parser: argparse.ArgumentParser,
    model: type[Settings],
    required: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
    defaults: dict | None = None,
    prefix: str = "",
) -> None:
    """One flag per field of a settings model (`max_output_tokens` -> `--max-output-tokens`), with the model's
    default and description: the defaults are settings.py's, never written here, except a command's own
    `defaults` (the demo's cap). `skip`: fields another model already gave a flag. `prefix`: the group's flags
    name it (TrainerSettings: `--trainer-max-length`); `Settings.taken_from(args, prefix)` reads them back."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag, default = "--" + (prefix + name).replace("_", "-"), (defaults or {}).get(name, field.default)
        kind: typing.Any = next((t for t in typing.get_args(field.annotation) if t is not type(None)), field.annotation)
        # a Literal's values are argparse's choices: --help lists them, a wrong one is a one-line usage error
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else None
        kind = str if choices else kind
        kind = _json_object if kind is dict else kind
        shown = "" if default in (None, "") else f" (default {default})"
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=(field.description or "") + shown
            )
        else:
            parser.add_argument(
                flag,
                type=kind,
                choices=choices,
                default=None if name in required else default,
                required=name in required,
                help=(field.description or "") + shown,
            )


ATTACHED = ("mode", "urls", "num_servers", "emulator_args")  # FleetSettings a command on --urls has no use for


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dflash", description=__doc__)
    sub = parser.add_subparsers(dest="subcommand", required=True)  # `--command` is a launch setting

    demo = sub.add_parser(
        "demo",
        help="run the whole pipeline through Dagster on an emulated SGLang fleet",
        description="Materialise every shard of the bundled demo prompts (or --prompts) through "
        "Dagster on emulated SGLang servers, run the checks and print a summary. "
        "Re-running resumes: committed completions are not generated again.",
    )
    backfill = sub.add_parser(
        "backfill",
        help="materialise a range of shards through Dagster, as a UI backfill does",
        description="Runs of up to DFLASH_SHARDS_PER_RUN shards (each streaming its shards "
        "through one dispatcher), executed here one after the other on the "
        "instance in DAGSTER_HOME with the fleet of DFLASH_FLEET_MODE. A failed "
        "run is resumed by running the same range again.",
    )
    backfill.add_argument("--from", dest="first", help="first shard key (default: the first)")
    backfill.add_argument("--to", dest="last", help="last shard key (default: the last)")
    for p, defaults in ((demo, DEMO_DEFAULTS), (backfill, SHARD_RUN_DEFAULTS)):
        settings_flags(p, RequestSettings, defaults=defaults)
        settings_flags(p, DispatchSettings, defaults=defaults)
        settings_flags(p, TrainerSettings, prefix=TRAINER_FLAGS)
        p.add_argument(
            "--prompts",
            help="a JSONL or Parquet prompt source (default: DFLASH_PROMPTS, else the bundled demo prompts)",
        )
        p.add_argument(
            "--shard-size",
            type=int,
            help=f"prompts per shard (default {Deployment.SHARD_SIZE.name}, else {Deployment.SHARD_SIZE.default})",
        )
        p.add_argument(
            "--servers",
            type=int,
            help=f"emulated servers (default {Deployment.NUM_SERVERS.name}, else {Deployment.NUM_SERVERS.default})",
        )
        p.add_argument(
            "--verbose",
            action="store_true",
            help="also print Dagster's event stream here (it always goes to the run's event log)",
        )

    cont = sub.add_parser(
        "continue",
        help="raise the cap without bias: continue cut rows from where they stopped",
        description="Runs continued_completions over the shards through Dagster: every row cut at "
        "the smaller cap is taken on to --to from where it stopped, every row that "
        "stopped is copied, so the new config's lengths are those of a clean run at "
        "the larger cap. Rows without token ids are continued by their text (the "
        "chat route's continue_final_message).",
    )
    cont.add_argument("--to", dest="to_cap", type=int, help="the new cap, e.g. 8192")
    cont.add_argument(
        "--to-window",
        type=int,
        help="grow the trainer's window of a cap_policy window config, e.g. "
        "8192: window-complete rows are continued to it by token ids, "
        "rows that stopped stay",
    )
    cont.add_argument("--from-shard", dest="first", help="first shard key (default: the first)")
    cont.add_argument("--to-shard", dest="last", help="last shard key (default: the last)")
    cont.add_argument("--prompts", help=argparse.SUPPRESS)
    cont.add_argument("--shard-size", type=int, help=argparse.SUPPRESS)
    cont.add_argument(
        "--servers",
        type=int,
        help=f"emulated servers (default {Deployment.NUM_SERVERS.name}, else {Deployment.NUM_SERVERS.default})",
    )
    cont.add_argument("--verbose", action="store_true", help="also print Dagster's event stream here")

    configs = sub.add_parser(
        "configs",
        help="list the configs of a data dir side by side: cap and policy, rows, complete or not, last written",
        description="Reads the rows' own provenance (small columns only); the latest, the most recently "
        "written, first: what `dflash export` takes by default.",
    )
    configs.add_argument("--data-dir", help="default: DFLASH_DATA_DIR, else data/")
    configs.add_argument("--verbose", action="store_true", help="print the stack trace of an error")
    export = sub.add_parser(
        "export",
        help="write the training set of one config (gated by the blocking checks), as the UI does",
        description="Materialises drafter_training_set (and length_quality_summary) of one config through "
        "Dagster on the instance in DAGSTER_HOME: the same asset and checks as the UI.",
    )
    export.add_argument(
        "--config", default="latest", help="a config hash, latest (the most recently written: default) or all"
    )
    export.add_argument("--verbose", action="store_true", help="also print Dagster's event stream here")
    export.add_argument("--prompts", help=argparse.SUPPRESS)
    export.add_argument("--shard-size", type=int, help=argparse.SUPPRESS)
    export.add_argument("--servers", type=int, help=argparse.SUPPRESS)
    settings_flags(configs, TrainerSettings, skip=("format", "chat_template"), prefix=TRAINER_FLAGS)  # the window
    settings_flags(export, TrainerSettings, prefix=TRAINER_FLAGS)  # the window and the form, as demo's

    gen = sub.add_parser(
        "generate",
        help="generate one shard's completions without Dagster (the same engine)",
        description="Needs the shard's prompt_shards file; resumes from committed parts.",
    )
    gen.add_argument("--shard", required=True, help="shard key, e.g. 00003")
    gen.add_argument("--urls", required=True, type=_urls, help="comma-separated server base URLs")
    gen.add_argument("--data-dir", default=Deployment.DATA_DIR.value())
    settings_flags(gen, RequestSettings)
    settings_flags(gen, DispatchSettings)
    settings_flags(gen, TrainerSettings, skip=("format", "chat_template"), prefix=TRAINER_FLAGS)  # the window only
    settings_flags(gen, FleetSettings, skip=ATTACHED)
    gen.add_argument("--verbose", action="store_true", help="print the stack trace of a failure")

    probe = sub.add_parser(
        "probe",
        help="run the length probe without Dagster (the same code as length_probe)",
        description="Samples the prompts of a data dir (seeded, stratified by shard and source), "
        "generates them at a high cap into <data-dir>/length_probe/, and prints the "
        "share still cut at candidate caps, measured, and the next command. A re-run "
        "with the same sample and settings resumes.",
    )
    probe.add_argument("--urls", required=True, type=_urls, help="comma-separated server base URLs")
    probe.add_argument("--data-dir", default=Deployment.DATA_DIR.value())
    probe.add_argument("--shards", help="comma-separated shard keys to sample (default: every prompt shard)")
    settings_flags(probe, ProbeSettings)
    # the probe's own cap, above; it measures lengths, so its requests are never sized to a window
    settings_flags(probe, RequestSettings, skip=("max_output_tokens", "cap_policy", "overshoot"))
    settings_flags(probe, DispatchSettings)
    settings_flags(probe, FleetSettings, skip=ATTACHED)
    probe.add_argument("--verbose", action="store_true", help="print the stack trace of a failure")

    fleet = sub.add_parser(
        "fleet",
        help="launch, inspect and stop SGLang servers (launch mode)",
        description="Servers started by `fleet up` are detached: they outlive this command and "
        "every run, and later `up`s reuse them while healthy with the same args.",
    )
    fleet.add_argument("--fleet-dir", help="registry and logs (default: $DAGSTER_HOME/fleet)")
    fleet.add_argument("--verbose", action="store_true", help="print the stack trace of a failure")
    fsub = fleet.add_subparsers(dest="fleet_command", required=True)
    fup = fsub.add_parser("up", help="start (or reuse) one server per GPU and wait until healthy")
    fup.add_argument("--replace", action="store_true", help="replace servers whose args differ")
    settings_flags(fup, LaunchSettings, required=("model_path",))
    fstatus = fsub.add_parser("status", help="health, context length, max running requests, load of each server")
    fstatus.add_argument("--urls", type=_urls, help="also (or only) these attached servers, comma-separated")
    fstatus.add_argument(
        "--watch",
        type=float,
        metavar="SECONDS",
        help="sample /v1/loads for this long and print tuning advice (slots, KV, queue)",
    )
    fdown = fsub.add_parser("down", help="stop servers started by `fleet up`")
    fdown.add_argument("names", nargs="*", help="server names (default: all), e.g. gpu0")

    sub.add_parser("emulator", help="run one SGLang 0.5.23 emulator server (SGLang's flag names)", add_help=False)

    report = sub.add_parser(
        "report",
        help="print the length-quality summary of a data dir",
        description="Reads the Parquet files directly; works without the webserver.",
    )
    report.add_argument("--data-dir", help="default: DFLASH_DATA_DIR, else data/")
    settings_flags(report, TrainerSettings, prefix=TRAINER_FLAGS)  # the window fixed-cap rows are judged against
    report.add_argument(
        "--open", action="store_true", help="open the pictures (length histogram, cap plan survival curve) in a browser"
    )
    report.add_argument("--verbose", action="store_true", help="print the stack trace of a failure")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["emulator"]:
        return _emulator(argv[1:])
    args = build_parser().parse_args(argv)
    command = {
        "demo": _demo,
        "backfill": _backfill,
        "continue": _continue,
        "generate": _generate,
        "configs": _configs,
        "export": _export,
        "probe": _probe,
        "fleet": _fleet,
        "report": _report,
    }[args.subcommand]
    try:
        return command(args)
    except Exception as e:  # the first cause in one line; its stack trace with --verbose (or in the run's event log)
        return _failed(args, e)


def _failed(args: argparse.Namespace, error: Exception) -> int:
    """An error that stopped a command, in one line on stderr: exit 2 for bad input or settings, else 1."""
    import traceback

    from dflash_assets.fleet.attach import AttachError
    from dflash_assets.fleet.client import ServerError
    from dflash_assets.generation.preflight import PreflightError
    from dflash_assets.generation.prompts import SourceError
    from dflash_assets.generation.slots import FleetDown
    from dflash_assets.store.exhaustion import exhaustion

    command = " ".join(["dflash", args.subcommand, *([args.fleet_command] if args.subcommand == "fleet" else [])])
    if args.verbose:
        traceback.print_exception(error, file=sys.stderr)
    bad = isinstance(error, BadInput | SettingsError | SourceError | PreflightError | AttachError)
    down = isinstance(error, ServerError | FleetDown)
    text = (error.message if isinstance(error, ServerError) else str(error) or type(error).__name__).splitlines()[0]
    data_dir = getattr(args, "data_dir", None) or Deployment.DATA_DIR.value()
    if (ran_out := exhaustion(error, data_dir)) is not None:  # a full disk: where, what is left, what to do
        print(f"{command}: {ran_out.line(None)}", file=sys.stderr)
        return 1
    if not bad and not down:
        text = f"{type(error).__name__}: {text}"
    if down:
        text += "; run the same command again once the servers answer (committed completions are kept)"
    elif not bad and not args.verbose:
        text += f" (`{command} ... --verbose` prints the stack trace)"
    print(f"{command}: {text}", file=sys.stderr)
    return 2 if bad else 1


if __name__ == "__main__":
    sys.exit(main())
