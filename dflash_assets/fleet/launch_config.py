"""One way to turn settings (CLI flags or Dagster config, as plain strings and numbers) into a FleetSpec."""

from __future__ import annotations

import shlex
import sys

from dflash_assets.fleet.launcher import FleetSpec
from dflash_assets.fleet.server_args import EMULATOR, ServerArgs

COMMANDS = {"sglang": ("sglang", "serve"), "launch_server": (sys.executable, "-m", "sglang.launch_server"),
            "emulator": EMULATOR}


def parse_command(command: str) -> tuple[str, ...]:
    """'sglang' | 'launch_server' | 'emulator', or a full command line such as '/opt/sgl/bin/sglang serve'."""
    return COMMANDS.get(command) or tuple(shlex.split(command))


def parse_gpus(gpus: str) -> tuple[int, ...]:
    try:
        return tuple(int(g) for g in gpus.split(",") if g.strip())
    except ValueError:
        raise ValueError(f"gpus must be comma-separated GPU ids such as '0,1,2,3', got {gpus!r}") from None


def build_spec(*, model_path: str, gpus: str = "0", command: str = "sglang", base_port: int = 30000,
               api_key_env: str = "DFLASH_API_KEY", health_timeout_s: float = 1200.0, extra_args: str = "",
               **server: object) -> FleetSpec:
    if not model_path:
        raise ValueError("launch mode needs a model path (the model every server loads)")
    args = ServerArgs(model_path=model_path, extra_args=tuple(shlex.split(extra_args)),
                      **{k: v for k, v in server.items() if v is not None})
    return FleetSpec(server=args, gpus=parse_gpus(gpus), base_port=base_port, command=parse_command(command),
                     api_key_env=api_key_env, health_timeout_s=health_timeout_s)
