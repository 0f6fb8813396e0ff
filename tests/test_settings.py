"""Every setting is defined once (dflash_assets/settings.py): the CLI, the fleet resource and the Dagster run
config are built from it, so their defaults cannot drift apart."""

import dataclasses
import subprocess
import sys

import dagster as dg

from dflash_assets.cli import build_parser
from dflash_assets.defs.completions.assets import CompletionsConfig
from dflash_assets.defs.continuation.assets import ContinuationConfig
from dflash_assets.defs.resources import FleetResource, LaunchConfig
from dflash_assets.fleet.launch_config import build_spec
from dflash_assets.fleet.server_args import ServerArgs
from dflash_assets.settings import DispatchSettings, FleetSettings, GenerationSettings, LaunchSettings, ServerFlags
from tests.support.cli import dflash, free_base_port

MODEL = "emulated/qwen3-27b"


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
    # the Dagster launchpad shows the same defaults: the config schema is built from the same fields
    schema = CompletionsConfig.to_fields_dict()
    assert {name: schema[name].default_value for name in GenerationSettings.model_fields} == \
        GenerationSettings().model_dump()


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
    code = ("import sys, dflash_assets.settings, dflash_assets.generation.engine, dflash_assets.fleet.launch_config, "
            "dflash_assets.quality; print(sorted(m for m in sys.modules if m.split('.')[0] == 'dagster'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
