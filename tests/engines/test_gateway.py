"""The SGLang model gateway in front of the fleet: `smg` 1.13, started by deploy/sglang-router.sh (the command a
user runs), in front of three SGLang 0.5.23 emulators over loopback; the pipeline attached to its one URL.

The three servers differ on purpose: 6 running requests; a `--max-running-requests 40` that the mamba state
cache caps at 10 (the gateway's worker labels carry the 40); and the default, capped by the mamba cache too.
All run a 2048-token context.

1. Everything smg calls on a server to register and watch it is a route SGLang 0.5.23 defines (read from the
   wheel), answered by the emulator; what 0.5.23 lacks (`/loads`) is a 404 there too.
2. Capacity: the fleet reads the servers behind the gateway from its own API (`GET /workers`) and sizes the
   requests in flight from their effective max_running_requests, not from the flag in the gateway's labels.
3. Preflight through the gateway: the context length, input limit and prompt token counts are the servers'
   own, exactly (the gateway's /v1/models has no context length and it tokenizes with a tokenizer of its own).
4. Through Dagster (shard_pipeline, attach mode, DFLASH_FLEET_URLS = the gateway): one server holds the requests
   routed to it and is SIGKILLed with them in flight. The retries are ours (the gateway runs with
   --disable-retries): every prompt ends in exactly one row or one preflight reject, the held requests come back
   as attempt 2 or later, and the live servers served exactly one generation request per row (nothing generated
   twice). Runs last: it kills a server of the module's fleet.

Logs: test-artifacts/logs/gateway/ (smg, the emulators, the Dagster run); figures: test-artifacts/gateway/.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pytest

from dflash_assets.emulator.process import EmulatorProcess, start_emulator
from dflash_assets.fleet.fleet import connected
from dflash_assets.fleet.gateway import GatewayClient
from dflash_assets.generation.preflight import Budget
from dflash_assets.generation.slots import FleetDown, SlotPicker
from dflash_assets.rules import CONTEXT_MARGIN
from dflash_assets.settings import DispatchSettings
from tests.support import waiting
from tests.support.cli import dflash
from tests.support.dagster_procs import (
    ARTIFACTS,
    dflash_env,
    fresh_dir,
    make_home,
    materialize_shards,
    stop_group,
)
from tests.support.shards import generate, make_shard, rows, write_prompts
from tests.support.smg import start_smg

pytestmark = pytest.mark.timeout(300)

CONTEXT = 2048
COMMON = [
    "--reasoning-parser",
    "qwen3",
    "--context-length",
    str(CONTEXT),
    "--decode-tokens-per-s",
    "3000",
    "--length-max",
    "600",
]
WORKERS = [["--max-running-requests", "6"], ["--max-running-requests", "40", "--max-mamba-cache-size", "30"], []]
VICTIM = 2
LOGS = ARTIFACTS / "logs" / "gateway"
OUT = ARTIFACTS / "gateway"


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen
    workers: list[EmulatorProcess]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


wait_for = functools.partial(waiting.wait_for, hint=f"smg log: {LOGS / 'smg.log'}")


@pytest.fixture(scope="module")
def gateway():
    fresh_dir(LOGS)
    workers = []
    try:
        for i, flags in enumerate(WORKERS):
            workers.append(start_emulator([*COMMON, *flags], log_path=LOGS / f"worker-{i}.log"))
        proc, url = start_smg([w.url for w in workers], LOGS / "smg.log")
        try:
            wait_for(
                "smg lists the three servers as healthy",
                lambda: sum(w["is_healthy"] for w in get(f"{url}/workers")["workers"]) == len(workers),
                proc=proc,
            )
            # registered and polled for load at least once: what the gateway calls on a server is all called
            wait_for(
                "smg polls the servers' load",
                lambda: all(any(" /v1/loads " in k for k in get(f"{w.url}/_emulator/routes")) for w in workers),
                proc=proc,
            )
            yield Gateway(url, proc, workers)
        finally:
            stop_group(proc, grace_s=15)
    finally:
        for w in workers:
            w.stop()


def sglang_routes() -> set[str]:
    """ "METHOD /path" of every HTTP route SGLang 0.5.23 serves, read from the wheel's entrypoints (not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the sglang 0.5.23 wheel is not installed: `uv pip install --no-deps sglang==0.5.23`")
    entrypoints = Path(next(iter(spec.submodule_search_locations))) / "srt" / "entrypoints"
    routes = set()
    decorator = re.compile(
        r'@(?:app|router)\.(get|post|put|delete|api_route)\(\s*"([^"]+)"(?:,\s*methods=\[([^\]]*)\])?'
    )
    for path in (entrypoints / "http_server.py", entrypoints / "v1_loads.py"):
        for verb, route, methods in decorator.findall(path.read_text()):
            for method in re.findall(r'"(\w+)"', methods) if verb == "api_route" else [verb.upper()]:
                routes.add(f"{method} {route}")
    assert {"GET /health", "GET /server_info", "GET /v1/models", "GET /v1/loads"} <= routes, "parser out of date"
    return routes


