"""Ctrl-C and SIGTERM of the other long commands: `dflash generate` and `dflash probe` (no Dagster), `dflash continue`
(a Dagster run) and `dflash fleet status --watch`. tests/cli/test_polite_stop.py stops demo and backfill.

Each command runs on a fleet that answers one request and holds every later one (the emulator's hold_after), so
without the stop it would not end within the test's bound; the watch samples for longer than the bound. The command
must end with 130 (SIGINT to its process group) or 143 (SIGTERM to it), in one last line and no traceback; a command
that generates has its requests in flight ended on the server and keeps what it committed; continue's run is
CANCELED.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from tests.cli.test_kill_resume import BOUND_S, wait_until
from tests.support.backfill import FAST
from tests.support.cli import start
from tests.support.dagster_procs import PROJECT_DAGSTER_YAML
from tests.support.forks import start_emulator
from tests.support.http import Http, aborted, set_faults, settled
from tests.support.shards import generate, make_shard

pytestmark = pytest.mark.long

PROMPTS = {f"q{i}": f"polite stop question {i}" for i in range(6)}
FLAGS = [*FAST, "--enable-metrics", "--length-median", "600", "--length-sigma", "0.2", "--length-min", "200"]
CUT_CAP = 64  # every answer is longer: each row is cut, for continue


def parquet_rows(root: Path) -> int:
    import duckdb

    files = sorted(str(p) for p in root.rglob("*.parquet"))
    return duckdb.sql(f"select count(*) from read_parquet({files})").fetchall()[0][0] if files else 0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("polite-commands")
    home, data = tmp / "home", tmp / "data"
    home.mkdir()
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    with start_emulator(FLAGS) as emu:
        make_shard(data, [emu.url], PROMPTS)
        generate(data, [emu.url], CUT_CAP)  # a run cut at a small cap: what continue takes on
        env = {
            "DAGSTER_HOME": str(home),
            "DFLASH_DATA_DIR": str(data),
            "DFLASH_FLEET_MODE": "attach",
            "DFLASH_FLEET_URLS": emu.url,
            "DFLASH_PROMPTS": str(data.parent / "prompts.jsonl"),
            "DFLASH_SHARD_SIZE": str(len(PROMPTS)),
            "DFLASH_RETRY_DELAY_S": "3600",
        }
        yield tmp, home, data, emu, env


def commands(url: str, data: Path) -> dict:
    """name -> (argv, the signal, its exit status, where the command commits rows (None: it generates nothing))."""
    return {
        "generate": (
            ["generate", "--shard", "00000", "--urls", url, "--data-dir", str(data)]
            + ["--max-output-tokens", "2048", "--commit-rows", "1"],
            signal.SIGINT,
            130,
            data / "completions",
        ),
        "probe": (
            ["probe", "--urls", url, "--data-dir", str(data), "--min-prompts", "6", "--commit-rows", "1"],
            signal.SIGTERM,
            143,
            data / "length_probe" / "completions",
        ),
        "continue": (["continue", "--to", "2048", "--data-dir", str(data)], signal.SIGINT, 130, None),
        "fleet": (["fleet", "status", "--urls", url, "--watch", str(10 * BOUND_S)], signal.SIGINT, 130, None),
    }


@pytest.mark.parametrize("name", ["generate", "probe", "continue", "fleet"])
def test_a_polite_stop_of_a_long_command_ends_it_in_one_line_and_ends_its_requests(fleet, name):
    tmp, home, data, emu, env = fleet
    argv, signum, status, rows_at = commands(emu.url, data)[name]
    http = Http(emu.url)
    before_rows, before_aborted = (parquet_rows(rows_at) if rows_at else 0), aborted(http)
    held = lambda: Http(emu.url).get("/_emulator/faults")[1]["injected"]["hold"]  # noqa: E731
    held_before = held()
    set_faults(emu.url, {"hold_after": 1 if rows_at else 0})  # one answer (committed), then every request held
    out = tmp / f"{name}.txt"
    proc = start(*argv, out=out, env=env)
    try:
        if name == "fleet":
            wait_until(
                lambda: "sampling /v1/loads" in out.read_text() or emu.url in out.read_text(), "watching", proc, out
            )
        else:
            if rows_at:
                wait_until(lambda: parquet_rows(rows_at) > before_rows, "a row committed", proc, out)
            wait_until(lambda: held() > held_before, "a request held", proc, out)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=BOUND_S) == status, out.read_text()  # held for good: only the stop ends it
    finally:
        set_faults(emu.url, {"hold_after": None})
    text = out.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    said = f"dflash {'fleet status' if name == 'fleet' else name} stopped by "
    assert "Traceback" not in text and said in lines[-1] and sum(said in line for line in lines) == 1, text
    if name == "fleet":
        assert "nothing was sent to generate; run again with: dflash fleet status" in lines[-1], text
        return
    assert settled(http)["num_running_reqs"] == 0, "a request went on decoding for a client gone"
    assert aborted(http) - before_aborted >= 1, "the requests in flight were ended on the server"
    if rows_at:
        kept = parquet_rows(rows_at)
        assert kept > before_rows and f"{kept:,} completion rows are committed under {rows_at.parent}" in lines[-1]
    else:  # continue: a Dagster run, CANCELED
        with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
            [run] = [r for r in instance.get_runs() if r.job_name == "continue_shards"]
        assert run.status == dg.DagsterRunStatus.CANCELED, run
