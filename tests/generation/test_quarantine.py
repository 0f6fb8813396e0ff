"""A prompt that kills its server (the emulator's crash_on fault: the process exits hard, as on a CUDA fault) costs
at most two servers: in flight at two server deaths, it is quarantined, recorded in the failures table with its
reason, and a later run does not send it unless asked (retry_quarantined)."""

import threading
import time

import duckdb
import pytest

from dflash_assets.generation.quarantine import QUARANTINED
from dflash_assets.generation.turns import TurnItem, Turns
from dflash_assets.settings import DispatchSettings
from tests.support.forks import start_emulator
from tests.support.http import Http, requests_served
from tests.support.shards import generate, make_shard, rows

pytestmark = pytest.mark.timeout(240)

FLAGS = ["--reasoning-parser", "qwen3", "--length-median", "120", "--length-sigma", "0.4"]
FLAGS += ["--decode-tokens-per-s", "1500", "--max-running-requests", "3"]
MARKER = "POISON-3b7e"
N = 30
PROMPTS = {f"p{i:02d}": f"question {i}" + (f" {MARKER}" if i == 7 else "") for i in range(N)}
SETTINGS = DispatchSettings(
    max_attempts=6, backoff_base_s=0.02, backoff_max_s=0.2, eject_after=2, commit_rows=4, commit_seconds=0.2
)


def failures(data_dir) -> list[tuple]:
    if not list(data_dir.glob("failures/**/*.parquet")):
        return []
    return duckdb.sql(
        f"select prompt_id, error from read_parquet('{data_dir}/failures/**/*.parquet') order by prompt_id"
    ).fetchall()


def test_a_prompt_that_kills_its_server_costs_two_servers_and_is_quarantined_and_not_sent_again(tmp_path):
    data = tmp_path / "data"
    with (
        start_emulator([*FLAGS, "--fault-crash-on", MARKER]) as a,
        start_emulator([*FLAGS, "--fault-crash-on", MARKER]) as b,
        start_emulator([*FLAGS, "--fault-crash-on", MARKER]) as c,
    ):
        fleet = [a, b, c]
        make_shard(data, [a.url], PROMPTS)
        logs: list[str] = []
        run = generate(data, [e.url for e in fleet], 256, SETTINGS, log=logs.append)
        dead = [e for e in fleet if e.popen.poll() is not None]
        assert len(dead) == 2, "the poisoned prompt killed the server it was sent to, then one more, and no other"
        assert (run.completed, run.failed) == (N - 1, 1), (failures(data), logs)
        assert sorted(r[0] for r in rows(data, columns="prompt_id")) == sorted(set(PROMPTS) - {"p07"})
        [(prompt_id, error)] = failures(data)
        assert prompt_id == "p07" and error.startswith(QUARANTINED)
        assert any("quarantined" in note for note in run.notes)

        alive = [e for e in fleet if e.popen.poll() is None]
        again = generate(data, [e.url for e in alive], 256, SETTINGS)  # the marker would kill this one too
        assert all(e.popen.poll() is None for e in alive), "a later run did not send the quarantined prompt"
        assert (again.completed, again.failed, again.already_done) == (N - 1, 1, N - 1)
        assert failures(data) == [(prompt_id, error)], "the quarantine outlives the run that made it"

    with start_emulator(FLAGS) as fixed:  # a server that no longer dies on it: asked to, the run sends it again
        retried = generate(data, [fixed.url], 256, SETTINGS.model_copy(update={"retry_quarantined": True}))
        assert (retried.completed, retried.failed) == (N, 0)
        assert sorted(r[0] for r in rows(data, columns="prompt_id")) == sorted(PROMPTS)


def item(prompt_id: str) -> TurnItem:
    """A conversation's only turn."""
    alone = Turns([], [[{"role": "user", "content": prompt_id}]], numbered=False)
    return TurnItem(
        prompt_id=prompt_id,
        shard="s",
        line=None,
        turn=1,
        turns=1,
        prompt_tokens=None,
        source=None,
        conversation=alone,
        answers=[],
    )


