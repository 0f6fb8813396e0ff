"""A prompt that kills its server behind the gateway costs at most two servers: the real smg 1.13 (started by
deploy/sglang-router.sh, as tests/engines/test_gateway.py starts it) in front of three SGLang 0.5.23 emulators with
the crash_on fault. smg stays healthy when a worker dies, so the client asks the workers behind it directly
(generation/quarantine.py); the poisoned prompt is quarantined after two worker deaths, every other prompt is
committed, and a later run does not send it."""

from __future__ import annotations

import duckdb
import pytest

from dflash_assets.emulator.process import start_emulator
from dflash_assets.generation.quarantine import QUARANTINED
from dflash_assets.settings import DispatchSettings
from tests.support.dagster_procs import ARTIFACTS, fresh_dir, stop_group
from tests.support.shards import generate, make_shard, rows
from tests.support.smg import start_smg
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.long]

LOGS = ARTIFACTS / "logs" / "gateway-quarantine"
MARKER = "POISON-9c1d"
FLAGS = ["--reasoning-parser", "qwen3", "--length-median", "120", "--length-sigma", "0.4"]
FLAGS += ["--decode-tokens-per-s", "1500", "--max-running-requests", "3", "--fault-crash-on", MARKER]
N = 30
PROMPTS = {f"g{i:02d}": f"gateway question {i}" + (f" {MARKER}" if i == 7 else "") for i in range(N)}
SETTINGS = DispatchSettings(
    max_attempts=8, backoff_base_s=0.05, backoff_max_s=0.5, commit_rows=4, commit_seconds=0.2, load_sample_s=0
)


def healthy(gateway: str) -> int:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{gateway}/workers", timeout=10) as response:
        return sum(w["is_healthy"] for w in json.loads(response.read())["workers"])


def test_a_prompt_that_kills_its_worker_behind_the_gateway_costs_two_workers_and_is_quarantined(tmp_path):
    fresh_dir(LOGS)
    data, logs = tmp_path / "data", []
    workers = [start_emulator(FLAGS, log_path=LOGS / f"worker-{i}.log") for i in range(3)]
    smg, gateway = start_smg([w.url for w in workers], LOGS / "smg.log")
    try:
        wait_for("smg lists three healthy workers", lambda: healthy(gateway) == 3, 120)
        make_shard(data, [workers[0].url], PROMPTS)
        run = generate(data, [gateway], 256, SETTINGS, log=logs.append)
        dead = [w for w in workers if w.popen.poll() is not None]
        assert len(dead) == 2, ("the poisoned prompt killed the worker it reached, then one more, and no other", logs)
        assert (run.completed, run.failed) == (N - 1, 1), logs
        assert sorted(r[0] for r in rows(data, columns="prompt_id")) == sorted(set(PROMPTS) - {"g07"})
        [(prompt_id, error)] = duckdb.sql(
            f"select prompt_id, error from read_parquet('{data}/failures/**/*.parquet')"
        ).fetchall()
        assert prompt_id == "g07" and error.startswith(QUARANTINED), error
        assert sum("behind the gateway" in line and "died with requests in flight" in line for line in logs) == 2

        wait_for("smg marks the dead workers down", lambda: healthy(gateway) == 1, 60)
        again = generate(data, [gateway], 256, SETTINGS, log=logs.append)  # the marker would kill the last one
        assert all(w.popen.poll() is None for w in workers if w not in dead), "a later run did not send it"
        assert (again.completed, again.failed, again.already_done) == (N - 1, 1, N - 1)
    finally:
        (LOGS / "run.log").write_text("\n".join(logs))  # the run's log, should an assertion fail
        stop_group(smg, grace_s=15)
        for w in workers:
            w.stop()


