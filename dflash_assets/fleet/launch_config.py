"""One way to turn launch settings (from CLI flags or Dagster config) into a FleetSpec."""

from __future__ import annotations

import shlex

from dflash_assets.fleet.launcher import FleetSpec
from dflash_assets.fleet.server_args import EMULATOR, SGLANG_LAUNCH_SERVER, SGLANG_SERVE, ServerArgs
from dflash_assets.settings import Deployment, LaunchSettings, ServerFlags

COMMANDS = {"sglang": SGLANG_SERVE, "launch_server": SGLANG_LAUNCH_SERVER, "emulator": EMULATOR}


def parse_command(command: str) -> tuple[str, ...]:
    """'sglang' | 'launch_server' | 'emulator', or a full command line such as '/opt/sgl/bin/sglang serve'."""
    return COMMANDS.get(command) or tuple(shlex.split(command))


def parse_gpus(gpus: str) -> tuple[int, ...]:
    try:
        return tuple(int(g) for g in gpus.split(",") if g.strip())
    except ValueError:
        raise ValueError(f"gpus must be comma-separated GPU ids such as '0,1,2,3', got {gpus!r}") from None


def build_spec(settings: LaunchSettings, api_key_env: str = Deployment.API_KEY.name) -> FleetSpec:
    if not settings.model_path:
        raise ValueError("launch mode needs a model path (the model every server loads)")
    # every flag passed as set, None included: None is "SGLang decides", not "take the default"
    flags = {name: getattr(settings, name) for name in ServerFlags.model_fields}
    args = ServerArgs(model_path=settings.model_path, extra_args=tuple(shlex.split(settings.extra_args)), **flags)
    return FleetSpec(server=args, gpus=parse_gpus(settings.gpus), base_port=settings.base_port,
                     command=parse_command(settings.command), api_key_env=api_key_env,
                     health_timeout_s=settings.health_timeout_s)