def test_what_the_gateway_calls_on_a_server_is_sglang_0_5_23s_and_the_emulator_answers_it(gateway):
    sglang = sglang_routes()
    called: dict[str, set[int]] = {}
    for worker in gateway.workers:
        for key, _count in get(f"{worker.url}/_emulator/routes").items():
            method, path, status = key.split(" ")
            called.setdefault(f"{method} {path}", set()).add(int(status))
    answered = {route for route, statuses in called.items() if statuses == {200}}
    missing = {route for route, statuses in called.items() if statuses != {200}}
    save("routes.json", {"called": {k: sorted(v) for k, v in sorted(called.items())}})
    # registration (health, models, server and model info) and the load monitor
    assert {"GET /health", "GET /v1/models", "GET /server_info", "GET /model_info", "GET /v1/loads"} <= answered
    assert answered <= sglang, f"the emulator answers routes SGLang 0.5.23 lacks: {answered - sglang}"
    # what the emulator does not answer, 0.5.23 does not have either (smg then falls back to /v1/loads)
    assert missing and not missing & sglang, missing
    listed = get(f"{gateway.url}/workers")["workers"]
    assert sorted(w["url"] for w in listed) == sorted(w.url for w in gateway.workers)
    assert {w["runtime_type"] for w in listed} == {"sglang"}
    assert {m["context_length"] for w in listed for m in w["models"]} == {CONTEXT}


def effective_max_running(url: str) -> int:
    return get(f"{url}/server_info")["internal_states"][0]["effective_max_running_requests_per_dp"]


def test_capacity_behind_the_gateway_is_the_servers_effective_max_running_requests(gateway):
    async def go():
        async with connected([gateway.url]) as fleet:
            dispatcher = SlotPicker(fleet.clients, fleet.infos)
            return fleet.clients, fleet.infos, dispatcher.capacity

    clients, infos, in_flight = asyncio.run(go())
    [client], [info] = clients, infos
    effective = [effective_max_running(w.url) for w in gateway.workers]
    labelled = [w["labels"].get("max_running_requests") for w in get(f"{gateway.url}/workers")["workers"]]
    assert isinstance(client, GatewayClient) and sorted(s.url for s in client.workers) == sorted(
        w.url for w in gateway.workers
    )
    assert effective[0] == 6 and effective[1] == 30 // 3  # the mamba cache caps the flag's 40
    assert info.servers == 3 and info.max_running_requests == sum(effective)
    # every server gets its running slots plus the waiting margin, so none idles between two requests
    assert in_flight == sum(effective) + 3 * DispatchSettings().waiting_margin
    assert "40" in labelled, "the gateway's labels carry the flag, which is not what the server runs"
    save(
        "capacity.json",
        {"effective_max_running_requests": effective, "gateway_labels": labelled, "in_flight": in_flight},
    )


