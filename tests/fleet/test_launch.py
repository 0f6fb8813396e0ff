"""`launch` mode end to end, with the emulator standing in for `sglang serve` (same flags, same routes).

Servers outlive runs: a second `up` reuses them, a dead one is relaunched, changed args are replaced only
when asked, `down` stops them. The API key never reaches the registry, the logs or the status.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import threading
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from dflash_assets.fleet import processes, registry
from dflash_assets.fleet.attach import AttachError, parse_urls
from dflash_assets.fleet.launcher import FleetError, FleetSpec, down, up
from dflash_assets.fleet.server_args import EMULATOR, ServerCommand
from dflash_assets.fleet.status import fleet_status, status_table
from dflash_assets.fleet.supervise import launched
from tests.support.cli import free_base_port, loading_after
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(90)

KEY = "sk-test-0123456789abcdef"


def make_spec(base_port: int, gpus=(0, 1), **server) -> FleetSpec:
    args = ServerCommand(**{"model_path": "Qwen/Qwen3-8B", "context_length": 8192, "max_running_requests": 8} | server)
    return FleetSpec(
        server=args, gpus=tuple(gpus), base_port=base_port, command=EMULATOR, health_timeout_s=45, stop_timeout_s=5
    )


@pytest.fixture
def fleet_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_API_KEY", raising=False)
    path = tmp_path / "dagster_home" / "fleet"
    try:
        yield path
    finally:  # whatever the test did, no server outlives it
        records = registry.load(path) if registry.registry_path(path).exists() else {}
        try:
            down(path, timeout_s=5)
        finally:
            for rec in records.values():
                if processes.is_ours(rec.pid, rec.proc_start):
                    os.killpg(rec.pid, signal.SIGKILL)


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def wait_gone(pid: int, proc_start: int | None, timeout_s: float = 10) -> bool:
    return wait_for(f"pid {pid} to be gone", lambda: not processes.is_ours(pid, proc_start), timeout_s, every_s=0.05)


def test_up_starts_one_server_per_gpu_and_a_second_up_reuses_them(fleet_dir):
    spec = make_spec(free_base_port())
    first = up(spec, fleet_dir)
    assert [r.name for r in first] == ["gpu0", "gpu1"]
    assert [r.port for r in first] == [spec.base_port, spec.base_port + 1]
    for rec, gpu in zip(first, ("0", "1")):
        assert environ_of(rec.pid)["CUDA_VISIBLE_DEVICES"] == gpu
        assert os.getpgid(rec.pid) == rec.pid and os.getsid(rec.pid) == rec.pid  # own session: outlives us
    saved = json.loads(registry.registry_path(fleet_dir).read_text())
    assert saved["version"] == registry.REGISTRY_VERSION == 3 and set(saved["servers"]) == {"gpu0", "gpu1"}
    gpu1 = saved["servers"]["gpu1"]
    assert gpu1["pid"] == first[1].pid and gpu1["gpus"] == [1] and gpu1["host"] == "127.0.0.1"
    assert gpu1["args"]["context_length"] == 8192 and len(gpu1["args_hash"]) == 64
    assert Path(gpu1["log"]).parent == fleet_dir / "logs" and gpu1["started_at"]

    events: list[str] = []
    second = up(spec, fleet_dir, on_event=events.append)
    assert [r.pid for r in second] == [r.pid for r in first]
    assert all("reused" in e for e in events), events


def test_a_killed_server_is_relaunched_and_the_other_reused(fleet_dir):
    spec = make_spec(free_base_port())
    first = up(spec, fleet_dir)
    os.kill(first[0].pid, signal.SIGKILL)
    assert wait_gone(first[0].pid, first[0].proc_start)
    events: list[str] = []
    second = up(spec, fleet_dir, on_event=events.append)
    assert second[0].pid != first[0].pid and second[1].pid == first[1].pid
    assert events[0].startswith("gpu0: relaunched") and events[1].startswith("gpu1: reused")
    assert environ_of(second[0].pid)["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_run_keeps_its_launched_fleet_up_and_a_stop_during_a_relaunch_ends_at_once(fleet_dir):
    """While a run lasts (`launched`), a server whose process ended is relaunched through `up` at its port. The run
    ending while a relaunched server still loads (its health timeout 600 s, past this module's 90 s bound) ends the
    wait at once: the block returns, the supervisor with it, and the loading server is left in the registry, where
    `fleet down` stops it."""
    loading = loading_after(2, fleet_dir.parent / "starts")  # the second relaunch never answers /health
    spec = dataclasses.replace(make_spec(free_base_port(1), gpus=(0,)), command=loading, health_timeout_s=600)
    heard: list[str] = []
    relaunched = lambda: sum(m.startswith("gpu0: relaunched (it was not running)") for m in heard)  # noqa: E731
    with launched(spec, fleet_dir, heard.append) as [first]:
        os.kill(first.pid, signal.SIGKILL)
        wait_for("the relaunch", lambda: "gpu0: its process ended; relaunched at its port" in heard, 30)
        second = registry.load(fleet_dir)["gpu0"]
        assert second.pid != first.pid and fleet_status(fleet_dir)[0].healthy
        os.kill(second.pid, signal.SIGKILL)
        wait_for("the relaunch to wait for /health", lambda: relaunched() == 2 and heard[-1].startswith("waiting"), 30)
    assert not any(t.name == "fleet-supervisor" for t in threading.enumerate()), "nothing relaunches after the run"
    third = registry.load(fleet_dir)["gpu0"]
    assert third.pid not in (first.pid, second.pid) and processes.is_ours(third.pid, third.proc_start)
    assert relaunched() == 2 and heard[-1].startswith("waiting"), "nothing said once the run ended"


def test_changed_args_are_refused_without_replace_and_replaced_with_it(fleet_dir):
    base = free_base_port(1)
    first = up(make_spec(base, gpus=(0,)), fleet_dir)
    changed = make_spec(base, gpus=(0,), context_length=16384)
    with pytest.raises(FleetError) as refused:
        up(changed, fleet_dir)
    message = str(refused.value)
    assert "server gpu0" in message and "context_length: 8192 -> 16384" in message and "--replace" in message
    assert processes.is_ours(first[0].pid, first[0].proc_start), "a refused up must not touch the server"

    replaced = up(changed, fleet_dir, replace=True)
    assert replaced[0].pid != first[0].pid and wait_gone(first[0].pid, first[0].proc_start)
    assert fleet_status(fleet_dir)[0].context_length == 16384


def test_down_stops_every_process_and_empties_the_registry(fleet_dir):
    records = up(make_spec(free_base_port()), fleet_dir)
    stopped = down(fleet_dir, timeout_s=5)
    assert sorted(r.name for r in stopped) == ["gpu0", "gpu1"]
    for rec in records:
        assert not processes.is_ours(rec.pid, rec.proc_start) and not processes.group_alive(rec.pid)
    assert registry.load(fleet_dir) == {}


def test_a_port_held_by_another_process_is_refused_before_any_launch(fleet_dir):
    base = free_base_port()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base + 1))
        squatter.listen()
        with pytest.raises(
            FleetError,
            match=rf"port {base + 1} on 127.0.0.1 is already in use by a process that "
            r"is not in the fleet registry",
        ):
            up(make_spec(base), fleet_dir)
    assert registry.load(fleet_dir) == {}  # gpu0's port was free, but nothing was launched


def test_down_stops_the_whole_process_group(fleet_dir):
    """sglang's scheduler and detokenizer are children of the server: they hold the GPU until they go."""
    log = fleet_dir / "logs" / "gpu0.log"
    leader = processes.spawn(["sh", "-c", "sleep 60 & sleep 60 & wait"], dict(os.environ), log)
    start = processes.start_time(leader.pid)
    registry.save(
        fleet_dir,
        {
            "gpu0": registry.ServerRecord(
                name="gpu0",
                pid=leader.pid,
                proc_start=start,
                host="127.0.0.1",
                port=1,
                gpus=[0],
                args_hash="x",
                args={},
                command=["sh"],
                api_key_env=None,
                started_at="2020-01-01T00:00:00+00:00",
                log=str(log),
            )
        },
    )
    group = lambda: [p for p in Path("/proc").iterdir() if p.name.isdigit() and _pgrp(p) == leader.pid]  # noqa: E731
    wait_for("the children to start", lambda: len(group()) >= 3, 5, every_s=0.05)
    down(fleet_dir, timeout_s=5)
    assert not processes.group_alive(leader.pid)


def _pgrp(proc_dir: Path) -> int | None:
    try:
        raw = (proc_dir / "stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2 :].split()[2])


def test_a_reused_pid_is_not_mistaken_for_our_server(fleet_dir):
    """The registry names a pid that is alive but is another process (here: the test itself)."""
    spec = make_spec(free_base_port(1), gpus=(0,))
    args = spec.servers()["gpu0"]
    impostor = registry.ServerRecord(
        name="gpu0",
        pid=os.getpid(),
        proc_start=processes.start_time(os.getpid()) + 1,
        host=args.host,
        port=args.port,
        gpus=[0],
        args_hash="x",
        args=args.canonical(),
        command=[],
        api_key_env=None,
        started_at="2020-01-01T00:00:00+00:00",
        log=str(fleet_dir / "logs" / "gpu0.log"),
    )
    registry.save(fleet_dir, {"gpu0": impostor})
    records = up(spec, fleet_dir)  # must neither reuse nor signal our own pid
    assert records[0].pid != os.getpid()


def test_status_reports_what_the_servers_say(fleet_dir):
    spec = make_spec(free_base_port())
    records = up(spec, fleet_dir)
    statuses = fleet_status(fleet_dir, attach_urls=[records[1].url])
    assert [s.name for s in statuses] == ["gpu0", "gpu1", records[1].url]
    for s in statuses:
        assert s.healthy and s.error is None
        assert (s.context_length, s.max_running_requests, s.running, s.waiting) == (8192, 8, 0, 0)
        assert s.token_usage == 0
    assert (statuses[0].pid, statuses[0].gpus, statuses[0].process) == (records[0].pid, [0], "running")
    assert statuses[0].uptime_s is not None and statuses[0].uptime_s >= 0
    assert statuses[2].pid is None and statuses[2].process is None  # attached: not ours to describe

    os.kill(records[0].pid, signal.SIGKILL)
    assert wait_gone(records[0].pid, records[0].proc_start)
    dead = fleet_status(fleet_dir)[0]
    assert (dead.healthy, dead.process) == (False, "not running") and "relaunches" in dead.error
    console = Console(record=True, width=250)
    console.print(status_table(fleet_status(fleet_dir)))
    text = console.export_text()
    assert "gpu1" in text and "8,192" in text and "not running" in text


def test_the_api_key_never_reaches_registry_logs_or_status(fleet_dir, monkeypatch):
    monkeypatch.setenv("DFLASH_API_KEY", KEY)
    records = up(make_spec(free_base_port(), gpus=(0,), enable_metrics=True), fleet_dir)
    rec = records[0]
    assert KEY in Path(f"/proc/{rec.pid}/cmdline").read_bytes().decode()  # the documented trade-off
    assert "DFLASH_API_KEY" not in environ_of(rec.pid)
    statuses = fleet_status(fleet_dir)
    assert statuses[0].healthy and statuses[0].context_length == 8192  # the key was sent: the server requires it
    console = Console(record=True, width=250)
    console.print(status_table(statuses))
    up(make_spec(rec.port, gpus=(0,), enable_metrics=True), fleet_dir)  # reuse path also probes with the key

    monkeypatch.delenv("DFLASH_API_KEY")
    unauthorized = fleet_status(fleet_dir)[0]
    assert unauthorized.healthy and unauthorized.error == "Unauthorized"

    for what, text in (
        ("registry", registry.registry_path(fleet_dir).read_text()),
        ("log", Path(rec.log).read_text()),
        ("status", json.dumps([s.as_dict() for s in statuses]) + console.export_text()),
    ):
        assert KEY not in text, f"the API key leaked into the {what}"
    assert (
        json.loads(registry.registry_path(fleet_dir).read_text())["servers"]["gpu0"]["api_key_env"] == "DFLASH_API_KEY"
    )


def test_a_changed_api_key_is_refused_without_replace(fleet_dir, monkeypatch):
    monkeypatch.setenv("DFLASH_API_KEY", KEY)
    spec = make_spec(free_base_port(1), gpus=(0,))
    first = up(spec, fleet_dir)
    monkeypatch.setenv("DFLASH_API_KEY", "sk-rotated")
    with pytest.raises(FleetError, match=r"API key: the server rejects the key in \$DFLASH_API_KEY") as refused:
        up(spec, fleet_dir)
    assert KEY not in str(refused.value) and "sk-rotated" not in str(refused.value)
    assert up(spec, fleet_dir, replace=True)[0].pid != first[0].pid


def test_a_server_that_exits_early_fails_up_with_its_log_tail(fleet_dir):
    spec = make_spec(free_base_port(1), gpus=(0,), extra_args=("--startup-delay", "not-a-number"))
    with pytest.raises(
        FleetError,
        match=r"(?s)server gpu0 .* exited with code 2 before it was healthy.*"
        r"invalid float value",
    ):
        up(spec, fleet_dir)


def test_a_server_not_healthy_in_time_fails_up_and_is_left_running(fleet_dir):
    spec = make_spec(free_base_port(1), gpus=(0,), extra_args=("--startup-delay", "60"))
    spec = dataclasses.replace(spec, health_timeout_s=2)
    with pytest.raises(
        FleetError,
        match=r"server gpu0 .* is not healthy after 2s \(GET /health\); it is left "
        r"running",
    ):
        up(spec, fleet_dir)
    rec = registry.load(fleet_dir)["gpu0"]
    assert processes.is_ours(rec.pid, rec.proc_start)  # still loading: `down` (in the fixture) stops it


@pytest.mark.parametrize(
    "urls,message",
    [
        ("", "at least one server URL"),
        ("10.0.0.5:30000", "must look like http://host:port"),
        ("http://user:secret@10.0.0.5:30000", "carries credentials"),
        ("http://a:30000,http://a:30000/", "listed twice"),
        ("http://a:99999", "not a valid URL"),
    ],
)
def test_attach_urls_are_checked(urls, message):
    with pytest.raises(AttachError, match=message) as e:
        parse_urls(urls)
    assert "secret" not in str(e.value)


def test_attach_urls_are_normalised():
    assert parse_urls("http://a:30000/, https://router.internal:8080") == [
        "http://a:30000",
        "https://router.internal:8080",
    ]


def start_ticks(pid: int) -> int:
    """The process's start in clock ticks since boot, as the kernel keeps it: starttime, field 22 of proc(5)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[19])


@pytest.mark.parametrize("version", [1, 2])
def test_a_registry_of_an_earlier_version_keeps_its_warm_servers(fleet_dir, version):
    """Version 1 recorded the start time as /proc clock ticks, version 2 as psutil's create_time (seconds since the
    epoch); read back, the server either names is still ours, and a start a second off is not."""
    leader = processes.spawn(["sleep", "60"], dict(os.environ), fleet_dir / "logs" / "gpu0.log")
    try:
        recorded = start_ticks(leader.pid) if version == 1 else psutil.Process(leader.pid).create_time()
        record = dict(
            name="gpu0",
            pid=leader.pid,
            proc_start=recorded,
            host="127.0.0.1",
            port=1,
            gpus=[0],
            args_hash="x",
            args={},
            command=["sleep"],
            api_key_env=None,
            started_at="2020-01-01T00:00:00+00:00",
            log=str(fleet_dir / "logs" / "gpu0.log"),
        )
        registry.registry_path(fleet_dir).write_text(json.dumps({"version": version, "servers": {"gpu0": record}}))
        loaded = registry.load(fleet_dir)["gpu0"]
        assert processes.is_ours(loaded.pid, loaded.proc_start)
        assert not processes.is_ours(loaded.pid, loaded.proc_start + 1)
    finally:
        leader.kill()
        leader.wait()


def test_a_clock_step_leaves_every_server_ours(fleet_dir, monkeypatch):
    """/proc/stat's btime is the wall clock less the uptime: a clock step (NTP, a VM resumed from a snapshot) moves
    it, and with it psutil's create_time of every process at once. The start time that tells our servers and run
    workers from reused pids is the kernel's since boot: it does not move, so nothing live is judged dead."""
    leader = processes.spawn(["sleep", "60"], dict(os.environ), fleet_dir / "logs" / "gpu0.log")
    try:
        recorded = processes.start_time(leader.pid)
        assert recorded == start_ticks(leader.pid) / os.sysconf("SC_CLK_TCK")
        before = psutil.Process(leader.pid).create_time()
        stepped = psutil.boot_time() + 3600  # what /proc/stat says once the clock is stepped an hour on
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: stepped)
        assert psutil.Process(leader.pid).create_time() == before + 3600  # psutil's create_time moved
        assert processes.start_time(leader.pid) == recorded
        assert processes.is_ours(leader.pid, recorded)
        assert not processes.is_ours(leader.pid, recorded + 0.01)  # one tick off: another process
    finally:
        leader.kill()
        leader.wait()


def test_a_version_1_registry_reads_its_clock_ticks_as_seconds_since_boot(tmp_path):
    """Warm servers launched by a version-1 registry stay ours: its proc_start (clock ticks) becomes seconds."""
    fields = dict(host="127.0.0.1", port=1, gpus=[0], args_hash="h", args={}, command=[], api_key_env=None)
    fields |= dict(started_at="2026-01-01T00:00:00+00:00", log="x.log")
    servers = {"gpu0": fields | {"name": "gpu0", "pid": 7, "proc_start": 500.0}}
    servers["gpu1"] = fields | {"name": "gpu1", "pid": 8, "proc_start": None}
    registry.registry_path(tmp_path).write_text(json.dumps({"version": 1, "servers": servers}))
    loaded = registry.load(tmp_path)
    assert loaded["gpu0"].proc_start == 500.0 / os.sysconf("SC_CLK_TCK") and loaded["gpu1"].proc_start is None
    registry.registry_path(tmp_path).write_text(json.dumps({"version": 0, "servers": {}}))
    with pytest.raises(ValueError, match="registry version 0"):
        registry.load(tmp_path)
