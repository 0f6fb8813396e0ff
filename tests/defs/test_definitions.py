"""The asset graph as the UI shows it: keys, wiring, checks, partitions, jobs, sensors (the webserver loading it is
tests/engines/test_webserver.py)."""

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

import dflash_assets.defs
from dflash_assets.definitions import defs
from dflash_assets.quality import CHECKS

ROOT = Path(__file__).resolve().parents[2]


# The graph as written, so that rewiring is a decision: a move that changes any of it fails here.
# asset -> (group, the folder under defs/ it lives in, parents, partitioned by shard)
ASSETS = {
    "prompt_shards": ("generation", "prompts", set(), True),
    "completions": ("generation", "completions", {"prompt_shards"}, True),
    "continued_completions": ("generation", "continuation", {"completions"}, True),
    "length_probe": ("probe", "probe", {"prompt_shards"}, False),
    "length_quality_report": ("quality", "quality", {"completions"}, True),
    "length_quality_summary": ("quality", "quality", {"completions", "length_probe"}, False),
    "drafter_training_set": ("training", "training", {"completions", "length_quality_report"}, False),
}
CHECKED = {
    "length_quality_report": {
        "truncation_rate",
        "cap_saturation",
        "cap_hit_agreement",
        "silent_clamp",
        "context_overflow",
        "config_consistency",
        "accounting",
        "duplicates",
        "empty_content",
        "think_markers",
        "reasoning_misrouted",
        "truncated_thinking",
        "max_length_overflow",
        "runaway_rate",
        "decoded_past_window",
        "tool_calls",
    }
}
# job -> (the folder of its jobs.py, the assets it materialises, the assets whose checks it runs, partitioned)
JOBS = {
    "shard_pipeline": (
        "completions",
        {"prompt_shards", "completions", "length_quality_report"},
        {"length_quality_report"},
        True,
    ),
    "quality_checks": ("quality", {"length_quality_summary"}, {"length_quality_report"}, False),
    "training_export": ("training", {"length_quality_summary", "drafter_training_set"}, set(), False),
    "continue_shards": ("continuation", {"continued_completions"}, set(), True),
}
SCHEDULES = {"quality_checks_schedule": ("quality", "quality_checks", "0 * * * *")}
# sensor -> (its module under defs/, the job it starts, the asset it watches, its interval in s)
SENSORS = {
    "shard_partitions_sensor": ("prompts.sensors", None, None, 60),
    "completions_landed_sensor": ("quality.sensors", "quality_checks", "completions", 60),
    "dead_runs_sensor": ("sensors", None, None, 30),
}


def defs_module(fn) -> str:
    return fn.__module__.removeprefix("dflash_assets.defs.")


def modules_defining(kind: str, cls: type) -> dict[str, list[str]]:
    """name -> the modules under defs/ named `kind` (jobs, schedules, sensors) that hold a `cls` of that name."""
    found: dict[str, list[str]] = {}
    for info in pkgutil.walk_packages(dflash_assets.defs.__path__, "dflash_assets.defs."):
        if info.name.rsplit(".", 1)[-1] == kind:
            for obj in vars(importlib.import_module(info.name)).values():
                if isinstance(obj, cls):
                    found.setdefault(obj.name, []).append(info.name.removeprefix("dflash_assets.defs."))
    return found


def test_the_asset_graph_is_wired_as_written_here():
    graph = defs.resolve_asset_graph()
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} == set(ASSETS)
    for name, (group, folder, parents, partitioned) in ASSETS.items():
        node, assets_def = graph.get(dg.AssetKey(name)), defs.resolve_assets_def(name)
        assert (
            node.group_name,
            defs_module(assets_def.op.compute_fn.decorated_fn).split(".")[0],
            {p.to_user_string() for p in node.parent_keys},
            node.partitions_def is not None,
        ) == (group, folder, parents, partitioned), name
        assert node.partitions_def is None or node.partitions_def.name == "shards"
        assert node.description and node.owners and node.kinds and node.kinds <= {"sglang", "parquet", "duckdb"}
    checks: dict[str, set[str]] = {}
    for key in graph.asset_check_keys:
        checks.setdefault(key.asset_key.to_user_string(), set()).add(key.name)
    assert checks == CHECKED == {"length_quality_report": {c.name for c in CHECKS}}


