"""The Dagster UI as a person sees it, on a real instance with shards materialised.

Three shard partitions are added and two are materialised through the shard_pipeline job on an emulated
fleet: shard 00000 at a generous cap (every blocking check passes), shard 00001 at a 1024-token cap (the
truncation_rate check fails beside its report, which is made all the same); shard 00002 is left missing. Meanwhile `dagster-webserver`
starts on loopback with the project's workspace over that instance, and:
- GraphQL: the code location loads; assets (description, group, kinds), checks (description), schedules,
  sensors, jobs, partitions and their status are what the definitions say;
- headless Chromium (Debian's /usr/bin/chromium driven by Playwright) opens the asset graph, the completions
  partition page, its checks, the automation list and the pools page, finds the real names, keys and statuses
  in the rendered text, and saves a screenshot of each under test-artifacts/ui/.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dflash_assets.definitions import defs
from dflash_assets.quality import CHECKS
from tests.support.dagster_procs import (
    ARTIFACTS,
    LOCATION,
    LOCATION_STATUS,
    dflash_env,
    fresh_dir,
    make_home,
    materialize_shards,
    project_pool_limit,
    webserver,
)

pytestmark = pytest.mark.timeout(300)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DEMO_PROMPTS = Path(__file__).resolve().parents[2] / "dflash_assets" / "demo" / "prompts.jsonl"
SHOTS = ARTIFACTS / "ui"
VIEWPORT = {"width": 1600, "height": 1000}
TIMEOUT_MS = 45_000  # for a page to show a text: generous, the machine may be busy
KINDS = {"sglang", "parquet", "duckdb"}
PARTITIONED = {"prompt_shards", "completions", "length_quality_report"}
# shard -> the cap its run uses (None: the partition exists but is never materialised)
PLAN = {"00000": 16384, "00001": 1024, "00002": None}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """A webserver over an instance where shards 00000 and 00001 were materialised (see the module doc)."""
    base = tmp_path_factory.mktemp("ui")
    logs = fresh_dir(ARTIFACTS / "logs" / "ui")  # the seeding run's and the webserver's logs, kept for CI
    home = make_home(base / "dagster_home")
    prompts = base / "prompts.jsonl"
    prompts.write_text("".join(DEMO_PROMPTS.read_text().splitlines(keepends=True)[:12]))  # 3 shards of 4
    env = dflash_env(
        home,
        data_dir=base / "data",
        prompts=prompts,
        shard_size=4,
        fleet_mode="emulated",
        num_servers=1,
        emulator_args="--reasoning-parser qwen3 --decode-tokens-per-s 0",
    )
    # the shards are materialised while the webserver starts (both on the same instance)
    with ThreadPoolExecutor(1) as pool:
        seeding = pool.submit(materialize_shards, env, PLAN, logs / "seed.log")
        with webserver(home, env, log_dir=logs) as server:
            runs = seeding.result()
            blocking = {c.name for c in CHECKS if c.blocking}
            assert runs["00000"]["success"] and all(runs["00000"]["checks"][c] for c in blocking), runs["00000"]
            assert not runs["00001"]["success"] and runs["00001"]["checks"]["truncation_rate"] is False, runs["00001"]
            server.gql("mutation { setNuxSeen }")  # no "join the community" dialog over the pages
            yield server


# --- GraphQL ------------------------------------------------------------------------------------------


def test_the_code_location_loads(seeded):
    entries = seeded.gql(LOCATION_STATUS)["workspaceOrError"]["locationEntries"]
    assert [(e["name"], e["loadStatus"], e["locationOrLoadError"]["__typename"]) for e in entries] == [
        (LOCATION, "LOADED", "RepositoryLocation")
    ]


ASSETS = """{ assetNodes { assetKey { path } description groupName kinds isPartitioned
  partitionDefinition { type name } pools
  assetChecksOrError { ... on AssetChecks { checks { name description blocking } } } } }"""


def test_every_asset_and_check_is_listed_with_a_description_a_group_and_kinds(seeded):
    nodes = {n["assetKey"]["path"][-1]: n for n in seeded.gql(ASSETS)["assetNodes"]}
    assert set(nodes) == {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    assert PARTITIONED | {"length_quality_summary", "drafter_training_set"} <= set(nodes)
    for name, node in nodes.items():
        assert node["description"] and node["groupName"], name
        assert node["kinds"] and set(node["kinds"]) <= KINDS, (name, node["kinds"])
    graph = defs.resolve_asset_graph()
    partitioned = {k.to_user_string() for k in graph.get_all_asset_keys() if graph.get(k).partitions_def}
    assert {n for n, node in nodes.items() if node["isPartitioned"]} == partitioned and PARTITIONED <= partitioned
    for name in partitioned:  # every partitioned asset is partitioned by shard
        assert nodes[name]["partitionDefinition"] == {"type": "DYNAMIC", "name": "shards"}, name
    # the step claims its pools itself (defs/pools.py: Dagster 1.13's executor busy-polls a blocked `pool=`), so the
    # asset declares none; the claims show on the UI's Concurrency page
    assert nodes["completions"]["pools"] == []
    assert {"sglang", "parquet"} <= set(nodes["completions"]["kinds"])
    assert "duckdb" in nodes["length_quality_report"]["kinds"]
    # the checks: every quality check is on the report, described, blocking as the registry says; a check has
    # no group or kinds of its own in Dagster 1.13 (the UI shows it under its asset, which has them)
    checks = {c["name"]: c for c in nodes["length_quality_report"]["assetChecksOrError"]["checks"]}
    assert set(checks) == {c.name for c in CHECKS}
    for spec in CHECKS:
        assert checks[spec.name]["description"] == spec.description and spec.description, spec.name
        assert checks[spec.name]["blocking"] is spec.blocking, spec.name
    for name, node in nodes.items():
        for check in node["assetChecksOrError"].get("checks", []):
            assert check["description"], (name, check["name"])


REPOSITORY = """{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name }
  jobs { name isAssetJob description }
  schedules { name cronSchedule description scheduleState { status } }
  sensors { name description sensorType sensorState { status } } } } } }"""


def test_jobs_schedules_and_sensors_are_listed(seeded):
    [repo] = seeded.gql(REPOSITORY)["repositoriesOrError"]["nodes"]
    assert repo["location"]["name"] == LOCATION
    jobs = {j["name"]: j for j in repo["jobs"]}
    assert {j.name for j in defs.jobs} <= set(jobs)
    assert {"shard_pipeline", "quality_checks", "training_export"} <= set(jobs)
    assert all(jobs[j.name]["description"] for j in defs.jobs)
    schedules = {s["name"]: s for s in repo["schedules"]}
    assert set(schedules) == {s.name for s in defs.schedules} and "quality_checks_schedule" in schedules
    assert all(s["description"] and s["scheduleState"]["status"] == "RUNNING" for s in schedules.values())
    sensors = {s["name"]: s for s in repo["sensors"]}
    assert set(sensors) == {s.name for s in defs.sensors}
    assert {"shard_partitions_sensor", "completions_landed_sensor"} <= set(sensors)
    assert all(s["description"] for s in sensors.values())


PARTITIONS = """query($keys: [AssetKeyInput!]) { assetNodes(assetKeys: $keys) { assetKey { path } partitionKeys
  assetPartitionStatuses { ... on DefaultPartitionStatuses { materializedPartitions failedPartitions
    unmaterializedPartitions materializingPartitions } } } }"""

CHECK_EXECUTIONS = """query($name: String!) {
  assetCheckExecutions(assetKey: {path: ["length_quality_report"]}, checkName: $name, limit: 10) {
    runId status evaluation { success severity description } } }"""


def test_partitions_and_their_materialization_status_are_listed(seeded):
    keys = [{"path": [a]} for a in sorted(PARTITIONED)]
    nodes = {n["assetKey"]["path"][-1]: n for n in seeded.gql(PARTITIONS, {"keys": keys})["assetNodes"]}
    for name in PARTITIONED:
        assert nodes[name]["partitionKeys"] == sorted(PLAN), name
    status = {name: nodes[name]["assetPartitionStatuses"] for name in PARTITIONED}
    assert sorted(status["prompt_shards"]["materializedPartitions"]) == ["00000", "00001"]
    assert sorted(status["completions"]["materializedPartitions"]) == ["00000", "00001"]
    assert status["completions"]["unmaterializedPartitions"] == ["00002"]
    # shard 00001's truncation_rate check failed with ERROR and is blocking: its report was made all the same
    assert sorted(status["length_quality_report"]["materializedPartitions"]) == ["00000", "00001"]
    # both evaluations of truncation_rate are recorded: the failing one last
    executions = seeded.gql(CHECK_EXECUTIONS, {"name": "truncation_rate"})["assetCheckExecutions"]
    assert [e["evaluation"]["success"] for e in executions] == [False, True]
    assert executions[0]["evaluation"]["severity"] == "ERROR"
    assert executions[0]["evaluation"]["description"].startswith("shard 00001")


# --- the browser ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def page():
    """Headless Chromium (Debian's, not a Playwright download) on a fresh profile, driven by Playwright."""
    missing = None
    if not CHROMIUM.exists():
        missing = f"{CHROMIUM} is missing"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "the playwright package is missing"
    if missing:
        message = f"{missing}: `bash scripts/test.sh` installs everything the browser tests need"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    profile = tempfile.mkdtemp(prefix="dflash-chromium-")
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile, executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True, viewport=VIEWPORT
            )
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.errors = []
            page.on("pageerror", lambda e: page.errors.append(str(e)))
            yield page
            context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def shots():
    return fresh_dir(SHOTS)


