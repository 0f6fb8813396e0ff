"""Every setting is defined once (dflash_assets/settings.py): the CLI, the fleet resource and the Dagster run
config are built from it, so their defaults cannot drift apart."""

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import dagster as dg

from dflash_assets.cli import build_parser
from dflash_assets.defs.completions.assets import CompletionsConfig
from dflash_assets.defs.continuation.assets import ContinuationConfig
from dflash_assets.defs.probe.assets import LengthProbeConfig
from dflash_assets.defs.resources import FleetResource, LaunchConfig
from dflash_assets.fleet.client import ServerClient
from dflash_assets.fleet.fleet import connected
from dflash_assets.fleet.gateway import GatewayClient, open_gateway
from dflash_assets.fleet.launch_config import build_spec
from dflash_assets.fleet.server_args import ServerArgs
from dflash_assets.settings import (DispatchSettings, FleetSettings, GenerationSettings, LaunchSettings, ProbeSettings,
                                    ServerFlags)
from tests.support.cli import dflash, free_base_port

MODEL = "emulated/qwen3-27b"
ROOT = Path(__file__).resolve().parent.parent


def test_the_cli_the_resource_and_the_dagster_config_have_the_same_defaults():
    generate = build_parser().parse_args(["generate", "--shard", "00000", "--urls", "http://x"])
    fleet_up = build_parser().parse_args(["fleet", "up", "--model-path", MODEL])
    completions = CompletionsConfig()
    continuation = ContinuationConfig(parent_config_hash="latest")
    resource = FleetResource()

    assert GenerationSettings.taken_from(generate) == GenerationSettings.taken_from(completions) == \
        GenerationSettings()
    assert DispatchSettings.taken_from(generate) == completions.dispatch() == continuation.dispatch() == \
        DispatchSettings()
    assert LaunchSettings.taken_from(fleet_up) == LaunchSettings.taken_from(resource.launch).model_copy(
        update={"model_path": MODEL}) == LaunchSettings(model_path=MODEL)
    assert FleetSettings.taken_from(resource) == FleetSettings()
    # the length probe: `dflash probe` and the length_probe asset's config
    probe = build_parser().parse_args(["probe", "--urls", "http://x"])
    length_probe = LengthProbeConfig()
    assert ProbeSettings.taken_from(probe) == length_probe.probe() == ProbeSettings()
    sampling = lambda source: source.model_dump(exclude={"max_output_tokens"})  # noqa: E731  (the probe's own cap)
    assert sampling(GenerationSettings.taken_from(probe)) == sampling(GenerationSettings.taken_from(length_probe)) \
        == sampling(GenerationSettings())
    assert DispatchSettings.taken_from(probe) == length_probe.dispatch() == DispatchSettings()
    # the fleet's timeouts, where the CLI and the libraries connect without the resource
    fleet = FleetSettings()
    for where, function, name in ((connected, connected, "health_timeout_s"),
                                  (connected, connected, "request_timeout_s"),
                                  (ServerClient, ServerClient.__init__, "request_timeout_s"),
                                  (GatewayClient, GatewayClient.__init__, "request_timeout_s"),
                                  (open_gateway, open_gateway, "request_timeout_s")):
        default = inspect.signature(function).parameters[name].default
        assert default == getattr(fleet, name), f"{where.__qualname__}: {name} = {default}, settings say " \
                                                f"{getattr(fleet, name)}"
    # the Dagster launchpad shows the same defaults: the config schema is built from the same fields
    for config, settings in ((CompletionsConfig, GenerationSettings), (LengthProbeConfig, ProbeSettings)):
        schema = config.to_fields_dict()
        assert {name: schema[name].default_value for name in settings.model_fields} == settings().model_dump()


def test_a_servers_args_default_to_the_launch_settings():
    typed = {f.name for f in dataclasses.fields(ServerArgs)} - {"model_path", "port", "extra_args", "gpus"}
    assert typed == set(ServerFlags.model_fields), "ServerArgs and settings.ServerFlags list the same flags"
    spec = build_spec(LaunchSettings(model_path=MODEL))
    assert spec.servers()["gpu0"] == ServerArgs(model_path=MODEL, gpus=(0,))
    assert spec.base_port == LaunchSettings().base_port and spec.health_timeout_s == LaunchSettings().health_timeout_s


