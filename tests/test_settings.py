"""Every setting is defined once (dflash_assets/settings.py): the CLI, the resources and the Dagster configs are
built from it, so their fields and defaults cannot drift apart, and no default is written a second time."""

import ast
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import dagster as dg

from dflash_assets.cli import SHARD_RUN_DEFAULTS, build_parser
from dflash_assets.defs.completions.assets import CompletionsConfig
from dflash_assets.defs.continuation.assets import ContinuationConfig
from dflash_assets.defs.probe.assets import LengthProbeConfig
from dflash_assets.defs.resources import (
    FleetResource,
    LaunchConfig,
    QualityResource,
    RunawayConfig,
    TrainerConfig,
    from_env,
)
from dflash_assets.fleet.client import ServerClient
from dflash_assets.fleet.fleet import connected
from dflash_assets.fleet.gateway import GatewayClient, open_gateway
from dflash_assets.fleet.launcher import build_spec
from dflash_assets.fleet.server_args import ServerCommand
from dflash_assets.generation.slots import SlotPicker
from dflash_assets.settings import (
    WINDOW_FIELDS,
    Deployment,
    DispatchSettings,
    EnvSetting,
    FleetSettings,
    GenerationSettings,
    LaunchSettings,
    ProbeSettings,
    QualitySettings,
    RequestSettings,
    RunawaySettings,
    ServerSettings,
    Settings,
    TrainerSettings,
)
from tests.support.cli import dflash, free_base_port

MODEL = "emulated/qwen3-27b"
ROOT = Path(__file__).resolve().parent.parent


def defaults_of(where: str, form: dict, model: type[Settings], skip=(), own: dict | None = None) -> None:
    """Every field of `model` (but `skip`) is in `form` (field -> its default there) with the model's default, or
    the form's documented `own` one."""
    expected = {**model().model_dump(), **(own or {})}
    fields = [name for name in model.model_fields if name not in skip]
    missing = [name for name in fields if name not in form]
    assert not missing, f"{where}: {model.__name__} fields missing: {', '.join(missing)}"
    differ = {name: (form[name], expected[name]) for name in fields if form[name] != expected[name]}
    assert not differ, f"{where}: defaults unlike {model.__name__}'s (here, there): {differ}"


def cli(*argv: str) -> dict:
    return vars(build_parser().parse_args(list(argv)))


def launchpad(config: type) -> dict:
    """The defaults the Dagster launchpad shows: the config schema built from the class (nested groups as dicts)."""
    return {name: field.default_value for name, field in config.to_fields_dict().items() if field.default_provided}


def built(instance: object, model: type[Settings]) -> dict:
    """The values an instance carries (nested groups as dicts)."""
    return {name: dump(getattr(instance, name)) for name in model.model_fields if hasattr(instance, name)}


def dump(value):
    return value.model_dump() if isinstance(value, Settings) else value


PROBE_SAMPLING = ("max_output_tokens",)  # the probe's own cap (ProbeSettings.max_output_tokens) takes its place
PROBE_CLI_SAMPLING = (*PROBE_SAMPLING, *WINDOW_FIELDS)  # and `dflash probe` measures lengths: never windowed
TRAINER_FLAGS = {f"trainer_{name}": value for name, value in TrainerSettings().model_dump().items()}


def trainer_flags(args: dict) -> dict:
    """The TrainerSettings fields a command's --trainer-* flags give."""
    return {name.removeprefix("trainer_"): value for name, value in args.items() if name in TRAINER_FLAGS}


