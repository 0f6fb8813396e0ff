"""The parser of `dflash`: every command's flags, the settings' flags derived from settings.py's models, and usage
errors in one line."""

from __future__ import annotations

import argparse
import re
import typing

from dflash_assets.settings import (
    TRAINER_FLAGS,
    Deployment,
    DispatchSettings,
    FleetSettings,
    LaunchSettings,
    ProbeSettings,
    RequestSettings,
    Settings,
    TrainerSettings,
)


class Parser(argparse.ArgumentParser):
    """A usage error in one line (the flag, what it takes, `--help`); a flag is never abbreviated."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {usage_problem(message)}; `{self.prog} --help` for more\n")

    def parse_args(self, args=None, namespace=None):
        """An unknown flag is said by the (sub)command it was given to: its --help, and the closest flag it has."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = chosen_command(self, parsed)
            command.error(unknown_flag(unknown, command))
        return parsed


def chosen_command(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser that `parsed` went through (`dflash fleet up`'s for fleet up)."""
    for action in parser._actions:  # argparse keeps its subcommands only in this action
        if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) in action.choices:
            return chosen_command(action.choices[getattr(parsed, action.dest)], parsed)
    return parser


def unknown_flag(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """What was not understood, with the closest of the command's flags (difflib) when one is close."""
    import difflib

    given = next((u.split("=", 1)[0] for u in unknown if u.startswith("-")), None)
    if given is None:
        return f"unrecognized arguments: {' '.join(unknown)}"
    flags = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(given, flags, n=1)
    return f"no flag {given}" + (f" (did you mean {close[0]}?)" if close else "")


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


# `dflash demo` and `dflash backfill` store token ids (`dflash continue` needs them); the rest is settings.py's
SHARD_RUN_DEFAULTS = {"store_token_ids": True}


def _urls(text: str) -> list[str]:
    """--urls, checked by the one URL parser (fleet/attach.py: no duplicates, no credentials in a URL)."""
    from dflash_assets.fleet.attach import AttachError, parse_urls

    try:
        return parse_urls(text)
    except AttachError as e:
        raise argparse.ArgumentTypeError(str(e)) from None  # argparse shows only this kind's message


def _servers(text: str) -> int:
    """--servers: how many emulated servers, at least one (FleetSettings.num_servers)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number of servers, at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes at least 1 server, got {value}")
    return value


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
    """One flag per field of a settings model, with its default and description (a command's own `defaults`
    aside). `skip`: fields another model gave a flag. `prefix`: the group's flags name it (`--trainer-max-length`),
    read back by `Settings.taken_from(args, prefix)`."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag, default = "--" + (prefix + name).replace("_", "-"), (defaults or {}).get(name, field.default)
        kind: typing.Any = next((t for t in typing.get_args(field.annotation) if t is not type(None)), field.annotation)
        # a Literal's values are argparse's choices: --help lists them, a wrong one is a one-line usage error
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else None
        kind = str if choices else kind
        kind = _json_object if kind is dict else kind
        said = (field.description or "") + ("" if default in (None, "") else f" (default {default})")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=said)
        else:
            required_ = name in required
            parser.add_argument(
                flag, type=kind, choices=choices, default=None if required_ else default, required=required_, help=said
            )


ATTACHED = ("mode", "urls", "num_servers", "emulator_args")  # FleetSettings a command on --urls has no use for
NOT_THE_WINDOW = ("name", "format", "chat_template")  # TrainerSettings but the window, for a command that judges by it
SERVERS_HELP = f"emulated servers (default {Deployment.NUM_SERVERS.name}, else {Deployment.NUM_SERVERS.default})"


def data_flags(parser: argparse.ArgumentParser, prompts: bool = True) -> None:
    """--data-dir and --prompts, each over its environment variable (cli/environment.py)."""
    d = Deployment
    parser.add_argument(
        "--data-dir", help=f"where the data lives (default: {d.DATA_DIR.name}, else {d.DATA_DIR.default}/)"
    )
    if prompts:
        parser.add_argument(
            "--prompts",
            help=f"a JSONL or Parquet prompt source (default: {d.PROMPTS.name}, else the source the data dir's shards "
            "record, else the bundled demo prompts)",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dflash",
        description="Turn a prompt set into training data for a DFlash drafter: the prompts in shards, a completion "
        "for each from a fleet of SGLang servers (emulated ones by default), the truncation checked, and the rows that "
        "pass exported for the trainer. Start with `dflash demo` (the bundled prompts) or `dflash demo --prompts "
        "mine.jsonl --data-dir runs/mine`; each command has its --help.",
    )
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
    for p in (demo, backfill):
        settings_flags(p, RequestSettings, defaults=SHARD_RUN_DEFAULTS)
        settings_flags(p, DispatchSettings, defaults=SHARD_RUN_DEFAULTS)
        settings_flags(p, TrainerSettings, prefix=TRAINER_FLAGS)
        data_flags(p)
        p.add_argument(
            "--shard-size",
            type=int,
            help=f"prompts per shard (default {Deployment.SHARD_SIZE.name}, else {Deployment.SHARD_SIZE.default})",
        )
        p.add_argument("--servers", type=_servers, help=SERVERS_HELP)
        p.add_argument(
            "--verbose",
            action="store_true",
            help="also print Dagster's event stream here (it always goes to the run's event log)",
        )
        p.add_argument(
            "--full",
            action="store_true",
            help="end with every reject, check, kept note and the cap plan (as dflash report --full), not the answer",
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
    data_flags(cont)
    cont.add_argument("--servers", type=_servers, help=SERVERS_HELP)
    cont.add_argument("--verbose", action="store_true", help="also print Dagster's event stream here")

    configs = sub.add_parser(
        "configs",
        help="list the configs of a data dir side by side: cap and policy, rows, complete or not, last written",
        description="Reads the rows' own provenance (small columns only); the latest, the most recently "
        "written, first: what `dflash export` takes by default.",
    )
    data_flags(configs, prompts=False)
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
    data_flags(export)
    settings_flags(configs, TrainerSettings, skip=NOT_THE_WINDOW, prefix=TRAINER_FLAGS)  # the window
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
    settings_flags(gen, TrainerSettings, skip=NOT_THE_WINDOW, prefix=TRAINER_FLAGS)  # the window only
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
    data_flags(report, prompts=False)
    settings_flags(report, TrainerSettings, prefix=TRAINER_FLAGS)  # the window fixed-cap rows are judged against
    report.add_argument(
        "--open", action="store_true", help="open the pictures (length histogram, cap plan survival curve) in a browser"
    )
    report.add_argument("--full", action="store_true", help="every config's cap plan, the rejects and the tables")
    report.add_argument("--verbose", action="store_true", help="print the stack trace of a failure")
    rejects = sub.add_parser(
        "rejects",
        help="list every rejected prompt of a data dir: its shard, line, stage and reason",
        description="Reads the rejects tables (rejects/): the source's (a bad line), the preflight's and the server's.",
    )
    data_flags(rejects, prompts=False)
    rejects.add_argument("--verbose", action="store_true", help="print the stack trace of a failure")
    return parser