def test_preflight_through_the_gateway_uses_the_servers_own_limits_and_token_counts(gateway):
    messages = [{"role": "user", "content": "word " * 700}]
    kwargs = {"enable_thinking": True}

    async def go():
        async with connected([gateway.url]) as fleet:
            counts = [await fleet.clients[0].count_prompt_tokens(messages, kwargs) for _ in gateway.workers]
            return fleet.infos[0], counts

    info, counts = asyncio.run(go())
    direct = post(f"{gateway.workers[0].url}/v1/tokenize", {"messages": messages, "chat_template_kwargs": kwargs})
    limits = {get(f"{w.url}/server_info")["max_req_input_len"] for w in gateway.workers}
    contexts = {get(f"{w.url}/v1/models")["data"][0]["max_model_len"] for w in gateway.workers}
    assert "max_model_len" not in get(f"{gateway.url}/v1/models")["data"][0], "the gateway's own card has no context"
    assert (info.context_length, {info.max_req_input_len}) == (CONTEXT, limits) and contexts == {CONTEXT}
    assert counts == [direct["count"]] * len(gateway.workers), "each server counts the chat template the same"
    budget = Budget.of([info])
    fits = CONTEXT - CONTEXT_MARGIN - direct["count"]
    assert budget.problem(direct["count"], fits) is None
    assert budget.problem(direct["count"], fits + 1) == (
        f"prompt of {direct['count']} tokens + max_output_tokens {fits + 1} = {CONTEXT - 1} exceeds the server "
        f"context length {CONTEXT} minus a safety margin of 2 tokens"
    )


def test_fleet_status_on_the_gateway_url_shows_the_workers_behind_it(gateway):
    from dflash_assets.fleet.status import fleet_status

    [head, *rows] = fleet_status(attach_urls=[gateway.url])
    direct = fleet_status(attach_urls=[w.url for w in gateway.workers])  # each server asked on its own URL
    effective = [effective_max_running(w.url) for w in gateway.workers]
    assert (head.url, head.healthy, head.workers) == (gateway.url, True, 3)
    assert (head.name, head.error) == ("smg gateway", "3 workers, 3 healthy")
    assert (head.context_length, head.max_running_requests) == (CONTEXT, sum(effective))  # what the pipeline sizes by
    assert sorted((r.url, r.healthy, r.gateway, r.context_length, r.max_running_requests) for r in rows) == sorted(
        (d.url, True, gateway.url, CONTEXT, e) for d, e in zip(direct, effective)
    )
    assert [d.max_running_requests for d in direct] == effective
    # the command a user runs: the gateway's row, then its workers indented, and exit 0 (all healthy)
    done = dflash("fleet", "status", "--urls", gateway.url, env={"COLUMNS": "250"}, timeout=120)  # forked warm
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split("│")[1].strip(): line for line in done.stdout.splitlines() if line.count("│") > 2}
    assert gateway.url in lines["smg gateway"] and "3 workers, 3 healthy" in lines["smg gateway"], done.stdout
    assert sorted(
        next(u for u in (w.url for w in gateway.workers) if u in lines[f"worker {i}"]) for i in (1, 2, 3)
    ) == sorted(w.url for w in gateway.workers), done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def test_a_worker_the_gateway_marks_unhealthy_is_left_out_and_with_none_healthy_the_fleet_refuses(gateway):
    """smg keeps listing a worker whose /health fails, `is_healthy: false, status: "not_ready"`, and its own
    /health still answers 200: the fleet reads and sizes by the healthy workers only, and with none healthy
    refuses with the list, rather than send into a gateway that has nowhere to route."""
    from dflash_assets.fleet.gateway import GatewayError
    from dflash_assets.fleet.status import fleet_status

    def unhealthy(n: int):
        return lambda: sum(not w["is_healthy"] for w in get(f"{gateway.url}/workers")["workers"]) == n

    async def fleet():
        async with connected([gateway.url], health_timeout_s=10) as probed:
            return probed

    sick, rest = gateway.workers[0], gateway.workers[1:]
    try:
        post(f"{sick.url}/_emulator/faults", {"unhealthy": True})  # its /health answers 503
        wait_for("smg marks the first server unhealthy", unhealthy(1), proc=gateway.proc)
        listed = {w["url"].rstrip("/"): w for w in get(f"{gateway.url}/workers")["workers"]}
        assert len(listed) == 3 and (listed[sick.url]["is_healthy"], listed[sick.url]["status"]) == (False, "not_ready")
        probed = asyncio.run(fleet())
        [client], [info] = probed.clients, probed.infos
        assert sorted(s.url for s in client.workers) == sorted(w.url for w in rest)
        assert (info.servers, info.max_running_requests) == (2, sum(effective_max_running(w.url) for w in rest))
        [head, *rows] = fleet_status(attach_urls=[gateway.url])
        assert head.error == "3 workers, 2 healthy" and head.max_running_requests == info.max_running_requests
        [row] = [r for r in rows if r.url == sick.url]
        assert not row.healthy and row.error.startswith("the gateway marks it unhealthy (not_ready)"), row

        for w in rest:
            post(f"{w.url}/_emulator/faults", {"unhealthy": True})
        wait_for("smg marks every server unhealthy", unhealthy(3), proc=gateway.proc)
        with pytest.raises(GatewayError) as refused:
            asyncio.run(fleet())
        listed = ", ".join(f"{w['url'].rstrip('/')} (not_ready)" for w in get(f"{gateway.url}/workers")["workers"])
        assert str(refused.value) == f"the gateway {gateway.url} has no healthy worker (workers: {listed})"
    finally:
        for w in gateway.workers:
            post(f"{w.url}/_emulator/faults", {"unhealthy": None})
        wait_for("smg marks the three servers healthy again", unhealthy(0), proc=gateway.proc)