def test_the_cli_the_resources_and_every_dagster_config_have_every_field_and_the_same_defaults(monkeypatch):
    for setting in vars(Deployment).values():
        if isinstance(setting, EnvSetting):
            monkeypatch.delenv(setting.name, raising=False)
    forms = {
        "dflash generate": (
            cli("generate", "--shard", "0", "--urls", "http://x"),
            [(GenerationSettings, ()), (DispatchSettings, ())],
        ),
        "dflash generate --trainer-*": (
            trainer_flags(cli("generate", "--shard", "0", "--urls", "http://x")),
            [(TrainerSettings, ("name", "format", "chat_template"))],
        ),
        "dflash report --trainer-*": (trainer_flags(cli("report")), [(TrainerSettings, ())]),
        "dflash probe": (
            cli("probe", "--urls", "http://x"),
            [(ProbeSettings, ()), (RequestSettings, PROBE_CLI_SAMPLING), (DispatchSettings, ())],
        ),
        "dflash fleet up": (cli("fleet", "up", "--model-path", MODEL), [(LaunchSettings, ("model_path",))]),
        "CompletionsConfig": (launchpad(CompletionsConfig), [(RequestSettings, ()), (DispatchSettings, ())]),
        "CompletionsConfig()": (
            built(CompletionsConfig(), RequestSettings) | built(CompletionsConfig(), DispatchSettings),
            [(RequestSettings, ()), (DispatchSettings, ())],
        ),
        "LengthProbeConfig": (
            launchpad(LengthProbeConfig),
            [(ProbeSettings, ()), (RequestSettings, PROBE_SAMPLING), (DispatchSettings, ())],
        ),
        "ContinuationConfig": (launchpad(ContinuationConfig), [(DispatchSettings, ())]),
        "LaunchConfig": (launchpad(LaunchConfig), [(LaunchSettings, ())]),
        "TrainerConfig": (launchpad(TrainerConfig), [(TrainerSettings, ())]),
        "RunawayConfig": (launchpad(RunawayConfig), [(RunawaySettings, ())]),
        "the fleet resource": (launchpad(FleetResource), [(FleetSettings, ())]),
        "the fleet resource's launch": (launchpad(FleetResource)["launch"], [(LaunchSettings, ())]),
        "the quality resource": (launchpad(QualityResource), [(QualitySettings, ())]),
        "the quality resource's trainer": (launchpad(QualityResource)["trainer"], [(TrainerSettings, ())]),
        "the quality resource's runaway": (launchpad(QualityResource)["runaway"], [(RunawaySettings, ())]),
        # the resource map a deployment without environment variables runs with
        "from_env() fleet": (built(from_env()["fleet"], FleetSettings), [(FleetSettings, ())]),
        "from_env() fleet.launch": (built(from_env()["fleet"].launch, LaunchSettings), [(LaunchSettings, ())]),
        "from_env() quality": (built(from_env()["quality"], QualitySettings), [(QualitySettings, ())]),
    }
    for command in ("demo", "backfill"):  # their documented own (one, shared)
        forms[f"dflash {command}"] = (
            cli(command),
            [(RequestSettings, (), SHARD_RUN_DEFAULTS), (DispatchSettings, (), SHARD_RUN_DEFAULTS)],
        )
        forms[f"dflash {command} --trainer-*"] = (trainer_flags(cli(command)), [(TrainerSettings, ())])
    for where, (form, models) in forms.items():
        for model, skip, *own in models:
            defaults_of(where, form, model, skip, *own)
    # the quality resource gives the checks every limit it carries, nested groups as settings
    custom = QualityResource(
        decoded_past_window_rate_max=0.5,
        trainer={"max_length": 2048},
        runaway={"tail_chars": 10},
        severity={"runaway_rate": "ERROR"},
    )
    assert QualitySettings.taken_from(custom) == QualitySettings(
        decoded_past_window_rate_max=0.5,
        trainer=TrainerSettings(max_length=2048),
        runaway=RunawaySettings(tail_chars=10),
        severity={"runaway_rate": "ERROR"},
    )
    assert cli("report")["trainer_max_length"] == TrainerSettings().max_length
    # one window: no config of Dagster holds one of its own (the completions asset reads the quality resource's)
    for config in (CompletionsConfig, LengthProbeConfig):
        assert "trainer_max_length" not in config.model_fields, config.__name__


def test_the_libraries_that_connect_without_a_resource_take_the_settings_defaults():
    # the fleet's timeouts where the CLI and the libraries connect, and the dispatch defaults of the slot picker
    fleet, dispatch = FleetSettings(), DispatchSettings()
    for function, name, settings, field in (
        (connected, "health_timeout_s", fleet, "health_timeout_s"),
        (connected, "request_timeout_s", fleet, "request_timeout_s"),
        (ServerClient.__init__, "request_timeout_s", fleet, "request_timeout_s"),
        (GatewayClient.__init__, "request_timeout_s", fleet, "request_timeout_s"),
        (open_gateway, "request_timeout_s", fleet, "request_timeout_s"),
    ):
        default = inspect.signature(function).parameters[name].default
        assert default == getattr(settings, field), (
            f"{function.__qualname__}: {name} = {default}, settings say {getattr(settings, field)}"
        )
    assert inspect.signature(SlotPicker.__init__).parameters["dispatch"].default == dispatch


# a parameter named like a setting, with a literal default, that is another idea (not the setting's default)
NOT_THE_SETTING = {
    ("dflash_assets/quality/planning/estimate.py", "seed"): "the bootstrap's seed, not the probe sample's",
    ("benchmarks/bench_streaming.py", "max_output_tokens"): "the 4096 cap, measured at it",
}


