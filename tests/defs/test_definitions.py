"""The asset graph as the UI shows it: keys, wiring, checks, partitions, jobs, sensors (the webserver loading it is
tests/engines/test_webserver.py)."""

import ast
from pathlib import Path

import dagster as dg

from dflash_assets.definitions import defs
from dflash_assets.quality import CHECKS

ROOT = Path(__file__).resolve().parents[2]


def test_asset_graph_is_prompt_shards_then_completions_then_the_report():
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == {"prompt_shards", "completions", "continued_completions", "length_quality_report",
                    "length_quality_summary", "drafter_training_set", "length_probe"}
    parents = {k.to_user_string(): {p.to_user_string() for p in graph.get(k).parent_keys}
               for k in graph.get_all_asset_keys()}
    assert parents == {"prompt_shards": set(), "completions": {"prompt_shards"},
                       "continued_completions": {"completions"},
                       "length_quality_report": {"completions"},
                       "length_quality_summary": {"completions", "length_probe"},
                       "drafter_training_set": {"completions", "length_quality_report"}, "length_probe": {"prompt_shards"}}
    partitioned = {k.to_user_string() for k in graph.get_all_asset_keys() if graph.get(k).partitions_def}
    assert partitioned == {"prompt_shards", "completions", "continued_completions", "length_quality_report"}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.partitions_def is None or node.partitions_def.name == "shards"
        assert node.description and node.group_name in {"generation", "probe", "quality", "training"} and node.owners
        assert node.kinds and node.kinds <= {"sglang", "parquet", "duckdb"}


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
    from dflash_assets.generation.schema import COMPLETION_SCHEMA

    for name in ("completions", "continued_completions"):
        policy = defs.resolve_assets_def(name).op.retry_policy
        assert policy is not None and policy.max_retries >= 1, name
    schema = defs.resolve_assets_def("completions").specs_by_key[dg.AssetKey("completions")].metadata[
        "dagster/column_schema"]
    assert [(c.name, c.type) for c in schema.columns] == [(f.name, str(f.type)) for f in COMPLETION_SCHEMA]


def test_jobs_schedules_and_sensors():
    assert defs.resolve_job_def("shard_pipeline").partitions_def.name == "shards"
    checks_job = defs.resolve_job_def("quality_checks")
    assert checks_job.partitions_def is None
    assert {k.name for k in checks_job.asset_layer.asset_graph.asset_check_keys} >= {c.name for c in CHECKS}
    schedule = defs.resolve_schedule_def("quality_checks_schedule")
    assert schedule.cron_schedule == "0 * * * *" and schedule.job_name == "quality_checks"
    assert defs.resolve_sensor_def("completions_landed_sensor").job_name == "quality_checks"
    assert defs.resolve_sensor_def("shard_partitions_sensor")




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
        outside = {m for m in imported_modules(path)
                   if m.startswith("dflash_assets.") and not m.startswith("dflash_assets.emulator")}
        assert not outside, (path, outside)


def test_the_definitions_carry_every_resource_the_assets_need():
    # the definitions carry every resource the assets need; nothing is left for the caller to supply
    assert {"fleet", "prompt_source", "data_dir", "quality"} <= set(defs.resources)
    assert isinstance(defs.resources["fleet"], dg.ConfigurableResource)
