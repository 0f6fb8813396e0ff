"""A fleet behind smg follows the gateway's membership during a run (fleet/membership.py): the real smg 1.13, started
by deploy/sglang-router.sh as tests/engines/test_gateway.py starts it, in front of two SGLang 0.5.23 emulators.

Mid-run, after a committed row, the two workers hold every request that reaches them and a third is registered
(`POST /workers`): it serves requests while the others hold (so before the run ends), and the run's in-flight limit
grows. Then the holds are let go and a first worker is removed (`DELETE /workers/{id}`, the UUID `GET /workers`
lists): smg drains it, and every prompt is committed exactly once. The run's fleet metadata records both changes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from dflash_assets.emulator.process import start_emulator
from dflash_assets.settings import DispatchSettings
from tests.support.dagster_procs import ARTIFACTS, fresh_dir, stop_group
from tests.support.http import Http, call, requests_served, set_faults
from tests.support.shards import generate, make_shard, rows
from tests.support.smg import start_smg
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.long]

LOGS = ARTIFACTS / "logs" / "gateway-membership"
FLAGS = ["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "600", "--length-max", "400"]
FLAGS += ["--max-running-requests", "2"]
N = 48
# prompts that share little but the chat template: smg's cache_aware policy sends a request whose prefix matches
# no worker's well to the worker with the smallest tree, which a joiner's is
PROMPTS = {f"m{i:02d}": " ".join(f"w{(i * 7919 + k * 104729) % 100003}" for k in range(120)) for i in range(N)}
SETTINGS = DispatchSettings(commit_rows=2, commit_seconds=0.2, backoff_base_s=0.05, max_attempts=6, load_sample_s=0)


def listed(gateway: str) -> list[dict]:
    return call("GET", f"{gateway}/workers")["workers"]


def test_a_worker_registered_mid_run_takes_work_and_one_removed_loses_nothing(tmp_path):
    fresh_dir(LOGS)
    data, logs = tmp_path / "data", []
    first = [start_emulator(FLAGS, log_path=LOGS / f"worker-{i}.log") for i in range(2)]
    joiner = start_emulator(FLAGS, log_path=LOGS / "worker-joiner.log")
    smg, gateway = start_smg([w.url for w in first], LOGS / "smg.log")
    try:
        wait_for("smg lists two healthy workers", lambda: sum(w["is_healthy"] for w in listed(gateway)) == 2, 120)
        make_shard(data, [gateway], PROMPTS)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(generate, data, [gateway], 1024, SETTINGS, log=logs.append)
            try:
                wait_for("a row", lambda: any((data / "completions").rglob("*.parquet")) or running.done(), 120)
                for w in first:
                    set_faults(w.url, {"hold": True})  # from now on only a new worker can answer
                call("POST", f"{gateway}/workers", {"url": joiner.url})
                wait_for("the run adds the joiner's slots", lambda: any("workers joined" in x for x in logs), 60)
                wait_for("the joiner serves a request", lambda: requests_served(Http(joiner.url)) > 0, 60)
                assert not running.done(), "the run ended before the joiner served"
            finally:
                for w in first:
                    set_faults(w.url, {"hold": None})
            [leaver] = [w for w in listed(gateway) if w["url"].rstrip("/") == first[0].url]
            call("DELETE", f"{gateway}/workers/{leaver['id']}")
            run = running.result(timeout=240)
        membership = run.servers[gateway]["membership"]
        assert (run.completed, run.failed) == (N, 0), logs
        done = [r[0] for r in rows(data, columns="prompt_id")]
        assert sorted(done) == sorted(PROMPTS), "every prompt committed exactly once"
        joined = next(e for e in membership if e["joined"])
        assert joined["joined"] == [joiner.url] and joined["servers"] == 3, membership
        assert joined["in_flight_limit"] == 3 * (2 + SETTINGS.waiting_margin), "the in-flight limit grew by a worker"
        assert any(e["left"] == [first[0].url] for e in membership), membership
        assert any("left ['" + first[0].url in line for line in logs), logs
    finally:
        stop_group(smg, grace_s=15)
        for w in [*first, joiner]:
            w.stop()