def unhealthy_workers(gateway: Gateway) -> int:
    return sum(not w["is_healthy"] for w in get(f"{gateway.url}/workers")["workers"])


def no_worker_answers() -> int:
    """smg's 503 `no_available_workers` answers so far, counted in its log (one WARN line each)."""
    return (LOGS / "smg.log").read_text(errors="replace").count("No available workers for model")


NO_WORKER_PROMPTS = {f"n{i:02d}": f"No worker question {i}: name topic {i}." for i in range(12)}
IN_FLIGHT = 2  # per server: 6 requests held on the three workers, the other 6 sent while none is available


def run_with_no_worker_available(gateway: Gateway, data_dir: Path, settings: DispatchSettings) -> dict:
    """Generate NO_WORKER_PROMPTS through the gateway while smg has no worker to route to: the first 6 requests are
    held on the workers, every worker is then marked unhealthy in smg, and the 6 are let go, so the other 6 are
    sent into a gateway that answers 503 `no_available_workers`. Returns {"run" or "error", "no_worker_before"};
    the run goes on in a thread, and the workers stay unhealthy until the caller says otherwise."""
    make_shard(data_dir, [gateway.url], NO_WORKER_PROMPTS)
    held_before = sum(get(f"{w.url}/_emulator/faults")["injected"]["hold"] for w in gateway.workers)
    for w in gateway.workers:
        post(f"{w.url}/_emulator/faults", {"hold": True})
    outcome: dict = {}

    def go():
        try:
            outcome["run"] = generate(data_dir, [gateway.url], CAP, settings)
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            outcome["error"] = e

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    capacity = IN_FLIGHT * len(gateway.workers)
    wait_for(
        f"{capacity} requests held on the workers",
        lambda: (
            sum(get(f"{w.url}/_emulator/faults")["injected"]["hold"] for w in gateway.workers) - held_before >= capacity
        ),
        timeout_s=120,
    )
    for w in gateway.workers:
        post(f"{w.url}/_emulator/faults", {"unhealthy": True})
    wait_for("smg marks every worker unhealthy", lambda: unhealthy_workers(gateway) == 3, proc=gateway.proc)
    outcome["no_worker_before"] = no_worker_answers()
    for w in gateway.workers:
        post(f"{w.url}/_emulator/faults", {"hold": None})
    outcome["thread"] = thread
    return outcome