@pytest.mark.parametrize("workers,health_interval_s", [(2, 1), (2, 5), (3, 5)])
def test_on_two_or_three_workers_at_any_health_check_interval_two_deaths_quarantine_it_and_no_innocent_fails(
    tmp_path, workers, health_interval_s
):
    """Every worker death counts, also one smg has already dropped from its list when the client asks; the requests
    smg sends to a dead worker before its health checks mark it down spend no attempt (no innocent prompt fails);
    the quarantine is written when it is decided, though the run then stops for lack of workers; relaunched at their
    ports, the workers finish the rest in one more run, and none dies a third time."""
    from dflash_assets.generation.slots import FleetDown

    here = LOGS.with_name(f"{LOGS.name}-{workers}-{health_interval_s}s")  # its own: the tests may run side by side
    fresh_dir(here)
    data, logs = tmp_path / "data", []
    fleet = [start_emulator(FLAGS, log_path=here / f"worker-{i}.log") for i in range(workers)]
    smg, gateway = start_smg([w.url for w in fleet], here / "smg.log", health_interval_s)
    short = SETTINGS.model_copy(update={"no_server_timeout_s": 3 * health_interval_s})
    try:
        wait_for("smg lists every worker healthy", lambda: healthy(gateway) == workers, 120)
        make_shard(data, [fleet[0].url], PROMPTS)
        deaths, outcomes = 0, []
        for _ in range(2):
            try:
                run = generate(data, [gateway], 256, short, log=logs.append)
                outcomes.append((run.completed, run.failed))
            except FleetDown:
                outcomes.append("fleet down")
            dead = [i for i, w in enumerate(fleet) if not w.alive()]
            deaths += len(dead)
            for i in dead:  # relaunched where it was
                fleet[i] = start_emulator(FLAGS, port=fleet[i].port, log_path=here / f"worker-{i}-again.log")
            wait_for("smg marks the relaunched workers up", lambda: healthy(gateway) == workers, 120)
            if outcomes[-1] != "fleet down":
                break
        assert deaths == 2, (outcomes, logs)
        assert outcomes[-1] == (N - 1, 1), (outcomes, logs)
        [(prompt_id, error)] = duckdb.sql(
            f"select prompt_id, error from read_parquet('{data}/failures/**/*.parquet')"
        ).fetchall()
        assert prompt_id == "g07" and error.startswith(QUARANTINED), error
        assert sorted(r[0] for r in rows(data, columns="prompt_id")) == sorted(set(PROMPTS) - {"g07"}), "each once"
    finally:
        (here / "run.log").write_text("\n".join(logs))
        stop_group(smg, grace_s=15)
        for w in fleet:
            w.stop()


def test_behind_the_gateway_a_worker_relaunched_at_its_port_is_back_and_its_next_death_counts(tmp_path):
    """A supervisor (systemd, Kubernetes) relaunches a dead worker at its port at once, and smg takes it back. The run
    saw it die; it is down only until it answers /health again (the quarantine asks every 0.5 s), so when the poisoned
    prompt, sent alone, kills it again, that is its second death: quarantined in the same run, the rest committed.
    Were the relaunch unseen, the second death would pass for the first one's drop and cost no attempt, and the
    prompt would kill every relaunch."""
    import threading
    import time

    here = LOGS.with_name(f"{LOGS.name}-relaunched")
    fresh_dir(here)
    data, logs, relaunches, stop = tmp_path / "data", [], [], threading.Event()
    worker = [start_emulator(FLAGS, log_path=here / "worker.log")]
    smg, gateway = start_smg([worker[0].url], here / "smg.log", 1)

    def supervise() -> None:  # relaunch it at its port 0.5 s after it died, three times at most
        while not stop.wait(0.05) and len(relaunches) < 3:
            if not worker[0].alive():
                time.sleep(0.5)
                worker[0] = start_emulator(FLAGS, port=worker[0].port, log_path=here / f"worker-{len(relaunches)}.log")
                relaunches.append(time.monotonic())

    supervisor = threading.Thread(target=supervise)
    prompts = {k: v for k, v in PROMPTS.items() if k < "g12"}
    try:
        wait_for("smg lists its worker healthy", lambda: healthy(gateway) == 1, 120)
        make_shard(data, [worker[0].url], prompts)
        supervisor.start()
        run = generate(data, [gateway], 256, SETTINGS.model_copy(update={"no_server_timeout_s": 30}), log=logs.append)
        assert len(relaunches) == 2, ("two deaths, each relaunched, and no third", logs)
        assert (run.completed, run.failed) == (len(prompts) - 1, 1), logs
        [(prompt_id, error)] = duckdb.sql(
            f"select prompt_id, error from read_parquet('{data}/failures/**/*.parquet')"
        ).fetchall()
        assert prompt_id == "g07" and error.startswith(QUARANTINED), error
        assert sorted(r[0] for r in rows(data, columns="prompt_id")) == sorted(set(prompts) - {"g07"}), "each once"
    finally:
        stop.set()
        if supervisor.is_alive():
            supervisor.join()
        (here / "run.log").write_text("\n".join(logs))
        stop_group(smg, grace_s=15)
        worker[0].stop()
