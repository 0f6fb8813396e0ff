"""The command line of one `sglang serve` (0.5.23): ServerCommand, from settings.ServerSettings, a port, GPUs and
extra args; its argv and its hash. Only flags that exist in 0.5.23 are emitted (tests/fleet/test_server_args.py);
gone ones are refused in `extra_args` too, named with their replacement. The API key is not a field (launcher.py).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from dflash_assets.settings import LaunchSettings, ServerSettings

# Ways to start a server (the only place these tuples are written); any of them takes the same flags.
SGLANG_SERVE = ("sglang", "serve")
SGLANG_LAUNCH_SERVER = (sys.executable, "-m", "sglang.launch_server")
EMULATOR = (sys.executable, "-m", "dflash_assets.emulator")
# LaunchSettings.command's names for them
COMMANDS = {"sglang": SGLANG_SERVE, "launch_server": SGLANG_LAUNCH_SERVER, "emulator": EMULATOR}

# Flags gone in 0.5.23, with what to write instead.
REMOVED_FLAGS = {
    "--cuda-graph-max-bs": "cuda_graph_max_bs_decode (--cuda-graph-max-bs-decode)",
    "--mamba-scheduler-strategy": "--mamba-radix-cache-strategy",
}
# Never in extra_args: the key travels from the environment, never through config, the registry or a hash.
SECRET_FLAGS = ("--api-key", "--admin-api-key")


class ServerCommandError(ValueError):
    pass


# The defaults are settings.ServerSettings' (tests/test_settings.py checks the fields match): written once.
_FLAGS = ServerSettings()


@dataclass(frozen=True)
class ServerCommand:
    """One server's command line as data; `None` (SGLang decides) emits no flag."""

    model_path: str
    served_model_name: str | None = _FLAGS.served_model_name
    host: str = _FLAGS.host
    port: int = LaunchSettings().base_port
    tp_size: int = _FLAGS.tp_size
    context_length: int | None = _FLAGS.context_length
    max_running_requests: int | None = _FLAGS.max_running_requests
    max_mamba_cache_size: int | None = _FLAGS.max_mamba_cache_size
    mem_fraction_static: float | None = _FLAGS.mem_fraction_static
    chunked_prefill_size: int | None = _FLAGS.chunked_prefill_size
    cuda_graph_max_bs_decode: int | None = _FLAGS.cuda_graph_max_bs_decode
    reasoning_parser: str | None = _FLAGS.reasoning_parser
    enable_metrics: bool = _FLAGS.enable_metrics
    max_queued_requests: int | None = _FLAGS.max_queued_requests
    stream_interval: int | None = _FLAGS.stream_interval
    extra_args: tuple[str, ...] = field(default=())
    gpus: tuple[int, ...] = ()  # not a flag: CUDA_VISIBLE_DEVICES of the child (tp_size ids); () inherits it

    def __post_init__(self):
        # Tuples keep the record hashable and its hash stable whatever sequence the caller passed.
        object.__setattr__(self, "gpus", tuple(int(g) for g in self.gpus))
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))
        self.validate()

    def validate(self) -> None:
        if not self.model_path:
            raise ServerCommandError("model_path is required (a local directory or a Hugging Face repo id)")
        if not 0 < self.port < 65536:
            raise ServerCommandError(f"port must be in 1..65535, got {self.port}")
        if self.served_model_name and ":" in self.served_model_name:
            raise ServerCommandError(
                f"served_model_name must not contain ':' (SGLang reads it as base:adapter), "
                f"got {self.served_model_name!r}"
            )
        if self.gpus and len(self.gpus) != self.tp_size:
            raise ServerCommandError(f"tp_size {self.tp_size} needs {self.tp_size} GPUs, got {list(self.gpus)}")
        for name in (
            "tp_size",
            "context_length",
            "max_running_requests",
            "max_mamba_cache_size",
            "cuda_graph_max_bs_decode",
            "max_queued_requests",
            "stream_interval",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ServerCommandError(f"{name} must be a positive integer, got {value}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ServerCommandError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        self._check_extra_args()

    def _check_extra_args(self) -> None:
        typed = {flag for flag, _ in self._typed_flags()}
        for arg in self.extra_args:
            if not arg.startswith("--"):
                continue
            flag = arg.split("=", 1)[0]
            if flag in REMOVED_FLAGS:
                raise ServerCommandError(
                    f"extra arg {flag} no longer exists in SGLang 0.5.23; use {REMOVED_FLAGS[flag]}"
                )
            if any(s.startswith(flag) for s in SECRET_FLAGS):
                raise ServerCommandError(
                    f"extra arg {flag}: the API key is read from the environment at launch "
                    f"(DFLASH_API_KEY by default), never passed as config"
                )
            # argparse takes any unique prefix, so `--tp` or `--model` would silently fight a typed field.
            clash = sorted(t for t in typed if t.startswith(flag))
            if clash:
                raise ServerCommandError(
                    f"extra arg {flag} sets {clash[0]}, which is a typed field: "
                    f"set {clash[0][2:].replace('-', '_')} instead"
                )

    def _typed_flags(self) -> list[tuple[str, object]]:
        """(flag, value) for every typed field that is a flag, in a fixed order."""
        return [
            ("--" + f.name.replace("_", "-"), getattr(self, f.name))
            for f in fields(self)
            if f.name not in ("gpus", "extra_args")
        ]

    def flags(self) -> list[str]:
        """The flags and values, without the executable and without the key."""
        out: list[str] = []
        for flag, value in self._typed_flags():
            if value is None or value is False:
                continue
            out += [flag] if value is True else [flag, str(value)]
        return out + list(self.extra_args)

    def argv(self, command: tuple[str, ...] | list[str] = SGLANG_SERVE) -> list[str]:
        return [*command, *self.flags()]

    def canonical(self) -> dict:
        """The args as plain JSON data: what the registry records and what is hashed."""
        data = asdict(self)
        data["gpus"], data["extra_args"] = list(self.gpus), list(self.extra_args)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ServerCommand:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ServerCommandError(f"unknown server args: {', '.join(unknown)}")
        values: dict[str, Any] = {k: tuple(v) if k in ("gpus", "extra_args") else v for k, v in data.items()}
        return cls(**values)


def args_hash(args: ServerCommand, command: tuple[str, ...] | list[str] = SGLANG_SERVE) -> str:
    """sha256 of the canonical args and the command (the same flags on another install is another server)."""
    blob = json.dumps({"command": list(command), "args": args.canonical()}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def diff(old: dict, new: dict) -> list[str]:
    """What differs between two canonical args dicts, as `name: old -> new` lines."""
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