def look(page, shot: Path, *texts: str | re.Pattern) -> str:
    """Wait until every text is on the rendered page, screenshot it, return the page's text."""
    from playwright.sync_api import expect

    body = page.locator("body")
    try:
        for text in texts:
            expect(body).to_contain_text(text, timeout=TIMEOUT_MS)
        page.wait_for_load_state("networkidle")
    finally:
        page.screenshot(path=str(shot))
    assert not page.errors, f"JavaScript errors on {page.url}: {page.errors}"
    return body.inner_text()


def visit(page, server, path: str, shot: Path, *texts: str | re.Pattern) -> str:
    page.goto(server.url + path)
    return look(page, shot, *texts)


def test_the_asset_graph_shows_the_assets_their_kinds_and_check_results(seeded, page, shots):
    visit(
        page,
        seeded,
        "/asset-groups",
        shots / "01-lineage-groups.png",
        "Global asset lineage",
        "generation",
        "quality",
        "training",
    )
    page.keyboard.press("Alt+KeyE")  # the graph's "Expand all groups" (remembered by the browser)
    names = sorted(k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys())
    page.get_by_text(names[0], exact=True).first.wait_for()
    page.set_viewport_size({"width": 2200, "height": 1500})  # wide and tall enough for the whole expanded graph
    try:
        page.reload()  # laid out and zoomed to fit afresh
        look(
            page,
            shots / "02-lineage-expanded.png",
            *names,
            "sglang",
            "Parquet",
            "DuckDB",
            re.compile(rf"\d+ / {len(CHECKS)} Passed"),
            "3 partitions",
            "Never materialized",
        )
    finally:
        page.set_viewport_size(VIEWPORT)
    text = visit(
        page,
        seeded,
        f"/locations/{LOCATION}/asset-groups/generation",
        shots / "03-generation-graph.png",
        "prompt_shards",
        "completions",
        "sglang",
        "Parquet",
        "3 partitions",
        "66% filled",
    )
    text = visit(
        page,
        seeded,
        f"/locations/{LOCATION}/asset-groups/quality",
        shots / "04-quality-graph.png",
        "length_quality_report",
        "length_quality_summary",
        "DuckDB",
        "Parquet",
        "66% filled",
        re.compile(rf"\d+ / {len(CHECKS)} Passed"),
    )
    # the report's latest check results are shard 00001's: some failed, so not all passed
    assert f"{len(CHECKS)} / {len(CHECKS)} Passed" not in text


