"""The settings of a shard command's flags, and the flags that give them again in the next command it prints."""

from __future__ import annotations

import argparse

from dflash_assets.cli.parser import build_parser
from dflash_assets.generation.request import request_cap as cap_of
from dflash_assets.settings import TRAINER_FLAGS, DispatchSettings, GenerationSettings, RequestSettings, TrainerSettings


def _completions_config(command: str, args: argparse.Namespace) -> tuple[dict, TrainerSettings]:
    """The `completions` run config of the flags and the trainer's settings; a bad one raises SettingsError."""
    trainer, generation, dispatch = run_settings(args)
    return {**RequestSettings.taken_from(generation).model_dump(), **dispatch.model_dump()}, trainer


def run_settings(args: argparse.Namespace) -> tuple[TrainerSettings, GenerationSettings, DispatchSettings]:
    """The trainer's, generation (sized to its window) and dispatch settings of the flags, each checked."""
    trainer = TrainerSettings.taken_from(args, prefix=TRAINER_FLAGS)
    return trainer, GenerationSettings.of(args, trainer), DispatchSettings.taken_from(args)


def trainer_flags(trainer: TrainerSettings) -> dict:
    """The trainer's settings under their flags' names (trainer_max_length: --trainer-max-length)."""
    return {TRAINER_FLAGS + name: value for name, value in trainer.model_dump().items()}


def repeated_flags(command: str, config: dict, required: tuple[str, ...] = ()) -> str:
    """The flags that give `config` again, the cap and the command's defaults left out, so a suggested next command
    makes the same config for the same trainer. `required`: the command's required flags, for its defaults."""
    import json
    import shlex

    defaults = vars(build_parser().parse_args([command, *required]))
    flags = []
    for name, value in config.items():
        if name == "max_output_tokens" or value == defaults[name]:
            continue
        flag = "--" + name.replace("_", "-")
        text = json.dumps(value) if isinstance(value, dict) else str(value)
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, shlex.quote(text)]
    return "".join(" " + f for f in flags)


def request_cap(config: dict, trainer: TrainerSettings) -> int:
    """The largest request cap of a `completions` config (generation/request.py request_cap)."""
    return cap_of(GenerationSettings.of(argparse.Namespace(**config), trainer), 1)


def refuse_cap_beyond_context(command: str, request_cap: int) -> None:
    """A request cap that leaves no prompt room in a context known before the run: BadInput."""
    from dflash_assets.cli.errors import BadInput
    from dflash_assets.generation.preflight import cap_refusal
    from dflash_assets.settings import Deployment

    known = known_context()
    if known and (refused := cap_refusal(known[0], request_cap, known[1], _largest(Deployment.DATA_DIR.value()))):
        raise BadInput(f"{refused} (dflash {command} did not start)")


def _largest(data_dir: str) -> int:
    """The data dir's largest prompt (the context to ask for holds it), 1 before its shards are built."""
    from dflash_assets.store.stores import largest_prompt

    try:
        return largest_prompt(data_dir) or 1
    except OSError:
        return 1


def known_context() -> tuple[int, str] | None:
    """The servers' context length before the run, and where it was read, or None when it cannot be known yet."""
    import contextlib
    import io
    import shlex

    from dflash_assets.settings import Deployment

    mode = Deployment.FLEET_MODE.value()
    try:
        if mode == "emulated":
            from dflash_assets.emulator.config import resolve
            from dflash_assets.emulator.process import server_argv

            flags = Deployment.EMULATOR_ARGS.value()
            with contextlib.redirect_stderr(io.StringIO()):  # a bad flag: the run's start says it
                context = resolve(server_argv(shlex.split(flags))).context_len
            return context, f"the emulated servers' flags: {flags or 'the defaults'}"
        from dflash_assets.fleet import status
        from dflash_assets.fleet.launcher import default_fleet_dir

        if mode == "attach":
            statuses = status.fleet_status(attach_urls=Deployment.FLEET_URLS.value())
        elif mode == "launch":
            statuses = status.fleet_status(default_fleet_dir())
        else:
            return None  # a mode the run refuses in its own words
    except (SystemExit, ValueError, OSError):  # flags or URLs the run refuses in its own words
        return None
    contexts = [s.context_length for s in statuses if s.healthy and s.context_length]
    return (min(contexts), "read from the servers") if contexts else None
