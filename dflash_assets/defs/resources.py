"""Resources: the SGLang fleet, the prompt source and the data dir. Their settings, defaults and environment
variables are dflash_assets/settings.py."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Optional, TypeVar

import dagster as dg
from pydantic import Field, PrivateAttr

from dflash_assets.fleet.attach import parse_urls
from dflash_assets.fleet.fleet import Fleet, on_fleet
from dflash_assets.generation.prompts import FieldMapping
from dflash_assets.quality.outcome import Thresholds
from dflash_assets.quality.runaway import RunawayRules
from dflash_assets.settings import (FLEET_MODES, Deployment, EnvSetting, FleetSettings, LaunchSettings,
                                    TrainerSettings)


T = TypeVar("T")


class LaunchConfig(dg.Config, LaunchSettings):
    """`launch` mode: settings.LaunchSettings as the fleet resource's nested config."""


class FleetResource(dg.ConfigurableResource, FleetSettings):
    """The SGLang servers completions are generated on (settings.FleetSettings).

    `emulated` starts `num_servers` local SGLang emulators for the run and stops them after it;
    `attach` uses servers someone else runs (or an SGLang router / gateway URL in front of many);
    `launch` starts one `sglang serve` per GPU, detached so it outlives the run, recorded in
    `$DAGSTER_HOME/fleet/registry.json`, and reuses it in later runs while it is healthy and launched
    with the same args (`dflash fleet down` stops them).
    `api_key` is a Dagster EnvVar (DFLASH_API_KEY), resolved at run launch and masked in the UI; it is never
    run config, a log line or metadata.
    """

    api_key: Optional[str] = Field(None, description="Set from the DFLASH_API_KEY environment variable only.")
    launch: LaunchConfig = LaunchConfig()

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

    @contextmanager
    def yield_for_execution(self, context: dg.InitResourceContext):
        self.validate_settings()
        with ExitStack() as stack:
            if self.mode == "emulated":
                from dflash_assets.emulator.process import start_emulator

                args = self.emulator_args.split()
                if self.api_key:
                    args += ["--api-key", self.api_key]
                try:
                    servers = [stack.enter_context(start_emulator(args)) for _ in range(self.num_servers)]
                except (RuntimeError, TimeoutError) as e:  # its message ends with the server's own last lines
                    raise RuntimeError(f"the emulated fleet did not start ({self.emulator_args}): {e}") from None
                self._urls = [s.url for s in servers]
                context.log.info(f"started {len(servers)} emulated SGLang servers: {', '.join(self._urls)}")
            elif self.mode == "launch":
                from dflash_assets.fleet.launch_config import build_spec
                from dflash_assets.fleet.launcher import default_fleet_dir, up

                spec = build_spec(LaunchSettings.taken_from(self.launch))
                self._urls = [r.url for r in up(spec, default_fleet_dir(), on_event=context.log.info)]
            else:
                self._urls = self.url_list()
            yield self


class PromptSource(dg.ConfigurableResource):
    """The prompt set (JSONL or Parquet), cut into shards of `shard_size` lines."""

    path: str = Deployment.PROMPTS.default
    shard_size: int = int(Deployment.SHARD_SIZE.default)
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

    path: str = Deployment.DATA_DIR.default
    local_path: str = Deployment.LOCAL_DIR.default

    def resolved(self) -> Path | str:
        """The data dir for the generation and quality libraries: an absolute Path, or the URI as given."""
        from dflash_assets.generation.storage import is_uri

        return self.path.rstrip("/") if is_uri(self.path) else Path(self.path).resolve()

    def local_dir(self) -> Path:
        """Where local files (reports, training set) go: the data dir itself when it is local."""
        from dflash_assets.generation.storage import is_uri

        return Path(self.local_path if is_uri(self.path) else self.path).resolve()

def from_env() -> dict:
    """The resource map. A deployment setting set in the environment becomes a Dagster EnvVar (resolved at run
    launch, masked in the UI); one that is unset keeps the settings' default (an EnvVar must be set)."""

    def env(setting: EnvSetting, convert=str):
        if setting.name not in os.environ:
            return convert(setting.default)
        return dg.EnvVar.int(setting.name) if convert is int else dg.EnvVar(setting.name)

    d = Deployment
    return {
        "fleet": FleetResource(mode=env(d.FLEET_MODE), urls=env(d.FLEET_URLS), num_servers=env(d.NUM_SERVERS, int),
                               emulator_args=env(d.EMULATOR_ARGS),
                               api_key=dg.EnvVar(d.API_KEY.name) if d.API_KEY.name in os.environ else None,
                               launch=LaunchConfig(model_path=env(d.MODEL_PATH), gpus=env(d.GPUS),
                                                   base_port=env(d.BASE_PORT, int), command=env(d.SGLANG_COMMAND))),
        "prompt_source": PromptSource(path=env(d.PROMPTS), shard_size=env(d.SHARD_SIZE, int)),
        "data_dir": DataDir(path=env(d.DATA_DIR), local_path=env(d.LOCAL_DIR)),
        "quality": QualityThresholds(),
    }

def run_on_fleet(fleet: FleetResource, work: Callable[[Fleet], Awaitable[T]]) -> T:
    """`work(fleet)` (a coroutine function) on the resource's servers, connected for it and closed after."""
    return on_fleet(fleet._urls, work, fleet.api_key or None, health_timeout_s=fleet.health_timeout_s,
                    request_timeout_s=fleet.request_timeout_s)

class RunawayConfig(dg.Config, RunawayRules):
    """quality.runaway.RunawayRules (what counts as a loop), editable in the launchpad."""

    def rules(self) -> RunawayRules:
        return RunawayRules(**{name: getattr(self, name) for name in RunawayRules.model_fields})


class TrainerConfig(dg.Config, TrainerSettings):
    """settings.TrainerSettings (the trainer's window and export form), editable in the launchpad."""

    def settings(self) -> TrainerSettings:
        return TrainerSettings.taken_from(self)


class QualityThresholds(dg.ConfigurableResource):
    """The limits the quality checks judge by (shares of rows, in [0, 1]); defaults are quality.Thresholds'."""

    truncation_rate_max: float = Field(Thresholds().truncation_rate_max, description="The truncation_rate check "
                                       "fails above this share of rows cut inside the trainer's window.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The drafter trainer: its window "
                                   "max_length (what the checks judge truncation against) and the export form.")
    runaway_rate_max: float = Field(Thresholds().runaway_rate_max, description="The runaway_rate check warns above "
                                    "this share of rows cut while looping.")
    runaway: RunawayConfig = Field(default_factory=RunawayConfig, description="What counts as a runaway.")

    def thresholds(self) -> Thresholds:
        return Thresholds(truncation_rate_max=self.truncation_rate_max, trainer=self.trainer.settings(),
                          runaway_rate_max=self.runaway_rate_max, runaway=self.runaway.rules())