def literal_defaults(tree: ast.AST):
    """(line, name, value) of every literal default in a signature or class body, and every literal keyword
    argument of a call."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = [
                *zip(positional[len(positional) - len(a.defaults) :], a.defaults),
                *zip(a.kwonlyargs, a.kw_defaults),
            ]
            yield from ((d.lineno, arg.arg, d.value) for arg, d in pairs if isinstance(d, ast.Constant))
        elif isinstance(node, ast.ClassDef):
            yield from (
                (st.lineno, st.target.id, st.value.value)
                for st in node.body
                if isinstance(st, ast.AnnAssign)
                and isinstance(st.target, ast.Name)
                and isinstance(st.value, ast.Constant)
            )
        elif isinstance(node, ast.Call):
            yield from (
                (k.value.lineno, k.arg, k.value.value)
                for k in node.keywords
                if k.arg and isinstance(k.value, ast.Constant)
            )


def test_no_settings_default_is_written_again_outside_settings_py():
    # a setting's default copied as a literal (`no_server_timeout_s: float = 120.0`) drifts when settings.py
    # changes; every one reads the model instead. None ("absent") and the emulator (SGLang's own flags) apart.
    defaults: dict[str, set] = {}
    for model in (
        GenerationSettings,
        DispatchSettings,
        ProbeSettings,
        TrainerSettings,
        RunawaySettings,
        QualitySettings,
        LaunchSettings,
        FleetSettings,
    ):
        for name, field in model.model_fields.items():
            if field.default is not None and not isinstance(field.default, (Settings, dict)):
                defaults.setdefault(name, set()).add(field.default)
    files = [
        p
        for d in ("dflash_assets", "benchmarks", "scripts")
        for p in sorted((ROOT / d).rglob("*.py"))
        if p.name != "settings.py" and "emulator" not in p.parts
    ]
    copies = [
        f"{path.relative_to(ROOT)}:{line} {name}={value!r}"
        for path in files
        for line, name, value in literal_defaults(ast.parse(path.read_text()))
        if name in defaults
        and value in defaults[name]
        and type(value) is not bool
        and (str(path.relative_to(ROOT)), name) not in NOT_THE_SETTING
    ]
    assert not copies, "settings defaults written again (read them from settings.py):\n" + "\n".join(copies)


def test_a_servers_args_default_to_the_launch_settings():
    typed = {f.name for f in dataclasses.fields(ServerCommand)} - {"model_path", "port", "extra_args", "gpus"}
    assert typed == set(ServerSettings.model_fields), "ServerCommand and settings.ServerSettings list the same flags"
    spec = build_spec(LaunchSettings(model_path=MODEL))
    assert spec.servers()["gpu0"] == ServerCommand(model_path=MODEL, gpus=(0,))
    assert spec.base_port == LaunchSettings().base_port and spec.health_timeout_s == LaunchSettings().health_timeout_s


def test_a_fleet_up_from_the_cli_is_reused_by_a_launch_mode_run_with_the_same_model_and_gpu(tmp_path, monkeypatch):
    # the bug: `dflash fleet up` defaulted enable_metrics to False, the resource to True, so a launch-mode run
    # refused the warm server ("enable_metrics: False -> True ... It was not restarted")
    base = str(free_base_port())
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    up = dflash(
        "fleet",
        "up",
        "--model-path",
        MODEL,
        "--gpus",
        "0",
        "--command",
        "emulator",
        "--base-port",
        base,
        "--health-timeout-s",
        "60",
        env={"DAGSTER_HOME": str(tmp_path)},
    )
    try:
        assert up.returncode == 0 and "gpu0: launched" in up.stdout, up.stdout + up.stderr
        fleet = FleetResource(
            mode="launch", launch=LaunchConfig(model_path=MODEL, gpus="0", base_port=int(base), command="emulator")
        )
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
    code = (
        "import importlib, pkgutil, sys, dflash_assets.settings, dflash_assets.rules\n"
        "names = [m.name for p in ('fleet', 'generation', 'quality') for m in pkgutil.walk_packages(\n"
        "    importlib.import_module(f'dflash_assets.{p}').__path__, f'dflash_assets.{p}.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "print(len(names), sorted(m for m in sys.modules if m.split('.')[0] == 'dagster')[:3])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    modules = sum(len(list((ROOT / "dflash_assets" / p).rglob("*.py"))) - 1 for p in ("fleet", "generation", "quality"))
    assert out.returncode == 0 and out.stdout.strip() == f"{modules} []", out.stdout + out.stderr


def test_the_length_probes_launchpad_offers_only_settings_the_probe_reads():
    # its sample and cap, the run's sampling, how hard to drive the fleet: nothing that the probe ignores
    offered = set(LengthProbeConfig.to_fields_dict())
    read = {name for settings in (ProbeSettings, RequestSettings, DispatchSettings) for name in settings.model_fields}
    assert offered == read, f"offered, not read: {offered - read}; read, not offered: {read - offered}"


def test_a_settings_combinations_config_hash_is_the_one_its_rows_already_carry():
    # config_hash is a column of the Parquet data people have: these were computed before the settings moved
    # (generation/config.py into settings.py), and a refactoring must not make old rows another config
    from dflash_assets.settings import GenerationSettings

    pinned = {
        "e81c2cd6b058": {"cap_policy": "fixed"},
        "e7d793efd00a": {"cap_policy": "fixed", "max_output_tokens": 8192, "regenerate": "all_turns"},
        "d9fda1ee40a0": {"cap_policy": "window", "trainer_max_length": 2048, "overshoot": 8},
        "6edaa9cb1b2b": {
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "enable_thinking": False,
            "cap_policy": "fixed",
        },
        "db70f813f2be": {"cap_policy": "fixed", "chat_template_kwargs": {"reasoning_effort": "high"}},
    }
    # the default regenerate: auto, resolved for a source of single-turn prompts, is last_turn: the same hashes
    assert {
        GenerationSettings(**settings).resolved(False).config_hash(MODEL): settings for settings in pinned.values()
    } == pinned
    # the window is the trainer's (one setting): the completions config (launchpad) or the flags with the trainer's
    # window give today's window-policy hash, so data dirs made when the completions config held a copy resume
    trainer = TrainerSettings(max_length=2048)
    launchpad_config = CompletionsConfig(cap_policy="window", overshoot=8)
    assert GenerationSettings.of(launchpad_config, trainer).resolved(False).config_hash(MODEL) == "d9fda1ee40a0"
    flags = build_parser().parse_args(
        ["backfill", "--cap-policy", "window", "--overshoot", "8", "--trainer-max-length", "2048"]
    )
    from_flags = GenerationSettings.of(flags, TrainerSettings.taken_from(flags, prefix="trainer_"))
    assert from_flags.resolved(False).config_hash(MODEL) == "d9fda1ee40a0"


def test_regenerate_auto_is_all_turns_on_a_multi_turn_source_and_the_old_hash_on_a_single_turn_one():
    import pytest

    from dflash_assets.settings import GenerationSettings, SettingsError

    auto = GenerationSettings()
    assert auto.regenerate == "auto"
    assert auto.resolved(False).regenerate == "last_turn" and auto.resolved(True).regenerate == "all_turns"
    # the default is the window policy at the trainer's window: a new config beside the old default's (fixed cap),
    # which keeps its hash (pinned above), so a data dir written under it resumes with --cap-policy fixed
    window = GenerationSettings(cap_policy="window", trainer_max_length=4096, overshoot=16, regenerate="last_turn")
    assert auto.resolved(False).config_hash(MODEL) == window.config_hash(MODEL) != "e81c2cd6b058"
    assert GenerationSettings(cap_policy="fixed").resolved(False).config_hash(MODEL) == "e81c2cd6b058"
    assert auto.resolved(True).config_hash(MODEL) == GenerationSettings(regenerate="all_turns").config_hash(MODEL)
    assert auto.resolved(True).config_hash(MODEL) != window.config_hash(MODEL)  # a multi-turn source: a new config
    assert GenerationSettings(regenerate="last_turn").resolved(True).regenerate == "last_turn"  # a choice stays
    with pytest.raises(SettingsError, match="regenerate 'auto' has no config hash until it is resolved"):
        auto.config_hash(MODEL)


def test_chat_template_kwargs_is_a_json_flag_and_a_bad_quality_setting_is_refused_when_the_resource_is_built(capsys):
    import pytest

    from dflash_assets.settings import SettingsError

    def generate(kwargs: str):
        return build_parser().parse_args(
            [
                "generate",
                "--shard",
                "0",
                "--urls",
                "http://x",
                "--cap-policy",
                "fixed",
                "--chat-template-kwargs",
                kwargs,
            ]
        )

    assert (
        GenerationSettings.taken_from(generate('{"reasoning_effort": "high"}')).resolved(False).config_hash(MODEL)
        == "db70f813f2be"
    )  # the hash pinned above
    with pytest.raises(SystemExit):
        generate("high")
    assert "dflash generate: --chat-template-kwargs: not JSON" in capsys.readouterr().err
    with pytest.raises(SettingsError, match="set enable_thinking with its own setting"):
        GenerationSettings.taken_from(generate('{"enable_thinking": false}'))
    for bad, message in (
        ({"severity": {"runaway_rate": "FATAL"}}, "severity must be one of ERROR, WARN"),
        ({"trainer": {"format": "sharegpt"}}, "trainer format must be one of"),
    ):
        with pytest.raises(SettingsError, match=message):
            QualityResource(**bad)