def test_a_completions_partition_page_shows_keys_status_and_provenance(seeded, page, shots):
    visit(
        page,
        seeded,
        "/assets/completions?view=partitions&partition=00000",
        shots / "05-completions-00000.png",
        "3 Partitions Selected",
        "Materialized (2)",
        "Missing (1)",
        "00000",
        "00001",
        "00002",
        "Materialized",
        "shard_pipeline",
        "config_hash",
        "config_cap",
        "16384",
        re.compile(r"4 prompts = 4 completed \+ 0 rejected \+ 0 failed"),
    )
    visit(
        page,
        seeded,
        "/assets/completions?view=partitions&partition=00001",
        shots / "06-completions-00001.png",
        "00001",
        "Materialized",
        "1024",
        "new_rows_truncated",
    )


def test_the_checks_tab_shows_every_check_and_its_result(seeded, page, shots):
    text = visit(
        page,
        seeded,
        "/assets/length_quality_report?view=checks",
        shots / "07-report-checks.png",
        f"Checks ({len(CHECKS)})",
        *(c.name for c in CHECKS),
        "Succeeded",
        "Failed",
        "blocking",
    )
    # the latest evaluations come from shard 00001 (cap 1024): truncation_rate failed there
    assert re.search(r"truncation_rate\s+(truncation_rate\s+)?Failed", text), text
    page.get_by_text("truncation_rate", exact=True).first.click()
    look(
        page,
        shots / "08-truncation-rate.png",
        "This is a blocking asset check.",
        "Latest execution",
        "shard 00001",
        "Failed",
    )


def test_automation_and_the_fleet_pool_are_on_their_pages(seeded, page, shots):
    visit(
        page,
        seeded,
        "/automation",
        shots / "09-automation.png",
        *(s.name for s in defs.schedules),
        *(s.name for s in defs.sensors),
    )
    visit(
        page,
        seeded,
        "/deployment/concurrency",
        shots / "10-pools.png",
        "Pools",
        "sglang_fleet",
        re.compile(rf"sglang_fleet\s*{project_pool_limit()}"),
    )


def test_a_reports_partition_page_shows_its_compact_length_picture_at_once_and_the_full_one_with_a_click(
    seeded, page, shots
):
    visit(
        page,
        seeded,
        "/assets/length_quality_report?view=partitions&partition=00000",
        shots / "11-report-00000-pictures.png",
        "00000",
        "pictures",
        "length_survival",
        "completion_lengths",
    )
    # the compact SVG is under the UI's inline limit: an image on the page, drawn, without a click
    compact = page.locator('img[alt="length survival"]').first
    compact.wait_for(state="visible")
    assert compact.evaluate("img => img.complete && img.naturalWidth > 0"), "the compact picture did not render"
    assert page.locator('img[alt="completion lengths"]').count() == 0  # the full one waits behind its link
    page.locator("tr", has_text="completion_lengths").get_by_text("[Show Markdown]", exact=True).last.click()
    full = page.locator('img[alt="completion lengths"]').first
    full.wait_for(state="visible")
    assert full.evaluate("img => img.complete && img.naturalWidth > 0"), "the full histogram did not render"
    page.screenshot(path=str(shots / "12-report-00000-histogram.png"))
