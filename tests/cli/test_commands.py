"""The `dflash` command as a person types it: fleet up/status/down through the launch path, errors, help."""

import re
from pathlib import Path

import pytest

from tests.support.cli import cli_commands, dflash, free_base_port

pytestmark = pytest.mark.long


@pytest.mark.parametrize("command", cli_commands(), ids=" ".join)
def test_every_command_has_help(command):
    result = dflash(*command, "--help")
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr


def test_dflash_help_says_what_the_tool_does_and_where_to_start_not_how_it_is_built():
    said = " ".join(dflash("--help").stdout.split())
    assert "training data for a DFlash drafter" in said and "Start with `dflash demo`" in said, said
    assert "parser" not in said and "settings.py" not in said, said


def test_fleet_up_status_reuse_and_down_through_the_launch_path(tmp_path):
    base = str(free_base_port())
    up = [
        "fleet",
        "--fleet-dir",
        str(tmp_path),
        "up",
        "--model-path",
        "emulated/qwen3-27b",
        "--gpus",
        "0,1",
        "--command",
        "emulator",
        "--base-port",
        base,
        "--context-length",
        "16384",
        "--health-timeout-s",
        "60",
    ]
    try:
        first = dflash(*up)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "gpu0: launched" in first.stdout and "gpu1: launched" in first.stdout
        status = dflash("fleet", "--fleet-dir", str(tmp_path), "status")
        assert status.returncode == 0, status.stdout
        assert status.stdout.count("healthy") == 2 and "16,384" in status.stdout
        watched = dflash("fleet", "--fleet-dir", str(tmp_path), "status", "--watch", "2")
        assert "Fleet tuning" in watched.stdout and watched.stdout.count("idle") == 2, watched.stdout
        again = dflash(*up)
        assert "gpu0: reused" in again.stdout and "gpu1: reused" in again.stdout
        changed = dflash(*[a if a != "16384" else "8192" for a in up])
        assert changed.returncode == 2
        assert "context_length: 16384 -> 8192" in changed.stdout and "--replace" in changed.stdout
    finally:
        down = dflash("fleet", "--fleet-dir", str(tmp_path), "down")
    assert down.returncode == 0 and "2 server(s) stopped" in down.stdout
    after = dflash("fleet", "--fleet-dir", str(tmp_path), "status")
    assert after.returncode == 1 and "no servers" in after.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["fleet", "up", "--model-path", "m", "--gpus", "a,b"], "gpus must be comma-separated GPU ids"),
        (["fleet", "up", "--model-path", "m", "--extra-args", "--cuda-graph-max-bs 8"], "--cuda-graph-max-bs"),
        (
            ["demo", "--max-output-tokens", "0"],
            "dflash demo: invalid generation config: max_output_tokens must be a positive integer, got 0",
        ),
        (["backfill", "--regenerate", "every"], "--regenerate takes one of auto, last_turn, all_turns, got 'every'"),
        (["backfill", "--max-attempts", "0"], "dflash backfill: max_attempts must be >= 1, got 0"),
        (
            ["generate", "--shard", "00000", "--urls", "http://127.0.0.1:1,http://127.0.0.1:1/"],
            "server URL http://127.0.0.1:1 is listed twice",
        ),
        (["probe", "--urls", "http://me:secret@127.0.0.1:1"], "server URL #1 carries credentials"),
        (["generate", "--shard", "00000", "--urls", "http://127.0.0.1:1", "--top-p", "2"], "top_p must be in (0, 1]"),
        (["nonsense"], "'nonsense' is not a command"),
    ],
)
def test_bad_arguments_give_a_clear_error(tmp_path, args, message):
    result = dflash(*args, env={"DAGSTER_HOME": str(tmp_path)})
    assert result.returncode == 2
    assert message in result.stdout + result.stderr


def test_report_without_data_says_where_it_looked(tmp_path):
    result = dflash("report", "--data-dir", str(tmp_path / "nothing"))
    assert result.returncode == 2 and f"no completions under {tmp_path / 'nothing'}" in result.stderr