def test_the_jobs_schedules_and_sensors_are_wired_as_written_here():
    jobs = {j.name: j for j in defs.resolve_all_job_defs() if j.name != "__ASSET_JOB"}
    assert set(jobs) == set(JOBS)
    assert modules_defining("jobs", UnresolvedAssetJobDefinition) == {
        name: [f"{folder}.jobs"] for name, (folder, *_) in JOBS.items()
    }
    for name, (_, assets, checked, partitioned) in JOBS.items():
        layer = jobs[name].asset_layer
        assert (
            {k.to_user_string() for k in layer.selected_asset_keys},
            {k.asset_key.to_user_string() for k in layer.asset_graph.asset_check_keys},
            jobs[name].partitions_def is not None,
        ) == (assets, checked, partitioned), name
        assert jobs[name].executor_def is dg.in_process_executor, name  # applied once, in definitions.py
    assert modules_defining("schedules", dg.ScheduleDefinition) == {
        name: [f"{folder}.schedules"] for name, (folder, *_) in SCHEDULES.items()
    }
    assert {s.name: (s.job_name, s.cron_schedule) for s in defs.schedules} == {
        name: (job, cron) for name, (_, job, cron) in SCHEDULES.items()
    }
    assert modules_defining("sensors", dg.SensorDefinition) == {
        name: [module] for name, (module, *_) in SENSORS.items()
    }
    assert {
        s.name: (
            s.job_name if s.has_jobs else None,
            s.asset_key.to_user_string() if isinstance(s, dg.AssetSensorDefinition) else None,
            s.minimum_interval_seconds,
        )
        for s in defs.sensors
    } == {name: tuple(rest) for name, (_, *rest) in SENSORS.items()}
    assert all(d.default_status.name == "RUNNING" for d in [*defs.schedules, *defs.sensors])


def test_loading_the_code_location_warns_nothing():
    # every warning an error, in a fresh interpreter (pytest's own filters do not apply); the defs modules are
    # imported first, one by one, because load_from_defs_folder silences Dagster's warnings while it imports them
    code = (
        "import importlib, pkgutil, dflash_assets.defs as d\n"
        "for m in pkgutil.walk_packages(d.__path__, 'dflash_assets.defs.'): importlib.import_module(m.name)\n"
        "import dflash_assets.definitions"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert (done.returncode, done.stderr) == (0, "")


def test_every_quality_check_is_an_asset_check_on_the_report_and_blocking_ones_block():
    graph = defs.resolve_asset_graph()
    checks = {k.name: graph.get_check_spec(k) for k in graph.asset_check_keys}
    assert set(checks) == {c.name for c in CHECKS}
    # on the report, so a failing blocking check never stops the report itself, only what is downstream of it
    assert {k.asset_key.to_user_string() for k in graph.asset_check_keys} == {"length_quality_report"}
    downstream = {k.to_user_string() for k in graph.get(dg.AssetKey("length_quality_report")).child_keys}
    assert downstream == {"drafter_training_set"}
    assert {n for n, s in checks.items() if s.blocking} == {c.name for c in CHECKS if c.blocking}
    assert {"truncation_rate", "context_overflow"} <= {n for n, s in checks.items() if s.blocking}


def test_the_generating_assets_retry_a_failed_step_and_completions_declare_their_columns():
    from dflash_assets.store.schema import COMPLETION_SCHEMA

    for name in ("completions", "continued_completions"):
        policy = defs.resolve_assets_def(name).op.retry_policy
        assert policy is not None and policy.max_retries >= 1, name
    schema = (
        defs.resolve_assets_def("completions")
        .specs_by_key[dg.AssetKey("completions")]
        .metadata["dagster/column_schema"]
    )
    assert [(c.name, c.type) for c in schema.columns] == [(f.name, str(f.type)) for f in COMPLETION_SCHEMA]


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module a file imports (relative imports resolved against its package)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def test_the_emulator_is_its_own_package():
    # nothing that talks to servers, generates or checks imports the emulator; the emulator imports none of them
    for package in ("fleet", "generation", "quality"):
        for path in (ROOT / "dflash_assets" / package).rglob("*.py"):
            assert not any(m.startswith("dflash_assets.emulator") for m in imported_modules(path)), path
    for path in (ROOT / "dflash_assets" / "emulator").rglob("*.py"):
        outside = {
            m
            for m in imported_modules(path)
            if m.startswith("dflash_assets.") and not m.startswith("dflash_assets.emulator")
        }
        assert not outside, (path, outside)


def test_the_definitions_carry_every_resource_the_assets_need():
    # the definitions carry every resource the assets need; nothing is left for the caller to supply
    assert {"fleet", "prompt_source", "data_dir", "quality"} <= set(defs.resources)
    assert isinstance(defs.resources["fleet"], dg.ConfigurableResource)