def test_an_answer_sent_before_a_death_does_not_make_the_dead_server_new_again(emulator):
    """A request sent before its server died can still be answered after the death was seen (its answer was on the
    wire). That says nothing of the server being back: a later drop there (a pooled connection to the dead server)
    is no new death, so a suspect retried onto it is not charged a second death it was not in flight at."""
    import asyncio

    from dflash_assets.fleet.client import ServerClient, ServerError
    from dflash_assets.fleet.fleet import open_session
    from dflash_assets.generation.quarantine import Quarantine, Quarantined
    from dflash_assets.generation.slots import Slot

    server = emulator(*FLAGS)
    url = server.emu.url

    async def scenario() -> list:
        async with open_session() as session:
            client = ServerClient(session, url)
            slot = Slot(client, await client.info(), limit=4)
            server.emu.stop()  # the server dies: /health is refused from now on
            answered = asyncio.Event()

            async def send(sent: TurnItem, _slot: Slot, _attempt: int):
                if sent.prompt_id == "early":  # sent before the death, its answer arrives after it
                    await answered.wait()
                    return "row"
                raise ServerError(url, "POST /v1/chat/completions failed: ServerDisconnectedError")

            log: list[str] = []
            quarantine = Quarantine(log.append)
            guarded = quarantine.guard(send)
            early = asyncio.create_task(guarded(item("early"), slot, 1))
            await asyncio.sleep(0)  # `early` is in flight
            suspect = item("x")
            outcomes = []
            for attempt in (1, 2):  # dropped at the death; then again on the dead server
                try:
                    await guarded(suspect, slot, attempt)
                except (ServerError, Quarantined) as e:
                    outcomes.append(type(e).__name__)
                if attempt == 1:
                    answered.set()
                    outcomes.append(await early)
            await quarantine.close()
            return [*outcomes, len(quarantine.deaths[("s", "x", 1)]), sum("died" in line for line in log)]

    assert asyncio.run(scenario()) == ["ServerError", "row", "ServerError", 1, 1]


def test_a_server_the_slot_picker_takes_back_is_back_for_the_quarantine_too(monkeypatch):
    """A dead server relaunched at its port is back as soon as a probe sees it answer /health, the slot picker's (which
    re-admits it) or the quarantine's own. When the picker's comes first and the poisoned prompt, sent at once, kills
    the server again, that is its second death and it is quarantined; taken for the first death's drop, it would cost
    no death and the prompt would kill every relaunch until its attempts ran out."""
    import asyncio

    from dflash_assets.fleet.client import ServerError
    from dflash_assets.fleet.fleet import connected
    from dflash_assets.generation import quarantine as module
    from dflash_assets.generation.quarantine import Quarantine, Quarantined
    from dflash_assets.generation.slots import SlotPicker

    monkeypatch.setattr(module, "BACK_PROBE_S", 600.0)  # the quarantine's own look comes too late: the picker's first
    server = start_emulator(FLAGS)

    async def send(_item, slot, _attempt):  # the poisoned prompt: its server dies under it
        await asyncio.to_thread(server.stop)
        raise ServerError(slot.url, "POST /v1/chat/completions failed: ServerDisconnectedError")

    async def scenario() -> list[str]:
        nonlocal server
        async with connected([server.url]) as fleet:
            quarantine = Quarantine(lambda line: None)
            ejecting = DispatchSettings(eject_after=1)  # as the dispatcher wires them:
            picker = SlotPicker(fleet.clients, fleet.infos, ejecting, probe_interval_s=0.05, on_back=quarantine.back)
            guarded, outcomes = quarantine.guard(send), []
            for attempt in (1, 2):
                slot = await picker.acquire()
                try:
                    await guarded(item("x"), slot, attempt)
                except (ServerError, Quarantined) as e:
                    outcomes.append(type(e).__name__)
                picker.release(slot, ok=False)  # ejected: probed every 0.05 s until it answers
                if attempt == 1:  # a supervisor relaunches it at its port
                    server = await asyncio.to_thread(start_emulator, FLAGS, port=server.port)
            await picker.close()
            await quarantine.close()
            return outcomes

    try:
        assert asyncio.run(scenario()) == ["ServerError", "Quarantined"]
    finally:
        server.stop()