def test_a_fleet_up_from_the_cli_is_reused_by_a_launch_mode_run_with_the_same_model_and_gpu(tmp_path, monkeypatch):
    # the bug: `dflash fleet up` defaulted enable_metrics to False, the resource to True, so a launch-mode run
    # refused the warm server ("enable_metrics: False -> True ... It was not restarted")
    base = str(free_base_port())
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    up = dflash("fleet", "up", "--model-path", MODEL, "--gpus", "0", "--command", "emulator", "--base-port", base,
                "--health-timeout", "60", env={"DAGSTER_HOME": str(tmp_path)})
    try:
        assert up.returncode == 0 and "gpu0: launched" in up.stdout, up.stdout + up.stderr
        fleet = FleetResource(mode="launch", launch=LaunchConfig(model_path=MODEL, gpus="0", base_port=int(base),
                                                                 command="emulator"))
        events = []
        context = dg.build_init_resource_context()
        context.log.info = events.append  # what the resource reports while bringing the fleet up
        with fleet.yield_for_execution(context) as ready:
            assert ready._urls == [f"http://127.0.0.1:{base}"]
        assert any("gpu0: reused" in e for e in events), events
    finally:
        down = dflash("fleet", "down", env={"DAGSTER_HOME": str(tmp_path)})
    assert down.returncode == 0 and "1 server(s) stopped" in down.stdout


def test_the_settings_and_the_plain_libraries_load_without_dagster():
    # every module of fleet/, generation/ and quality/ imported in a fresh interpreter: a dagster import anywhere
    # in what they pull in, directly or not, shows in sys.modules
    code = ("import importlib, pkgutil, sys, dflash_assets.settings, dflash_assets.rules\n"
            "names = [m.name for p in ('fleet', 'generation', 'quality') for m in pkgutil.walk_packages(\n"
            "    importlib.import_module(f'dflash_assets.{p}').__path__, f'dflash_assets.{p}.')]\n"
            "for name in names: importlib.import_module(name)\n"
            "print(len(names), sorted(m for m in sys.modules if m.split('.')[0] == 'dagster')[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    modules = sum(len(list((ROOT / "dflash_assets" / p).glob("*.py"))) - 1 for p in ("fleet", "generation", "quality"))
    assert out.returncode == 0 and out.stdout.strip() == f"{modules} []", out.stdout + out.stderr


def test_the_length_probes_launchpad_offers_only_settings_the_probe_reads():
    # its sample and cap, the run's sampling, how hard to drive the fleet: nothing that the probe ignores
    offered = set(LengthProbeConfig.to_fields_dict())
    read = {name for settings in (ProbeSettings, GenerationSettings, DispatchSettings) for name in settings.model_fields}
    assert offered == read, f"offered, not read: {offered - read}; read, not offered: {read - offered}"


def test_a_settings_combinations_config_hash_is_the_one_its_rows_already_carry():
    # config_hash is a column of the Parquet data people have: these were computed before the settings moved
    # (generation/config.py into settings.py), and a refactoring must not make old rows another config
    from dflash_assets.generation.config import GenerationConfig

    pinned = {
        "e81c2cd6b058": {},
        "e7d793efd00a": {"max_output_tokens": 8192, "regenerate": "all_turns"},
        "d9fda1ee40a0": {"cap_policy": "window", "trainer_max_length": 2048, "overshoot": 8},
        "6edaa9cb1b2b": {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1,
                         "presence_penalty": 0.5, "frequency_penalty": -0.5, "enable_thinking": False},
        "db70f813f2be": {"chat_template_kwargs": {"reasoning_effort": "high"}},
    }
    assert {GenerationConfig(**settings).config_hash(MODEL): settings for settings in pinned.values()} == pinned
