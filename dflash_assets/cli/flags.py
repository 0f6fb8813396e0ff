"""The settings of a shard command's flags, and the flags that give them again in the next command it prints."""

from __future__ import annotations

import argparse

from dflash_assets.cli.parser import build_parser
from dflash_assets.settings import TRAINER_FLAGS, DispatchSettings, GenerationSettings, RequestSettings, TrainerSettings


def _completions_config(command: str, args: argparse.Namespace) -> tuple[dict, TrainerSettings]:
    """The `completions` run config of the flags (every request and dispatch setting) and the trainer's settings
    (its window, which the window policy sizes requests to, and its form); a bad one raises SettingsError."""
    trainer, generation, dispatch = run_settings(args)
    return {**RequestSettings.taken_from(generation).model_dump(), **dispatch.model_dump()}, trainer


def run_settings(args: argparse.Namespace) -> tuple[TrainerSettings, GenerationSettings, DispatchSettings]:
    """The trainer's settings of the --trainer-* flags, the generation settings sized to its window and the dispatch
    settings, each checked as it is built (a bad one raises SettingsError: errors.py says it, exit 2)."""
    trainer = TrainerSettings.taken_from(args, prefix=TRAINER_FLAGS)
    return trainer, GenerationSettings.of(args, trainer), DispatchSettings.taken_from(args)


def trainer_flags(trainer: TrainerSettings) -> dict:
    """The trainer's settings under their flags' names (trainer_max_length: --trainer-max-length)."""
    return {TRAINER_FLAGS + name: value for name, value in trainer.model_dump().items()}


def repeated_flags(command: str, config: dict, required: tuple[str, ...] = ()) -> str:
    """The flags that give `config` again (trainer_flags among them), leaving out the cap and what the command's
    defaults already give: the next command a run suggests (another cap) must generate with the same settings, or
    it makes another config, and be judged and exported for the same trainer. `required`: the command's required
    flags with any value, for its defaults (given in the printed command apart)."""
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