class Relauncher(threading.Thread):
    """A supervisor (systemd, a restart loop, Kubernetes): each server of `fleet` that dies is started again at its
    port, with the same flags (so the poisoned prompt kills it again)."""

    def __init__(self, fleet: list, flags: list[str]):
        super().__init__(daemon=True)
        self.fleet, self.flags, self.deaths, self.done = fleet, flags, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            for i, server in enumerate(self.fleet):
                if not server.alive():
                    self.deaths += 1
                    self.fleet[i] = start_emulator(self.flags, port=server.port)

    def settled(self, deaths: int) -> int:
        """Its deaths, once it has counted `deaths` and every server is up (a death the run saw last, relaunched
        after the run ended)."""
        for _ in range(600):
            if self.deaths >= deaths and all(e.alive() for e in self.fleet):
                break
            time.sleep(0.05)
        return self.deaths


def death_lines(logs: list[str]) -> int:
    return sum("died with requests in flight" in line for line in logs)


def waiting_lines(logs: list[str]) -> int:
    return sum(line.startswith("no healthy server") and "the run waits" in line for line in logs)


def seen(fleet) -> int:
    return sum(requests_served(Http(e.url)) for e in fleet)


@pytest.mark.parametrize("servers", [1, 2])
def test_on_a_fleet_of_one_or_two_relaunched_at_its_ports_the_poisoned_prompt_is_quarantined_in_the_first_run(
    tmp_path, servers
):
    """Every server down is no reason to stop: the run waits (up to no_server_timeout_s) and takes a server back the
    moment it answers /health again. With a supervisor relaunching each dead server at its port, the suspects go one
    at a time on the relaunched server, the second death quarantines the poisoned prompt and the rest is committed,
    all in the first run; a rerun sends nothing and kills nothing."""
    data, flags = tmp_path / "data", [*FLAGS, "--fault-crash-on", MARKER]
    fleet = [start_emulator(flags) for _ in range(servers)]
    relauncher = Relauncher(fleet, flags)
    relauncher.start()
    patient = SETTINGS.model_copy(update={"no_server_timeout_s": 600.0})  # the run ends only if a server comes back
    try:
        make_shard(data, [fleet[0].url], PROMPTS)
        logs: list[str] = []
        run = generate(data, [e.url for e in fleet], 256, patient, log=logs.append)
        assert (run.completed, run.failed) == (N - 1, 1), logs
        assert death_lines(logs) == 2 and relauncher.settled(2) == 2, logs
        [(prompt_id, error)] = failures(data)
        assert prompt_id == "p07" and error.startswith(QUARANTINED)
        assert sorted(r[0] for r in rows(data, columns="prompt_id")) == sorted(set(PROMPTS) - {"p07"}), "each once"
        assert waiting_lines(logs) <= 2, ("a line when the fleet goes down, not a line a second", logs)

        before = seen(fleet)
        again = generate(data, [e.url for e in fleet], 256, patient)
        assert (again.completed, again.failed, again.already_done) == (N - 1, 1, N - 1)
        assert (seen(fleet), relauncher.deaths) == (before, 2), "the rerun sent nothing and killed nothing"
    finally:
        relauncher.done.set()
        relauncher.join()
        for e in fleet:
            e.stop()


SHORT_WAIT = SETTINGS.model_copy(update={"no_server_timeout_s": 2.0})


def suspects(data_dir) -> list[tuple]:
    """(prompt_id, deaths) of the suspects table."""
    return duckdb.sql(
        f"select prompt_id, attempts from read_parquet('{data_dir}/suspects/**/*.parquet') order by prompt_id"
    ).fetchall()


