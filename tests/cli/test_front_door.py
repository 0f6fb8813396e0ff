"""A data dir is named once: `dflash demo --prompts mine.jsonl --data-dir D`, and every command it prints (the next
run, continue, the UI) runs as printed in a clean shell, on D and mine.jsonl and nothing else."""

import json
import os
import re
import time

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from dflash_assets.emulator.process import free_port
from tests.support.cli import clean_shell as clean
from tests.support.cli import dflash
from tests.support.cli import split_command as split
from tests.support.dagster_procs import Webserver, log_tail, start_group, stop_group, wait_loaded

pytestmark = pytest.mark.long

SHARD_SIZE = 20
PRINTED = re.compile(r"((?:[A-Z_]+=\S+ )*dflash [a-z]+(?= |$)[^`\n]*)", re.M)  # a command, not `dflash demo: ...`
UI = re.compile(r"((?:[A-Z_]+=\S+ )+(?:uv run )?dg dev)")
SENSOR = """{ sensorOrError(sensorSelector: {repositoryLocationName: "dflash_assets", repositoryName: "__repository__",
  sensorName: "shard_partitions_sensor"}) { ... on Sensor { sensorState { ticks(limit: 1) { status skipReason } } } } }"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("front-door")
    mine = tmp / "mine.jsonl"
    mine.write_text("".join(json.dumps({"id": f"m{i}", "prompt": f"tell me about {i}"}) + "\n" for i in range(60)))
    home, data = tmp / "home", tmp / "runs" / "mine"
    env = clean([f"DAGSTER_HOME={home}"])
    result = dflash(
        *("demo", "--prompts", str(mine), "--data-dir", str(data), "--shard-size", str(SHARD_SIZE), "--servers", "1"),
        *("--max-output-tokens", "2048", "--trainer-max-length", "8192"),
        env=env,
        cwd=tmp,
        timeout=600,
    )
    return tmp, mine, home, data, result


def printed(out: str) -> list[str]:
    """Every dflash command the output prints, whole (a line that holds a command is never wrapped)."""
    found = [m.group(1).strip() for m in PRINTED.finditer(out)]
    return [c[:-1] if c.endswith(")") and c.count(")") > c.count("(") else c for c in found]  # a hint's (...)


def test_every_dflash_command_the_demo_prints_runs_as_printed_in_a_clean_shell(demo):
    tmp, mine, home, data, result = demo
    assert result.returncode == 3, result.stdout + result.stderr  # cut inside the window at 2048: stopped, a plan
    commands = printed(result.stdout)
    assert any(" dflash continue --to " in f" {c}" for c in commands), result.stdout
    assert any(" dflash demo " in f" {c}" for c in commands), result.stdout
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    for command in commands:
        words, argv = split(command)
        assert f"--data-dir {data}" in command, command
        # report and configs read the data dir alone (it knows its source); every other command names the prompts
        assert f"--prompts {mine}" in command or argv[1] in ("report", "configs"), command
        assert f"DAGSTER_HOME={home}" in words and f"DFLASH_SHARD_SIZE={SHARD_SIZE}" in words, command
        again = dflash(*argv[1:], env=clean(words), cwd=elsewhere, timeout=600)
        said = again.stdout + again.stderr
        assert "holds the prompt shards of" not in said, command + "\n" + said
        if argv[1] == "continue":
            assert again.returncode == 0, command + "\n" + said
        else:  # generated again at the recommended cap: a run of the same source, judged (0, or 3 if still cut)
            assert again.returncode in (0, 3), command + "\n" + said


RESOURCE = """query($name: String!) { topLevelResourceDetailsOrError(resourceSelector: {repositoryLocationName:
  "dflash_assets", repositoryName: "__repository__", resourceName: $name}) {
  ... on ResourceDetails { configuredValues { key value type } } } }"""


def resource_values(server: Webserver, name: str) -> dict[str, str]:
    """A resource's configured values in the loaded definitions, as the UI's resource page shows them: a value, or
    `$NAME` for one read from the environment variable NAME."""
    details = server.gql(RESOURCE, {"name": name})["topLevelResourceDetailsOrError"]
    values = {v["key"]: json.loads(v["value"]) for v in details["configuredValues"] if v["type"] == "VALUE"}
    return values | {v["key"]: f"${v['value']}" for v in details["configuredValues"] if v["type"] == "ENV_VAR"}


def test_the_printed_ui_command_opens_that_data_and_the_instance_holds_only_its_sources_shards(demo):
    tmp, mine, home, data, result = demo
    [ui] = UI.findall(result.stdout)
    words, argv = split(ui)
    # the instance and its data dir (whatever the instance runs later); the data dir knows its source and shard size
    known = ("DFLASH_PROMPTS", "DFLASH_SHARD_SIZE")
    assert f"DAGSTER_HOME={home}" in words and f"DFLASH_DATA_DIR={data}" in words, ui
    assert not any(w.startswith(known) for w in words), ui
    port = free_port()
    env = {k: v for k, v in clean(words).items() if v is not None}
    env = {k: v for k, v in os.environ.items() if not (k.startswith("DFLASH_") or k == "DAGSTER_HOME")} | env
    log = tmp / "dg-dev.log"
    proc = start_group([*argv, "-h", "127.0.0.1", "-p", str(port)], env, log)  # in the project, as printed
    server = Webserver(port, proc, log)
    try:
        wait_loaded(server, "dg dev", 300.0)
        assert resource_values(server, "data_dir")["path"] == "$DFLASH_DATA_DIR", log_tail(log)  # the command's: data
        assert resource_values(server, "prompt_source")["path"] == str(mine), log_tail(log)
        assert resource_values(server, "prompt_source")["shard_size"] == SHARD_SIZE, log_tail(log)
        deadline = time.monotonic() + 240
        while True:  # the daemon evaluates the partitions sensor with the definitions' resources
            ticks = server.gql(SENSOR)["sensorOrError"]["sensorState"]["ticks"]
            if ticks and ticks[0]["status"] in ("SKIPPED", "SUCCESS"):
                break
            assert time.monotonic() < deadline and proc.poll() is None, log_tail(log)
            time.sleep(2)
        # the sensor read mine.jsonl in D: its partitions are already the instance's, so it added nothing
        assert ticks[0] == {"status": "SKIPPED", "skipReason": "the shard partitions are those of the prompt source"}
    finally:
        stop_group(proc)
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        assert instance.get_dynamic_partitions("shards") == ["00000", "00001", "00002"]


def test_the_instance_alone_names_the_data_for_report_and_configs(demo):
    tmp, mine, home, data, result = demo
    env = clean([f"DAGSTER_HOME={home}"])  # no data dir, no prompts: the instance's record says which
    elsewhere = tmp / "elsewhere-report"
    elsewhere.mkdir(exist_ok=True)
    config = re.search(r"config ([0-9a-f]{12})", result.stdout).group(1)
    for command in (("report",), ("configs",)):
        ran = dflash(*command, env=env, cwd=elsewhere)
        assert ran.returncode == 0 and config in ran.stdout, ran.stdout + ran.stderr
        assert f"--data-dir {data}" in ran.stdout, ran.stdout  # and the commands it prints carry it
