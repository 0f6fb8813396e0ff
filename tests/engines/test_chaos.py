"""The chaos benchmark's short version (benchmarks/bench_chaos.py, the same seeded schedule): `dflash backfill` on
three emulators behind the real smg, its data dir on a tmpfs, meets every fault in one run: 5xx bursts, a stall,
a worker killed and relaunched, a poisoned prompt, a worker added and one removed, the command killed -9 twice and
stopped by SIGTERM once, the disk filled once. Nothing is lost or duplicated, and only the poisoned prompt failed:
quarantined after two worker deaths.

Run on demand (DFLASH_CHAOS=1): the benchmark injects each fault when the committed rows reach its share, and a
restarted command can commit the rest of the run before the next fault's share is seen, so whether every fault
comes depends on how the run and the benchmark interleave. Until the benchmark holds the fleet at each fault's
share, it stays out of the suite's default run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash_assets.generation.quarantine import QUARANTINED
from tests.support.dagster_procs import ARTIFACTS, ROOT

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.long,
    pytest.mark.engines,
    pytest.mark.skipif(os.environ.get("DFLASH_CHAOS") != "1", reason="on demand: DFLASH_CHAOS=1 (see the docstring)"),
]


def test_a_short_chaos_run_loses_nothing_duplicates_nothing_and_fails_only_the_poisoned_prompt(tmp_path):
    out = tmp_path / "figures.json"
    logs = ARTIFACTS / "logs" / "chaos"
    script = ROOT / "benchmarks" / "bench_chaos.py"
    ran = subprocess.run(
        [sys.executable, str(script), "--prompts", "800", "--json", str(out), "--logs", str(logs)],
        capture_output=True,
        text=True,
        timeout=840,
    )
    if "cannot mount" in ran.stderr or "mount: " in ran.stderr:
        pytest.skip(f"no tmpfs here: {ran.stderr.strip().splitlines()[-1]}")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    figures = json.loads(out.read_text())
    assert (figures["lost"], figures["duplicated"]) == (0, 0), ran.stdout
    [(prompt_id, error)] = figures["failed"]
    assert prompt_id == figures["poisoned"] and error.startswith(QUARANTINED[:40]), ran.stdout
    assert figures["committed"] == 800 - 1, ran.stdout
    assert [name for name, _, _ in figures["faults"]] == [
        "5xx burst",
        "kill -9",
        "kill worker",
        "stall",
        "add worker",
        "disk full",
        "kill -9",
        "remove worker",
        "SIGTERM",
    ], "every fault came, in the schedule's order"
    assert all(recovered is not None for _, _, recovered in figures["faults"]), "the run went on after each"
    assert figures["worker_deaths"] == 3, "the one killed, and two for the poisoned prompt"
    assert figures["exits"].count(-9) == 2 and 143 in figures["exits"] and figures["exits"][-1] in (0, 3), figures