def test_report_prints_the_figures_of_a_data_dir_as_tables(tmp_path, emulator):
    import asyncio
    import json

    import duckdb

    from dflash_assets.fleet.fleet import connected
    from dflash_assets.generation.shards import build_prompt_shard

    server = emulator("--reasoning-parser", "qwen3")
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"report test {i}"}) + "\n" for i in range(40)))
    data = tmp_path / ("a-data-dir-deep-enough-that-its-paths-outrun-the-120-columns-of-piped-output" * 2) / "data"

    async def build():
        async with connected([server.emu.url]) as fleet:
            await build_prompt_shard(src, 0, "00000", 40, data, fleet, {"enable_thinking": True})

    asyncio.run(build())
    gen = dflash(
        "generate", "--shard", "00000", "--urls", server.emu.url, "--data-dir", str(data), "--max-output-tokens", "4096"
    )
    assert "40 prompts = 40 completed + 0 rejected + 0 failed" in gen.stdout, gen.stdout + gen.stderr
    truncated = duckdb.sql(
        f"select count(*) filter (where finish_reason = 'length') from read_parquet('{data}/completions/**/*.parquet')"
    ).fetchall()[0][0]
    result = dflash("report", "--full", "--data-dir", str(data))
    assert result.returncode == 0, result.stderr
    assert f"{truncated / 40 * 100:.2f}%" in result.stdout, result.stdout
    assert "truncation_rate" in result.stdout and ("4,096" in result.stdout or "4096" in result.stdout)
    # a path is printed whole on its line, however long, so it can be copied (the tables keep 100 columns)
    (folder,) = [line for line in result.stdout.splitlines() if line.startswith("pictures: ")]
    assert len(folder) > 100 and Path(folder.removeprefix("pictures: ")) == data / "reports", result.stdout
    names = [line.strip() for line in result.stdout.splitlines() if re.fullmatch(r"  \S+\.png", line)]
    assert len(names) == 2 and all((data / "reports" / name).exists() for name in names), result.stdout


