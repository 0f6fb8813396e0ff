"""Resources: the SGLang fleet, the prompt source and the data dir. Settings come from the environment."""

from __future__ import annotations

import asyncio
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Optional

import dagster as dg
from pydantic import PrivateAttr

from dflash_assets.fleet.attach import parse_urls
from dflash_assets.fleet.fleet import Fleet, connect
from dflash_assets.generation.prompts import FieldMapping

DEMO_PROMPTS = Path(__file__).resolve().parent.parent / "demo" / "prompts.jsonl"
FLEET_MODES = ("emulated", "attach", "launch")


class LaunchSettings(dg.Config):
    """`launch` mode: the `sglang serve` every server runs (one per GPU, or per tp_size GPUs)."""

    model_path: str = ""
    served_model_name: Optional[str] = None
    gpus: str = "0"  # comma-separated GPU ids
    base_port: int = 30000  # the server on GPU g listens on base_port + g
    host: str = "127.0.0.1"
    tp_size: int = 1
    context_length: Optional[int] = None
    max_running_requests: Optional[int] = None
    max_mamba_cache_size: Optional[int] = None
    mem_fraction_static: Optional[float] = None
    chunked_prefill_size: Optional[int] = None
    cuda_graph_max_bs_decode: Optional[int] = None
    reasoning_parser: Optional[str] = "qwen3"
    enable_metrics: bool = True
    max_queued_requests: Optional[int] = None
    extra_args: str = ""
    command: str = "sglang"  # 'sglang' (sglang serve), 'launch_server', 'emulator', or a full command line
    health_timeout_s: float = 1200.0


class FleetResource(dg.ConfigurableResource):
    """The SGLang servers completions are generated on.

    `emulated` starts `num_servers` local SGLang emulators for the run and stops them after it;
    `attach` uses servers someone else runs (or an SGLang router / gateway URL in front of many);
    `launch` starts one `sglang serve` per GPU, detached so it outlives the run, recorded in
    `$DAGSTER_HOME/fleet/registry.json`, and reuses it in later runs while it is healthy and launched
    with the same args (`dflash fleet down` stops them).
    The API key is read from the environment variable named by `api_key_env`, never from config,
    so it never shows in the launchpad, the run config or the logs.
    """

    mode: str = "emulated"
    urls: str = ""  # attach: comma-separated base URLs, e.g. http://10.0.0.5:30000,http://10.0.0.6:30000
    num_servers: int = 2
    emulator_args: str = "--reasoning-parser qwen3"  # emulated: emulator flags, e.g. add "--decode-tokens-per-s 4000"
    api_key_env: str = "DFLASH_API_KEY"
    health_timeout_s: float = 120.0
    request_timeout_s: float = 3600.0
    launch: LaunchSettings = LaunchSettings()

    _urls: list[str] = PrivateAttr(default_factory=list)

    def validate_settings(self) -> None:
        if self.mode not in FLEET_MODES:
            raise ValueError(f"unknown fleet mode {self.mode!r}: expected one of {', '.join(FLEET_MODES)}")
        if self.mode == "attach" and not self.urls.strip():
            raise ValueError("fleet mode 'attach' needs at least one server URL (set DFLASH_FLEET_URLS)")
        if self.mode == "attach":
            self.url_list()  # a malformed URL is refused here, naming it, before any work
        if self.mode == "emulated" and self.num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {self.num_servers}")

    def url_list(self) -> list[str]:
        return parse_urls(self.urls)

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) or None

    @contextmanager
    def yield_for_execution(self, context: dg.InitResourceContext):
        self.validate_settings()
        with ExitStack() as stack:
            if self.mode == "emulated":
                from dflash_assets.emulator.process import start_emulator

                args = self.emulator_args.split()
                if self.api_key():
                    args += ["--api-key", self.api_key()]
                servers = [stack.enter_context(start_emulator(args)) for _ in range(self.num_servers)]
                self._urls = [s.url for s in servers]
                context.log.info(f"started {len(servers)} emulated SGLang servers: {', '.join(self._urls)}")
            elif self.mode == "launch":
                from dflash_assets.fleet.launch_config import build_spec
                from dflash_assets.fleet.launcher import default_fleet_dir, up

                settings = self.launch.model_dump()
                spec = build_spec(api_key_env=self.api_key_env, **settings)
                self._urls = [r.url for r in up(spec, default_fleet_dir(), on_event=context.log.info)]
            else:
                self._urls = self.url_list()
            yield self

    async def connect(self) -> Fleet:
        """Connect (inside the caller's event loop) and probe every server."""
        return await connect(self._urls, self.api_key(), health_timeout_s=self.health_timeout_s,
                             request_timeout_s=self.request_timeout_s)


