"""Every command the tool prints runs as printed in the shell the user typed the first one in: a clean shell (`env -i`
with only PATH, without the project's .venv/bin, and HOME) in the README's folder, the first command typed as the
README types it (`uv run dflash demo --prompts mine.jsonl --data-dir ...`) on the user's own prompts in a new data
dir. Each printed command (demo, continue, report, configs, backfill, probe, the UI's) is pasted there whole and
run: `uv run` as the first was, the same data, a flag once, never the config just run."""

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from dflash_assets.emulator.process import free_port
from tests.support.dagster_procs import ROOT, Webserver, log_tail, start_group, stop_group, wait_loaded

pytestmark = pytest.mark.long

# a command as printed: its environment, then `uv run dflash <command>` (not `dflash demo: ...`, a header)
PRINTED = re.compile(r"^\s*((?:[A-Z_]+=\S+ )*uv run dflash [a-z]+(?= |$).*)$", re.M)
BARE = re.compile(r"(?<!uv run )\bdflash (?:demo|backfill|continue|report|configs|export|generate|probe) --")
UI = re.compile(r"^.*?((?:[A-Z_]+=\S+ )+uv run dg dev)$", re.M)


def shell_env() -> dict[str, str]:
    """A clean shell's environment: PATH without the project's virtual environment, HOME; nothing else."""
    venv = str(ROOT / ".venv")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not p.startswith(venv))
    return {"PATH": path, "HOME": os.environ["HOME"]}


def paste(command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`command` pasted into a clean shell in the README's folder."""
    return subprocess.run(
        ["env", "-i", *(f"{k}={v}" for k, v in shell_env().items()), "bash", "-c", command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def printed(out: str) -> list[str]:
    """Every command a run printed, each whole on its own line; and none printed without its launcher."""
    assert not BARE.search(out), out
    return [m.group(1).strip() for m in PRINTED.finditer(out)]


def words_of(command: str) -> tuple[list[str], list[str]]:
    """A printed command's `NAME=value`s and its `dflash ...` words, as the shell splits them."""
    words = shlex.split(command)
    n = words.index("uv")
    assert words[n : n + 3] == ["uv", "run", "dflash"], command
    return words[:n], words[n + 2 :]


def flags_once(argv: list[str]) -> None:
    flags = [w.split("=", 1)[0] for w in argv if w.startswith("--")]
    assert len(flags) == len(set(flags)), argv


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paste")
    mine = tmp / "mine.jsonl"
    mine.write_text("".join(json.dumps({"id": f"m{i}", "prompt": f"tell me about {i}"}) + "\n" for i in range(24)))
    home, data = tmp / "home", tmp / "runs" / "mine"
    typed = (
        f"DAGSTER_HOME={home} uv run dflash demo --prompts {mine} --data-dir {data} --servers 1 --shard-size 12 "
        "--max-output-tokens 1024 --trainer-max-length 4096"
    )
    return tmp, mine, home, data, paste(typed)


def test_every_command_printed_runs_as_printed_in_the_shell_the_first_was_typed_in(first, emulator):
    tmp, mine, home, data, result = first
    assert result.returncode == 3, result.stdout + result.stderr  # cut inside the window at 1024: a plan, stopped
    queue, ran, seen = printed(result.stdout), [], set()
    assert {words_of(c)[1][1] for c in queue} >= {"continue", "demo", "report"}, result.stdout
    server = emulator()
    queue.append(
        f"DAGSTER_HOME={home} uv run dflash probe --urls {server.emu.url} --data-dir {data} --size 8 --max-output-tokens 4096"
    )
    while queue:
        command = queue.pop(0)
        env, argv = words_of(command)
        kind = argv[1]
        if kind in seen or kind == "export":  # export: the gate refuses a config cut inside the window
            continue
        seen.add(kind)
        flags_once(argv)
        assert f"DAGSTER_HOME={home}" in env, command
        if kind not in ("generate", "probe"):  # those two read their data dir only from --data-dir
            assert f"--data-dir {data}" in command, command
        again = paste(command)
        said = again.stdout + again.stderr
        assert again.returncode in (0, 3), command + "\n" + said
        assert "holds the prompt shards of" not in said and "no completions under" not in said, command + "\n" + said
        ran.append(kind)
        queue += printed(again.stdout)
    assert set(ran) >= {"continue", "demo", "report", "configs", "backfill", "probe"}, ran


def test_the_printed_ui_command_opens_that_data_in_a_clean_shell(first):
    tmp, mine, home, data, result = first
    [ui] = UI.findall(result.stdout)
    assert f"DAGSTER_HOME={home}" in ui and f"DFLASH_DATA_DIR={data}" in ui, ui
    port = free_port()
    log = tmp / "dg-dev.log"
    env = shell_env()
    proc = start_group(
        ["env", "-i", *(f"{k}={v}" for k, v in env.items()), "bash", "-c", f"{ui} -h 127.0.0.1 -p {port}"],
        env,
        log,
    )
    server = Webserver(port, proc, log)
    try:
        wait_loaded(server, "dg dev", 300.0)
        query = """query($name: String!) { topLevelResourceDetailsOrError(resourceSelector: {repositoryLocationName:
          "dflash_assets", repositoryName: "__repository__", resourceName: $name}) {
          ... on ResourceDetails { configuredValues { key value type } } } }"""
        details = server.gql(query, {"name": "data_dir"})["topLevelResourceDetailsOrError"]
        values = {v["key"]: (v["type"], v["value"]) for v in details["configuredValues"]}
        assert values["path"] == ("ENV_VAR", "DFLASH_DATA_DIR"), log_tail(log)  # the command's: data
    finally:
        stop_group(proc)


def test_a_command_started_without_uv_prints_commands_that_run_from_path(first):
    """Started as a `dflash` on PATH (an activated environment), its commands start `dflash`, not `uv run`."""
    tmp, mine, home, data, _ = first
    env = shell_env() | {"PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{shell_env()['PATH']}"}
    ran = subprocess.run(
        ["dflash", "configs", "--data-dir", str(data)],
        env=env | {"DAGSTER_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert f"DAGSTER_HOME={home} dflash export --config HASH --data-dir {data}" in ran.stdout, ran.stdout
    assert "uv run" not in ran.stdout, ran.stdout
    assert Path(data).is_dir()