def workers_back(gateway: Gateway) -> None:
    for w in gateway.workers:
        post(f"{w.url}/_emulator/faults", {"unhealthy": None, "hold": None})
    wait_for("smg marks the three workers healthy again", lambda: unhealthy_workers(gateway) == 0, proc=gateway.proc)


def test_a_gateway_with_no_worker_available_costs_no_attempt_and_the_run_finishes_once_one_is_back(gateway, tmp_path):
    """smg answers 503 `no_available_workers` while it has no worker to route to (here every one unhealthy; in a
    server-killed run, the victim's circuit breaker open while the others are busy). That is the fleet down for the
    moment, not the request: it waits as for a fleet with no healthy server, spending no attempt. With one attempt
    a prompt, more such answers than waiting prompts show it; once a worker is back every prompt is one row."""
    settings = DispatchSettings(max_attempts=1, max_in_flight_per_server=IN_FLIGHT, commit_rows=3, commit_seconds=0.2)
    waiting_prompts = len(NO_WORKER_PROMPTS) - IN_FLIGHT * len(gateway.workers)
    try:
        outcome = run_with_no_worker_available(gateway, tmp_path / "data", settings)
        wait_for(
            f"smg refuses more requests than the {waiting_prompts} waiting prompts have attempts",
            lambda: no_worker_answers() - outcome["no_worker_before"] > 2 * waiting_prompts * settings.max_attempts,
            timeout_s=60,
        )
        refused = no_worker_answers() - outcome["no_worker_before"]
    finally:
        workers_back(gateway)
    outcome["thread"].join(timeout=120)
    assert "error" not in outcome, outcome.get("error")
    run = outcome["run"]
    assert (run.completed, run.failed, run.rejected_server) == (len(NO_WORKER_PROMPTS), 0, 0), refused
    done = rows(tmp_path / "data", columns="prompt_id, attempt")
    assert done == [(p, 1) for p in sorted(NO_WORKER_PROMPTS)]


def test_a_gateway_with_no_worker_for_no_server_timeout_s_stops_the_run_and_keeps_what_was_committed(gateway, tmp_path):
    """The wait is bounded as for a fleet with no healthy server: after no_server_timeout_s with no worker the run
    stops with FleetDown, naming the gateway and smg's words; the rows already answered are committed."""
    settings = DispatchSettings(
        max_in_flight_per_server=IN_FLIGHT, commit_rows=3, commit_seconds=0.2, no_server_timeout_s=3.0
    )
    try:
        outcome = run_with_no_worker_available(gateway, tmp_path / "data", settings)
        outcome["thread"].join(timeout=120)
    finally:
        workers_back(gateway)
    assert "run" not in outcome and isinstance(outcome["error"], FleetDown), outcome
    said = rf"no worker available behind {re.escape(gateway.url)} for \d+s \(All workers are unavailable \(circuit breaker open or unhealthy\)\)"
    assert re.fullmatch(said, str(outcome["error"])), outcome["error"]
    assert no_worker_answers() - outcome["no_worker_before"] >= len(NO_WORKER_PROMPTS) - IN_FLIGHT * 3
    assert len(rows(tmp_path / "data", columns="prompt_id")) == IN_FLIGHT * len(gateway.workers)


SHARD = "00000"
PROMPTS = 120  # one preflight reject stays under the context_overflow check's 1%
LONG = "p0007"  # too long for the context with the cap: rejected in preflight, never sent
CAP = 1024


def gateway_prompts():
    for i in range(PROMPTS):
        text = "word " * 1200 if f"p{i:04d}" == LONG else f"Gateway question {i}: explain topic {i * 7 % 11}."
        yield {"id": f"p{i:04d}", "prompt": text}