class PromptSource(dg.ConfigurableResource):
    """The prompt set (JSONL or Parquet), cut into shards of `shard_size` lines."""

    path: str = str(DEMO_PROMPTS)
    shard_size: int = 100
    # for a source in none of the known formats (generation/prompts.py): the columns holding the id and the turns
    id_field: Optional[str] = None
    messages_field: Optional[str] = None

    def mapping(self) -> FieldMapping | None:
        if not (self.id_field or self.messages_field):
            return None
        return FieldMapping(self.id_field, self.messages_field)

    def resolved(self) -> Path:
        if self.shard_size <= 0:
            raise ValueError(f"shard_size must be a positive integer, got {self.shard_size}")
        return Path(self.path)


class DataDir(dg.ConfigurableResource):
    """Where the Parquet tables live (`DFLASH_DATA_DIR`, default `data/`): a local path or `s3://bucket/prefix`.

    On an object store the tables (prompt shards, completions, rejects, failures) live there; the files made
    for people and trainers (report pictures, the exported training set) are written to `local_path`
    (`DFLASH_LOCAL_DIR`, default `data/`), a local directory. S3 endpoint and credentials come from the
    environment (DFLASH_S3_ENDPOINT or AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), never from config.
    """

    path: str = "data"
    local_path: str = "data"

    def resolved(self) -> Path | str:
        """The data dir for the generation and quality libraries: an absolute Path, or the URI as given."""
        from dflash_assets.generation.storage import is_uri

        return self.path.rstrip("/") if is_uri(self.path) else Path(self.path).resolve()

    def local_dir(self) -> Path:
        """Where local files (reports, training set) go: the data dir itself when it is local."""
        from dflash_assets.generation.storage import is_uri

        return Path(self.local_path if is_uri(self.path) else self.path).resolve()


def from_env() -> dict:
    """The resource map, with every setting taken from the environment where it is set there."""

    def env(name: str, default):
        return dg.EnvVar(name) if name in os.environ else default

    def env_int(name: str, default: int):
        return dg.EnvVar.int(name) if name in os.environ else default

    return {
        "fleet": FleetResource(mode=env("DFLASH_FLEET_MODE", "emulated"), urls=env("DFLASH_FLEET_URLS", ""),
                               num_servers=env_int("DFLASH_NUM_SERVERS", 2),
                               emulator_args=env("DFLASH_EMULATOR_ARGS", "--reasoning-parser qwen3"),
                               launch=LaunchSettings(model_path=env("DFLASH_MODEL_PATH", ""), gpus=env("DFLASH_GPUS", "0"),
                                                     base_port=env_int("DFLASH_BASE_PORT", 30000),
                                                     command=env("DFLASH_SGLANG_COMMAND", "sglang"))),
        "prompt_source": PromptSource(path=env("DFLASH_PROMPTS", str(DEMO_PROMPTS)),
                                      shard_size=env_int("DFLASH_SHARD_SIZE", 100)),
        "data_dir": DataDir(path=env("DFLASH_DATA_DIR", "data"), local_path=env("DFLASH_LOCAL_DIR", "data")),
        "quality": QualityThresholds(),
    }


def run_on_fleet(fleet: FleetResource, work):
    """Run `work(fleet)` (a coroutine function) on a freshly connected fleet, closing the session after."""

    async def go():
        async with await fleet.connect() as connected:
            return await work(connected)

    return asyncio.run(go())


class QualityThresholds(dg.ConfigurableResource):
    """The limits the quality checks judge by (shares of rows, in [0, 1])."""

    truncation_rate_max: float = 0.05
    training_max_length: int = 4096

    def thresholds(self):
        from dflash_assets.quality import Thresholds

        return Thresholds(truncation_rate_max=self.truncation_rate_max, training_max_length=self.training_max_length)