def test_backfill_materialises_a_range_through_dagster_and_resumes_on_a_second_run(tmp_path, emulator):
    import json

    server = emulator("--reasoning-parser", "qwen3")
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"b{i}", "prompt": f"backfill test {i}"}) + "\n" for i in range(15)))
    env = {
        "DAGSTER_HOME": str(tmp_path / "home"),
        "DFLASH_DATA_DIR": str(tmp_path / "data"),
        "DFLASH_FLEET_MODE": "attach",
        "DFLASH_FLEET_URLS": server.emu.url,
        "DFLASH_SHARDS_PER_RUN": "2",
    }
    args = [
        "backfill",
        "--full",
        "--from",
        "00000",
        "--to",
        "00001",
        "--prompts",
        str(src),
        "--shard-size",
        "5",
        "--max-output-tokens",
        "32000",
    ]
    first = dflash(*args, env=env, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "shards 00000..00001 (2), cap 32000, up to 2 shards per run" in first.stdout
    rows = [line.split() for line in first.stdout.splitlines() if line.strip().startswith("0000")]
    # shard, prompts, rejected, done, new: prompts = rejected + done + fail + left
    assert [(r[0], r[1], r[3], r[4]) for r in rows] == [("00000", "5", "5", "5"), ("00001", "5", "5", "5")]
    again = dflash(*args, env=env, timeout=300)
    rows = [line.split() for line in again.stdout.splitlines() if line.strip().startswith("0000")]
    assert [(r[0], r[3], r[4]) for r in rows] == [("00000", "5", "0"), ("00001", "5", "0")], again.stdout
    bad = dflash("backfill", "--from", "00009", "--prompts", str(src), "--shard-size", "5", env=env)
    assert bad.returncode == 2 and "no shard 00009; the shards are 00000..00002" in bad.stdout


def test_backfill_and_demo_take_every_generation_and_dispatch_flag(tmp_path, emulator):
    import json

    import dagster as dg
    import duckdb

    server = emulator("--reasoning-parser", "qwen3")
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"f{i}", "prompt": f"flag test {i}"}) + "\n" for i in range(6)))
    flags = [
        "--temperature",
        "0.3",
        "--top-k",
        "7",
        "--min-p",
        "0.1",
        "--presence-penalty",
        "0.5",
        "--regenerate",
        "all_turns",
        "--no-store-token-ids",  # honoured under the fixed cap (the window policy stores ids for its exact export)
        "--cap-policy",
        "fixed",
        "--max-in-flight-per-server",
        "3",
    ]
    home, data = tmp_path / "home", tmp_path / "data"
    env = {
        "DAGSTER_HOME": str(home),
        "DFLASH_DATA_DIR": str(data),
        "DFLASH_FLEET_MODE": "attach",
        "DFLASH_FLEET_URLS": server.emu.url,
    }
    result = dflash(
        "backfill",
        "--full",
        "--prompts",
        str(src),
        "--shard-size",
        "3",
        "--max-output-tokens",
        "32000",
        *flags,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = duckdb.sql(
        f"SELECT temperature, top_k, min_p, presence_penalty, turn, output_ids IS NULL FROM "
        f"read_parquet('{data}/completions/**/*.parquet')"
    ).fetchall()
    assert len(rows) == 6 and set(rows) == {(0.3, 7, 0.1, 0.5, 1, True)}, rows
    with dg.DagsterInstance.from_config(str(home)) as instance:
        [run] = [r for r in instance.get_runs() if r.job_name == "shard_pipeline"]
    config = run.run_config["ops"]["completions"]["config"]
    # the backfill ends, as the demo does, with the export of the config it ran
    [(config_hash,)] = duckdb.sql(
        f"SELECT DISTINCT config_hash FROM read_parquet('{data}/completions/**/*.parquet')"
    ).fetchall()
    manifest = json.loads((data / "training" / config_hash / "manifest.json").read_text())
    assert (manifest["config_hash"], manifest["chosen_by"]) == (config_hash, "run")
    assert f"rows of config {config_hash} (chosen by: run) in {data / 'training' / config_hash}" in result.stdout
    assert config["max_in_flight_per_server"] == 3 and config["repetition_penalty"] == 1.0  # the rest: defaults
    # the demo too, on its own emulated fleet; its own defaults stay (token ids stored) unless a flag says otherwise
    demo = dflash(
        "demo",
        "--full",
        "--prompts",
        str(src),
        "--shard-size",
        "3",
        "--servers",
        "1",
        "--max-output-tokens",
        "32000",
        "--temperature",
        "0.2",
        "--frequency-penalty",
        "0.25",
        env={"DAGSTER_HOME": str(tmp_path / "demo"), "DFLASH_DATA_DIR": str(tmp_path / "demo-data")},
        timeout=300,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    rows = duckdb.sql(
        f"SELECT temperature, frequency_penalty, turn, output_ids IS NULL FROM "
        f"read_parquet('{tmp_path}/demo-data/completions/**/*.parquet')"
    ).fetchall()
    assert len(rows) == 6 and set(rows) == {(0.2, 0.25, None, False)}, rows


@pytest.mark.parametrize("command", ["demo", "backfill"])
def test_the_next_command_a_run_suggests_repeats_the_settings_it_was_given(command):
    import shlex

    from dflash_assets.cli import _completions_config, build_parser, repeated_flags, trainer_flags

    given = ["--temperature", "0.3", "--regenerate", "all_turns", "--eject-after", "5", "--no-store-token-ids"]
    given += ["--trainer-max-length", "2048", "--trainer-format", "pretokenized"]  # the trainer's, too
    config, trainer = _completions_config(
        command, build_parser().parse_args([command, *given, "--max-output-tokens", "4096"])
    )
    again = repeated_flags(command, {**config, **trainer_flags(trainer)})
    assert again == " " + " ".join(given)  # the cap is the next command's own; defaults are left out
    suggested = build_parser().parse_args([command, *shlex.split(again), "--max-output-tokens", "4096"])
    assert _completions_config(command, suggested) == (config, trainer)
    config, trainer = _completions_config(command, build_parser().parse_args([command]))
    assert repeated_flags(command, {**config, **trainer_flags(trainer)}) == ""


def test_the_demo_takes_the_trainers_form_and_window_and_writes_the_pretokenized_file(tmp_path):
    import json

    import dagster as dg

    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"trainer test {i}"}) + "\n" for i in range(6)))
    home, data = tmp_path / "home", tmp_path / "data"
    demo = dflash(
        *("demo", "--full", "--prompts", str(src), "--shard-size", "6", "--servers", "1"),
        *("--trainer-format", "pretokenized", "--cap-policy", "window", "--trainer-max-length", "2048"),
        env={"DAGSTER_HOME": str(home), "DFLASH_DATA_DIR": str(data)},
        timeout=300,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    (out,) = (data / "training").iterdir()
    samples = [json.loads(line) for line in (out / "training_set.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and all(set(s) == {"id", "input_ids", "loss_mask"} for s in samples)
    assert all(len(s["input_ids"]) <= 2048 and 1 in s["loss_mask"] for s in samples)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["form"], manifest["max_length"]) == ("pretokenized", 2048)
    # the trainer's settings beside it, named on the terminal
    spec = (out / "specforge_data.yaml").read_text()
    assert f'  prompts_path: "{out / "training_set.jsonl"}"\n  max_length: 2048\n' in spec
    assert str(out / "specforge_data.yaml") in demo.stdout.replace("\n", "")
    # one window: the trainer's settings went to the quality resource only; the requests were sized to it
    with dg.DagsterInstance.from_config(str(home)) as instance:
        run = instance.get_runs()[-1]  # the first: the shard's run
    assert run.run_config["resources"]["quality"]["config"]["trainer"]["max_length"] == 2048
    assert run.run_config["resources"]["quality"]["config"]["trainer"]["format"] == "pretokenized"
    assert "trainer_max_length" not in run.run_config["ops"]["completions"]["config"]
