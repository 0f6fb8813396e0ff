"""A newcomer's mistakes (issue 33's table): each gets one line on the terminal, what was given, what is wrong and
the fix, never a traceback or the whole usage; exit 2 for bad input, 1 (re-runnable) for a fleet that is down."""

import asyncio

import pytest

from dflash_assets.fleet.client import ServerClient, ServerError
from dflash_assets.fleet.fleet import open_session, wait_healthy
from tests.support.cli import dflash, free_base_port, home
from tests.support.shards import FAST, make_shard


def one_line(result) -> str:
    """The command's only line of output (stderr), checked to be alone and free of a stack trace."""
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout + result.stderr
    assert "Traceback" not in lines[0] and "usage:" not in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A data dir with prompt shard 00000 (and nothing else), built on an emulator that is gone by the tests."""
    from tests.support.emulator_thread import run_emulator_in_thread

    data = tmp_path_factory.mktemp("mistakes") / "data"
    emu = run_emulator_in_thread(FAST)
    try:
        make_shard(data, [emu.url])
    finally:
        emu.stop()
    return data


def dead_url() -> str:
    return f"http://127.0.0.1:{free_base_port(1)}"


@pytest.mark.parametrize("given", ["nope.jsonl", "."])
def test_a_prompt_file_that_cannot_be_read_is_named_with_the_fix_and_exits_2(tmp_path, given):
    env = home(tmp_path, "home")
    result = dflash("demo", "--prompts", given, env=env, cwd=tmp_path)
    line = one_line(result)
    assert result.returncode == 2, line
    what = "does not exist" if given == "nope.jsonl" else "is not a file"
    assert f"dflash demo: prompt source {(tmp_path / given).resolve()} {what} (given by --prompts)" in line, line
    assert line.endswith("give a JSONL or Parquet file of prompts"), line


def test_a_shard_outside_the_data_dir_is_named_with_the_shards_there_before_any_wait(data_dir):
    result = dflash("generate", "--shard", "00099", "--urls", dead_url(), "--data-dir", str(data_dir))
    line = one_line(result)  # and no "waiting for": the servers are not waited for
    assert result.returncode == 2, line
    assert f"dflash generate: no shard 00099 under {data_dir}: the shards there are 00000 (1)" in line, line
    probe = dflash("probe", "--shards", "00000,00099", "--urls", dead_url(), "--data-dir", str(data_dir))
    assert probe.returncode == 2 and "no shard 00099" in one_line(probe)


@pytest.mark.parametrize(
    "args,said",
    [
        (["demo", "--max-output-tokens", "lots"], "dflash demo: --max-output-tokens takes a whole number, got 'lots'"),
        (["demo", "--temperature", "hot"], "dflash demo: --temperature takes a number, got 'hot'"),
        (
            ["backfill", "--cap-policy", "tight"],
            "dflash backfill: --cap-policy takes one of fixed, window, got 'tight'",
        ),
        (["probe", "--urls", "http://127.0.0.1:1", "--mode", "x"], "--mode takes one of prompts, cut_rows, got 'x'"),
        (["nonsense"], "dflash: 'nonsense' is not a command; the commands are demo, backfill, continue"),
    ],
)
def test_a_malformed_flag_value_is_the_one_flag_its_values_and_help(args, said):
    result = dflash(*args)
    line = one_line(result)
    assert result.returncode == 2 and said in line, line
    assert line.endswith("--help` for more"), line


def test_help_lists_the_values_of_every_setting_that_has_a_fixed_set():
    from dflash_assets.cli import build_parser
    from dflash_assets.settings import CAP_POLICIES, PROBE_MODES, REGENERATE

    usage = build_parser()._subparsers._group_actions[0].choices  # demo, backfill, ... by name
    demo, probe = usage["demo"].format_help(), usage["probe"].format_help()
    assert "--cap-policy {" + ",".join(CAP_POLICIES) + "}" in demo
    assert "--regenerate {" + ",".join(REGENERATE) + "}" in demo
    assert "--mode {" + ",".join(PROBE_MODES) + "}" in probe


def test_a_fleet_that_refuses_every_connection_is_said_at_once_and_ends_at_connect_refused_s(data_dir):
    url = dead_url()
    args = ["generate", "--shard", "00000", "--urls", url, "--data-dir", str(data_dir), "--connect-refused-s", "1"]
    result = dflash(*args)
    assert result.returncode == 1, result.stdout + result.stderr  # re-runnable: the servers can come back
    out = result.stdout + result.stderr
    assert "Traceback" not in out and "not healthy after" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[0] == f"waiting for {url}/health (0 s of 120 s) ...", out  # said at once, with the limit
    assert lines[-1].startswith(
        f"dflash generate: nothing listens at {url}/health: the connection was refused for 1 s (connect_refused_s)"
    ), out
    assert lines[-1].endswith("run the same command again once the servers answer (committed completions are kept)")
    verbose = dflash(*args, "--verbose")
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr  # the stack trace, when asked for


def test_an_error_inside_a_command_is_its_first_line_and_the_stack_trace_only_with_verbose(tmp_path):
    part = tmp_path / "data" / "completions" / "shard=00000" / "part-0.parquet"
    part.parent.mkdir(parents=True)
    part.write_text("not parquet")  # a part someone wrote by hand
    result = dflash("report", "--data-dir", str(tmp_path / "data"))
    line = one_line(result)
    assert result.returncode == 1, line
    assert line.startswith(f"dflash report: ValueError: {part} is not a readable Parquet file: "), line
    assert line.endswith("(`dflash report ... --verbose` prints the stack trace)"), line
    verbose = dflash("report", "--data-dir", str(tmp_path / "data"), "--verbose")
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_a_report_that_cannot_write_its_pictures_is_the_data_dirs_line_not_a_stack_trace(tmp_path, emulator):
    from tests.support.shards import generate
    from tests.support.tmpfs import remount, tmpfs

    server = emulator(*FAST)
    data = tmp_path / "data"
    make_shard(data, [server.emu.url])
    generate(data, [server.emu.url], 4096)
    with tmpfs(data / "reports", "256k") as reports:
        remount(reports, "ro")
        result = dflash("report", "--data-dir", str(data))
    line = next(line for line in result.stderr.splitlines() if line.startswith("dflash report: "))
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr
    assert line.startswith(f"dflash report: read-only file system on {reports}"), line
    assert line.endswith("make it writable, then run the same command again (the committed rows are kept)"), line


def test_only_refused_connections_end_the_wait_early_a_server_answering_503_is_waited_for(emulator):
    loading = emulator("--startup-delay", "1.5", "--health-delay", "0")  # 503 while "loading", then healthy
    said = []

    async def wait(urls):
        async with open_session() as session:
            clients = [ServerClient(session, u) for u in urls]
            return await wait_healthy(clients, 60, refused_s=0.3, say=said.append)

    assert asyncio.run(wait([loading.emu.url])) > 1  # waited on, past refused_s, until it answered
    assert said == [f"waiting for {loading.emu.url}/health (0 s of 60 s) ..."]
    refused = dead_url()
    with pytest.raises(ServerError) as raised:
        asyncio.run(wait([emulator("--health-delay", "0").emu.url, refused]))
    assert raised.value.kind == "refused" and f"nothing listens at {refused}/health:" in raised.value.message


def test_a_source_with_two_bad_lines_shows_both_with_their_lines_on_the_terminal_the_manifest_the_report_and_ui(
    tmp_path,
):
    import json

    import dagster as dg

    lines = [json.dumps({"id": f"s{i}", "conversations": [{"from": "human", "value": f"q {i}"}]}) for i in range(20)]
    lines[10] = '{"id": "bad", "conversations": [{"from": "human", "value": "unterminated'
    lines[19] = json.dumps({"id": "empty", "conversations": []})
    src = tmp_path / "sharegpt.jsonl"
    src.write_text("\n".join(lines) + "\n")
    env = home(tmp_path, "home") | {"DFLASH_EMULATOR_ARGS": " ".join(FAST)}
    data = env["DFLASH_DATA_DIR"]
    demo = dflash(
        "demo", "--full", "--prompts", str(src), "--shard-size", "20", "--servers", "1", env=env, cwd=tmp_path
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    out = demo.stdout
    assert "rejected 2, by reason: '…' is empty (source) 1, invalid JSON (source) 1; every one:" in out, out
    assert "shard 00000 line 11 (source): invalid JSON: Unterminated string starting at (column 60)" in out, out
    assert "shard 00000 line 20 (source): 'conversations' is empty" in out, out
    assert "every reject, with its line and reason:" not in out, out  # all shown
    # the export's summary: "left out" only above rows left out (none here), "kept, with a note" above rows kept
    assert "left out, by reason:" not in out and "  left out: nothing" in out, out
    kept = [line for line in out.splitlines() if line.startswith("    kept ")]
    assert kept and out.index("  kept, with a note:") < out.index(kept[0]), out
    [manifest] = (tmp_path / "home-data" / "training").glob("*/manifest.json")
    manifest = json.loads(manifest.read_text())
    assert manifest["rejected"] == 2
    assert manifest["rejected_by_stage_and_reason"] == [
        {"stage": "source", "reason": "'…' is empty", "rows": 1},
        {"stage": "source", "reason": "invalid JSON", "rows": 1},
    ]
    report = dflash("report", "--data-dir", data, "--full")  # the rejects are a flag away from the answer
    assert report.returncode == 0 and "shard 00000 line 11 (source): invalid JSON" in report.stdout, report.stdout
    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("length_quality_report"))
        table = event.asset_materialization.metadata["rejects"].value
    assert "| source | invalid JSON | 1 |" in table and "| 00000 | 20 | 'conversations' is empty |" in table, table


def test_an_empty_dagster_home_gets_the_projects_dagster_yaml_and_no_dagster_warning(tmp_path):
    import yaml

    from dflash_assets.cli import PROJECT_DAGSTER_YAML

    fresh = tmp_path / "fresh-home"
    env = {"DAGSTER_HOME": str(fresh), "DFLASH_DATA_DIR": str(tmp_path / "data")}
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "one"}\n')
    result = dflash("backfill", "--from", "00009", "--prompts", str(src), env=env, cwd=tmp_path)  # bad on purpose
    assert result.returncode == 2, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert out.splitlines()[:2] == [
        f"DAGSTER_HOME={fresh} was empty: wrote the project's dagster.yaml there",
        "    (telemetry off, the run queue, the fleet's concurrency pool)",
    ], out
    assert "No dagster instance configuration file" not in out and "Telemetry" not in out, out
    written = yaml.safe_load((fresh / "dagster.yaml").read_text())
    assert written == yaml.safe_load(PROJECT_DAGSTER_YAML.read_text())
    assert written["telemetry"] == {"enabled": False} and written["nux"] == {"enabled": False}
    again = dflash("backfill", "--from", "00009", "--prompts", str(src), env=env, cwd=tmp_path)
    assert "was empty" not in again.stdout  # an instance already there keeps its own settings


def test_a_misspelt_flag_names_the_commands_help_and_the_closest_flag():
    result = dflash("demo", "--max-ouput-tokens", "4096")
    line = one_line(result)
    assert result.returncode == 2, line
    assert line == (
        "dflash demo: no flag --max-ouput-tokens (did you mean --max-output-tokens?); `dflash demo --help` for more"
    )


@pytest.mark.parametrize("command", ["demo", "backfill", "export"])
def test_a_truncated_flag_is_refused_not_taken_for_another(command):
    result = dflash(command, "--max-output-token" if command != "export" else "--conf", "4096")
    line = one_line(result)
    assert result.returncode == 2 and line.startswith(f"dflash {command}: no flag --"), line
    assert line.endswith(f"`dflash {command} --help` for more"), line
