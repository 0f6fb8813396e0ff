"""Resources: the SGLang fleet, the prompt source, the data dir and the quality limits (settings in settings.py). The
resource keys are what users' run config names: they stay whatever the classes are called.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeVar

import dagster as dg
from pydantic import Field, PrivateAttr

from dflash_assets.defs.metadata import StepStopKeys
from dflash_assets.fleet.attach import parse_urls
from dflash_assets.fleet.fleet import Fleet, on_fleet
from dflash_assets.fleet.supervise import launched, supervised
from dflash_assets.generation.prompts import FieldMapping
from dflash_assets.settings import (
    Deployment,
    EnvSetting,
    FleetSettings,
    LaunchSettings,
    QualitySettings,
    QuotaSettings,
    RepeatSettings,
    RunawaySettings,
    SettingsError,
    TrainerSettings,
)
from dflash_assets.store.in_use import data_in_use

T = TypeVar("T")

# A failed step is retried (the ledger sends only what is not committed); what a retry cannot cure raises
# Failure(allow_retries=False) (defs/faults.py). The delay is read when the code location loads.
FLEET_RETRY = dg.RetryPolicy(
    max_retries=2,
    delay=float(Deployment.RETRY_DELAY_S.value()),
    backoff=dg.Backoff.EXPONENTIAL,
    jitter=dg.Jitter.PLUS_MINUS,
)


class Refused:
    """Put first in a settings-made run config: a bad value fails the step in one line, not retried."""

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except SettingsError as e:
            raise dg.Failure(str(e), metadata={StepStopKeys.CAUSE: "config"}, allow_retries=False) from None


class LaunchConfig(dg.Config, LaunchSettings):
    """`launch` mode: settings.LaunchSettings as the fleet resource's nested config."""


def _as_given(name: str):
    """A FleetSettings field with its default and description but not its checks (they run at the start)."""
    return Field(FleetSettings.model_fields[name].default, description=FleetSettings.model_fields[name].description)


class FleetResource(dg.ConfigurableResource, FleetSettings):
    """The SGLang servers completions are generated on (settings.FleetSettings): `emulated` local emulators for
    the run, `attach` servers someone else runs (or a gateway), `launch` one detached `sglang serve` per GPU,
    reused while healthy and alike (`dflash fleet down` stops them). `api_key` is an EnvVar (DFLASH_API_KEY),
    never run config, a log line or metadata.
    """

    # an EnvVar is a placeholder until run launch: FleetSettings checks the resolved values at start
    mode: str = _as_given("mode")  # type: ignore[assignment]  # the FleetMode the start checks
    num_servers: int = _as_given("num_servers")
    api_key: str | None = Field(None, description="Set from the DFLASH_API_KEY environment variable only.")
    launch: LaunchConfig = LaunchConfig()

    _urls: list[str] = PrivateAttr(default_factory=list)

    def validate_settings(self) -> None:
        """The resolved values, checked by FleetSettings (SettingsError), and attach's URLs by the fleet's parser."""
        if FleetSettings.taken_from(self).mode == "attach":
            self.url_list()  # a malformed URL is refused here, naming it, before any work

    def url_list(self) -> list[str]:
        return parse_urls(self.urls)

    @contextmanager
    def yield_for_execution(self, context: dg.InitResourceContext):
        self.validate_settings()
        info = context.log.info if context.log else print
        with ExitStack() as stack:
            if self.mode == "emulated":
                from dflash_assets.emulator.process import EmulatorProcess, start_emulator

                args = self.emulator_args.split()
                if self.api_key:
                    args += ["--api-key", self.api_key]
                servers: dict[str, EmulatorProcess] = {}
                stack.callback(lambda: [s.stop() for s in servers.values()])
                try:
                    for _ in range(self.num_servers):
                        server = start_emulator(args)
                        servers[server.url] = server
                except (RuntimeError, TimeoutError) as e:  # its message ends with the server's own last lines
                    raise RuntimeError(f"the emulated fleet did not start ({self.emulator_args}): {e}") from None
                self._urls = list(servers)
                info(f"started {len(servers)} emulated SGLang servers: {', '.join(self._urls)}")

                def relaunch(url: str, _stop: object) -> None:
                    servers[url].stop()
                    servers[url] = start_emulator(args, port=servers[url].port)

                dead = lambda: [url for url, s in servers.items() if not s.alive()]  # noqa: E731
                stack.enter_context(supervised(dead, relaunch, info))
            elif self.mode == "launch":
                from dflash_assets.fleet.launcher import build_spec, default_fleet_dir

                spec = build_spec(LaunchSettings.taken_from(self.launch))
                self._urls = [r.url for r in stack.enter_context(launched(spec, default_fleet_dir(), info))]
            else:
                self._urls = self.url_list()
            yield self