def test_on_a_fleet_of_one_that_nothing_relaunches_suspects_behind_the_poisoned_prompt_need_a_second_rerun(tmp_path):
    """The worst case with nothing to relaunch the only server: a death with five prompts in flight, the poisoned one
    the third of them (the server's own fault, not the prompt's: the test kills it while p05..p09 are held). The run waits
    no_server_timeout_s, saying so once, and stops "fleet down" with the five suspects written. Relaunched by hand,
    the first rerun sends the rest, then the suspects one at a time: p05, p06, then p07, whose second death
    quarantines it (written at once); the run stops "fleet down" again, p08 and p09 still suspects. Relaunched, the
    second rerun finishes: two reruns, two deaths in all."""
    from dflash_assets.generation.slots import FleetDown

    data, flags = tmp_path / "data", [*FLAGS, "--fault-crash-on", MARKER]
    server = start_emulator([*FLAGS, "--fault-hold-after", "5"])  # p00..p04 answered, then p05..p09 held in flight

    def kill_once_held() -> None:
        for _ in range(600):
            if requests_served(Http(server.url)) == 10:
                server.popen.kill()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_once_held, daemon=True)
    try:
        make_shard(data, [server.url], PROMPTS)
        killer.start()
        logs: list[str] = []
        with pytest.raises(FleetDown, match=r"no healthy server for \d+s \(of 1: "):
            generate(data, [server.url], 256, SHORT_WAIT, log=logs.append)
        assert (death_lines(logs), waiting_lines(logs)) == (1, 1), ("one line, not a line a second", logs)
        assert sorted(r[0] for r in rows(data, columns="prompt_id")) == [f"p{i:02d}" for i in range(5)]
        assert (suspects(data), failures(data)) == ([(f"p{i:02d}", 1) for i in range(5, 10)], [])

        outcomes = []
        for _ in range(3):  # the user relaunches the server at its port, and reruns, until the run finishes
            server = start_emulator(flags, port=server.port)
            try:
                run = generate(data, [server.url], 256, SHORT_WAIT, log=logs.append)
                outcomes.append((run.completed, run.failed))
                break
            except FleetDown:
                outcomes.append("fleet down")
                [(prompt_id, error)] = failures(data)  # the quarantine outlives the run that decided it
                assert prompt_id == "p07" and error.startswith(QUARANTINED)
                assert [s for s in suspects(data) if s[1] < 2] == [("p05", 1), ("p06", 1), ("p08", 1), ("p09", 1)]
        assert (outcomes, death_lines(logs)) == (["fleet down", (N - 1, 1)], 2), logs
        assert sorted(r[0] for r in rows(data, columns="prompt_id")) == sorted(set(PROMPTS) - {"p07"}), "each once"
    finally:
        killer.join()
        server.stop()


def test_a_stop_while_the_run_waits_for_a_server_ends_the_run_and_one_rerun_on_the_relaunched_server_finishes(tmp_path):
    """SIGTERM (or Ctrl-C) while every server is down and the run waits for one stops the run, as a polite stop does
    anywhere else (without it, this run would wait 600 s for a server that nothing relaunches), the answers and the
    suspect kept. One request in flight at a time, the poisoned prompt is the only suspect and is sent last: one
    rerun on the relaunched server quarantines it and finishes."""
    import signal

    from dflash_assets.generation.stopping import STOP, Stopped

    data, flags = tmp_path / "data", [*FLAGS, "--fault-crash-on", MARKER]
    one_at_a_time = SETTINGS.model_copy(update={"max_in_flight_per_server": 1, "no_server_timeout_s": 600.0})
    server = start_emulator(flags)
    logs: list[str] = []

    def log(line: str) -> None:
        logs.append(line)
        if waiting_lines([line]):
            STOP.request(signal.SIGTERM)  # what the handler of `stopping()` does on the signal

    try:
        make_shard(data, [server.url], PROMPTS)
        with pytest.raises(Stopped, match="stopped by SIGTERM"):
            generate(data, [server.url], 256, one_at_a_time, log=log)
        STOP.signum = None
        assert (death_lines(logs), waiting_lines(logs)) == (1, 1), logs
        assert sorted(r[0] for r in rows(data, columns="prompt_id")) == [f"p{i:02d}" for i in range(7)]
        assert (suspects(data), failures(data)) == ([("p07", 1)], [])

        server = start_emulator(flags, port=server.port)  # the user relaunches it, and reruns once
        rerun = generate(data, [server.url], 256, one_at_a_time, log=logs.append)
        assert (rerun.completed, rerun.failed, death_lines(logs)) == (N - 1, 1, 2), logs
        [(prompt_id, error)] = failures(data)
        assert prompt_id == "p07" and error.startswith(QUARANTINED)
        assert sorted(r[0] for r in rows(data, columns="prompt_id")) == sorted(set(PROMPTS) - {"p07"}), "each once"
    finally:
        STOP.signum = None
        server.stop()
