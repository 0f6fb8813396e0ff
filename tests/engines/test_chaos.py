"""The chaos benchmark's short version (benchmarks/bench_chaos.py, the same seeded schedule): `dflash backfill` on
three emulators behind the real smg, its data dir on a tmpfs, meets every fault in one run: 5xx bursts, a stall,
a worker killed and relaunched, a poisoned prompt, a worker added and one removed, the command killed -9 twice and
stopped by SIGTERM once, the disk filled once. Every fault comes, whatever the run's speed: the benchmark holds the
fleet at each fault's share, injects it, then releases it, and between two looks each worker answers a bounded
number of requests, far fewer than the schedule's tail. Nothing is lost or duplicated, and only the poisoned prompt
failed: quarantined after two worker deaths. The command and the workers are forked warm (tests/support/forks.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_assets.generation.quarantine import QUARANTINED
from tests.support.dagster_procs import ARTIFACTS, ROOT

pytestmark = [pytest.mark.timeout(400), pytest.mark.long, pytest.mark.engines]

PROMPTS = 400


def test_a_short_chaos_run_meets_every_fault_loses_nothing_and_fails_only_the_poisoned_prompt(tmp_path):
    out, logs = tmp_path / "figures.json", ARTIFACTS / "logs" / "chaos"
    script = ROOT / "benchmarks" / "bench_chaos.py"
    argv = ["--prompts", str(PROMPTS), "--shard-size", str(PROMPTS), "--warm", "--json", str(out), "--logs", str(logs)]
    argv += ["--timeout-s", "330"]  # it stops what it started and says where it stood
    ran = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=380)
    if "cannot mount" in ran.stderr or "mount: " in ran.stderr:
        pytest.skip(f"no tmpfs here: {ran.stderr.strip().splitlines()[-1]}")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    figures = json.loads(out.read_text())
    assert (figures["lost"], figures["duplicated"]) == (0, 0), ran.stdout
    [(prompt_id, error)] = figures["failed"]
    assert prompt_id == figures["poisoned"] and error.startswith(QUARANTINED[:40]), ran.stdout
    assert figures["committed"] == PROMPTS - 1, ran.stdout
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
    # the full disk stopped the command (exit 1); each kill -9 and the SIGTERM stopped it; the last start finished
    assert figures["exits"][:-1] == [-9, 1, -9, 143] and figures["exits"][-1] in (0, 3), figures["exits"]
    # the one killed, and two for the poisoned prompt; one more only if the poisoned prompt came while the disk was
    # full (no run can write the death down there)
    assert figures["worker_deaths"] - figures["deaths_on_full_disk"] == 3, figures
    assert figures["deaths_on_full_disk"] <= 1, figures