class PromptSourceResource(dg.ConfigurableResource):
    """The prompt set (JSONL or Parquet), cut into shards of `shard_size` lines."""

    path: str = Deployment.PROMPTS.default
    shard_size: int = int(Deployment.SHARD_SIZE.default)
    # for a source in none of the known formats (generation/prompts.py): the columns holding the id and the turns
    id_field: str | None = None
    messages_field: str | None = None
    keep_repeats: bool = Field(
        default=RepeatSettings().keep_repeats, description=RepeatSettings.model_fields["keep_repeats"].description
    )
    quotas: dict[str, float] = Field(default={}, description=QuotaSettings.model_fields["quotas"].description)
    quota_seed: int = Field(default=0, description=QuotaSettings.model_fields["quota_seed"].description)

    def mapping(self) -> FieldMapping | None:
        if not (self.id_field or self.messages_field):
            return None
        return FieldMapping(self.id_field, self.messages_field)

    def resolved(self) -> Path:
        if self.shard_size <= 0:
            raise ValueError(f"shard_size must be a positive integer, got {self.shard_size}")
        return Path(self.path)


class DataDirResource(dg.ConfigurableResource):
    """Where the Parquet tables live (`DFLASH_DATA_DIR`, default `data/`): a local path or `s3://bucket/prefix`.
    Files for people and trainers go to `local_path` (`DFLASH_LOCAL_DIR`); S3 credentials come from the
    environment, never from config.
    """

    path: str = Deployment.DATA_DIR.default
    local_path: str = Deployment.LOCAL_DIR.default

    def resolved(self) -> Path | str:
        """The data dir for the generation and quality libraries: an absolute Path, or the URI as given."""
        from dflash_assets.store.storage import is_uri

        return self.path.rstrip("/") if is_uri(self.path) else Path(self.path).resolve()

    def local_dir(self) -> Path:
        """Where local files (reports, training set) go: the data dir itself when it is local."""
        from dflash_assets.store.storage import is_uri

        return Path(self.local_path if is_uri(self.path) else self.path).resolve()


def refusal(prompt_source: PromptSourceResource, data_dir: DataDirResource) -> str | None:
    """Why the definitions' prompt source and data dir may not be worked on together, in one line, or None
    (generation/shards.py source_refusal, an unreadable or empty source): what a sensor or schedule skips with."""
    from dflash_assets.generation.prompts import SourceError, no_prompt
    from dflash_assets.generation.shards import source_refusal

    try:
        source = prompt_source.resolved()
        return source_refusal(source, prompt_source.shard_size, data_dir.resolved()) or no_prompt(
            source, prompt_source.mapping()
        )
    except (SourceError, ValueError) as e:  # no source, an empty one, a bad shard size
        return str(e)


def from_env() -> dict:
    """The resource map: a deployment setting set in the environment becomes an EnvVar; an unset data dir, source
    or shard size is the instance's (store/in_use.py); any other unset one keeps the settings' default."""

    def env(setting: EnvSetting, convert=str):
        if setting.name not in os.environ:
            return convert(data.get(setting.name, setting.default))
        return dg.EnvVar.int(setting.name) if convert is int else dg.EnvVar(setting.name)

    d = Deployment
    data = data_in_use().environment()  # the instance's data dir and its source, as the commands find them
    return {
        # the pydantic plugin misses the inherited fields of a ConfigurableResource that redeclares some
        "fleet": FleetResource(  # type: ignore[call-arg]
            mode=env(d.FLEET_MODE),
            urls=env(d.FLEET_URLS),
            num_servers=env(d.NUM_SERVERS, int),
            emulator_args=env(d.EMULATOR_ARGS),
            api_key=dg.EnvVar(d.API_KEY.name) if d.API_KEY.name in os.environ else None,
            launch=LaunchConfig(
                model_path=env(d.MODEL_PATH),
                gpus=env(d.GPUS),
                base_port=env(d.BASE_PORT, int),
                command=env(d.SGLANG_COMMAND),
                extra_args=env(d.SGLANG_ARGS),
            ),
        ),
        "prompt_source": PromptSourceResource(path=env(d.PROMPTS), shard_size=env(d.SHARD_SIZE, int)),
        "data_dir": DataDirResource(path=env(d.DATA_DIR), local_path=env(d.LOCAL_DIR)),
        "quality": QualityResource(),
    }


def run_on_fleet(fleet: FleetResource, work: Callable[[Fleet], Awaitable[T]]) -> T:
    """`work(fleet)` (a coroutine function) on the resource's servers, connected for it and closed after."""
    return on_fleet(
        fleet._urls,
        work,
        fleet.api_key or None,
        health_timeout_s=fleet.health_timeout_s,
        request_timeout_s=fleet.request_timeout_s,
        connect_refused_s=fleet.connect_refused_s,
        say=dg.get_dagster_logger().info,  # the run's event log hears the wait for /health
        relaunch_s=fleet.launch.health_timeout_s if fleet.mode == "launch" else 0.0,
    )


class RunawayConfig(dg.Config, RunawaySettings):
    """settings.RunawaySettings (what counts as a loop), editable in the launchpad."""


class TrainerConfig(dg.Config, TrainerSettings):
    """settings.TrainerSettings (the trainer's window and export form), editable in the launchpad."""


def _nested(name: str, config: type[dg.Config]):
    """A QualitySettings group field in its Dagster config form, with the settings' description."""
    return Field(default_factory=config, description=QualitySettings.model_fields[name].description)


class QualityResource(dg.ConfigurableResource, QualitySettings):
    """The limits the quality checks judge by (settings.QualitySettings), editable in the launchpad."""

    trainer: TrainerConfig = _nested("trainer", TrainerConfig)
    runaway: RunawayConfig = _nested("runaway", RunawayConfig)
