"""A prompt that kills its server (the emulator's crash_on fault: the process exits hard, as on a CUDA fault) costs
at most two servers: in flight at two server deaths, it is quarantined, recorded in the failures table with its
reason, and a later run does not send it unless asked (retry_quarantined)."""

import duckdb
import pytest

from dflash_assets.generation.quarantine import QUARANTINED
from dflash_assets.settings import DispatchSettings
from tests.support.forks import start_emulator
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


def test_an_answer_sent_before_a_death_does_not_make_the_dead_server_new_again(emulator):
    """A request sent before its server died can still be answered after the death was seen (its answer was on the
    wire). That says nothing of the server being back: a later drop there (a pooled connection to the dead server)
    is no new death, so a suspect retried onto it is not charged a second death it was not in flight at."""
    import asyncio

    from dflash_assets.fleet.client import ServerClient, ServerError
    from dflash_assets.fleet.fleet import open_session
    from dflash_assets.generation.quarantine import Quarantine, Quarantined
    from dflash_assets.generation.slots import Slot
    from dflash_assets.generation.turns import TurnItem, Turns

    def item(prompt_id: str) -> TurnItem:  # a conversation's only turn
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


@pytest.mark.parametrize("servers", [1, 2])
def test_on_a_fleet_of_one_or_two_the_poisoned_prompt_is_quarantined_after_two_deaths_and_the_rest_committed(
    tmp_path, servers
):
    """On a small fleet the second death may come only once the dead servers are back: the quarantine is written the
    moment it is decided (the run then stops for lack of servers), the suspects and their deaths are written as each
    death is seen, so the deaths add up across runs; each rerun on the relaunched servers (the same ports) finishes
    what it can, and no server dies a third time."""
    from dflash_assets.generation.slots import FleetDown

    data, flags = tmp_path / "data", [*FLAGS, "--fault-crash-on", MARKER]
    short = SETTINGS.model_copy(update={"no_server_timeout_s": 3.0})
    fleet = [start_emulator(flags) for _ in range(servers)]
    try:
        make_shard(data, [fleet[0].url], PROMPTS)
        deaths, outcomes, logs = 0, [], []
        for _ in range(servers % 2 + 2):  # a fleet of one: two reruns at most; of two: one
            try:
                run = generate(data, [e.url for e in fleet], 256, short, log=logs.append)
                outcomes.append((run.completed, run.failed))
            except FleetDown:
                outcomes.append("fleet down")
                assert failures(data) == [] or failures(data)[0][0] == "p07", ("only the poisoned prompt failed", logs)
            dead = [i for i, e in enumerate(fleet) if not e.alive()]
            deaths += len(dead)
            for i in dead:  # relaunched where it was
                fleet[i] = start_emulator(flags, port=fleet[i].port)
            if outcomes[-1] != "fleet down":
                break
        assert deaths == 2, outcomes
        assert outcomes[-1] == (N - 1, 1), outcomes
        [(prompt_id, error)] = failures(data)
        assert prompt_id == "p07" and error.startswith(QUARANTINED)
        assert sorted(r[0] for r in rows(data, columns="prompt_id")) == sorted(set(PROMPTS) - {"p07"}), "each once"
        again = generate(data, [e.url for e in fleet], 256, short)
        assert all(e.alive() for e in fleet) and (again.completed, again.failed) == (N - 1, 1)
    finally:
        for e in fleet:
            e.stop()