def test_a_server_killed_behind_the_gateway_loses_nothing_and_generates_nothing_twice(gateway, tmp_path):
    victim, live = gateway.workers[VICTIM], [w for i, w in enumerate(gateway.workers) if i != VICTIM]
    before = {w.url: get(f"{w.url}/_emulator/faults")["requests_seen"] for w in live}
    write_prompts(tmp_path / "prompts.jsonl", gateway_prompts())
    home = make_home(tmp_path / "dagster_home")
    env = dflash_env(
        home,
        data_dir=tmp_path / "data",
        prompts=tmp_path / "prompts.jsonl",
        shard_size=PROMPTS,
        fleet_mode="attach",
        fleet_urls=gateway.url,
    )
    held_before = get(f"{victim.url}/_emulator/faults")["injected"]["hold"]  # the counter is the server's lifetime's
    post(f"{victim.url}/_emulator/faults", {"hold": True})  # what the gateway routes to the victim stays in flight

    outcome: dict = {}
    run = threading.Thread(
        target=lambda: outcome.update(materialize_shards(env, {SHARD: CAP}, LOGS / "dagster-run.log")), daemon=True
    )
    run.start()

    def held_now() -> int:
        return get(f"{victim.url}/_emulator/faults")["injected"]["hold"] - held_before

    held = wait_for("requests held on the victim", lambda: held_now() >= 3 and held_now(), timeout_s=180)
    os.kill(victim.pid, signal.SIGKILL)  # a GPU node lost with generations in flight (at least `held` of them)
    run.join(timeout=240)
    assert not run.is_alive() and outcome[SHARD]["success"], outcome

    rows = duckdb.sql(
        f"select prompt_id, attempt, server_url from read_parquet('{tmp_path}/data/completions/**/*.parquet')"
    ).fetchall()
    rejects = duckdb.sql(
        f"select prompt_id, stage, reason from read_parquet('{tmp_path}/data/rejects/**/*.parquet',"
        f" hive_partitioning = false)"
    ).fetchall()
    failures = [
        dict(zip(("prompt_id", "attempts", "error"), r))
        for f in (tmp_path / "data").glob("failures/**/*.parquet")
        for r in duckdb.sql(f"select prompt_id, attempts, error from '{f}'").fetchall()
    ]
    ids = [r[0] for r in rows]
    served = {w.url: get(f"{w.url}/_emulator/faults")["requests_seen"] - before[w.url] for w in live}
    retried = sum(1 for r in rows if r[1] > 1)
    save(
        "killed_server.json",
        {
            "prompts": PROMPTS,
            "rows": len(rows),
            "preflight_rejects": len(rejects),
            "held_on_the_killed_server": held,
            "rows_retried_by_the_client": retried,
            "failures": failures,
            "generation_requests_served_by_live_servers": served,
            # where every row is, should an assertion below fail: each Parquet file under the data dir, its rows
            "files": {
                str(f.relative_to(tmp_path / "data")): duckdb.sql(f"select count(*) from '{f}'").fetchall()[0][0]
                for f in sorted((tmp_path / "data").rglob("*.parquet"))
            },
            "checks": outcome[SHARD].get("checks"),
        },
    )
    shutil.rmtree(OUT / "killed_server_data", ignore_errors=True)  # kept for a failure's post-mortem: 120 rows
    shutil.copytree(tmp_path / "data", OUT / "killed_server_data")
    # nothing lost: every prompt is one row or one preflight reject, nothing failed
    assert failures == []
    assert [(r[0], r[1]) for r in rejects] == [(LONG, "preflight")] and f"context length {CONTEXT}" in rejects[0][2]
    assert len(ids) == len(set(ids)) == PROMPTS - 1
    assert {r[2] for r in rows} == {gateway.url}
    # the lost requests were retried by the client, not inside the gateway (which would have answered them at
    # attempt 1 from a live server)
    assert retried >= held > 0
    # nothing generated twice: the live servers served exactly one generation request per row
    assert sum(served.values()) == len(rows), served


def save(name: str, payload: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(json.dumps(payload, indent=2, default=str) + "\n")
