"""A prompt that kills its server (a CUDA error on one shape, a tokenizer fault) is quarantined after two server
deaths, instead of being retried onto one server after another (docs/guarantees.md says it for users).

- A server *died* under a request when the request's connection dropped and the server then fails /health (one
  probe per death, shared by the requests in flight there). Every request in flight at a death is a *suspect*;
  suspects wait until nothing else is left to send, then go one at a time, alone on the fleet, so an innocent one is
  never beside the killer at its second death.
- At `QUARANTINE_AFTER_DEATHS` deaths a prompt is quarantined: a failures row starting with `QUARANTINED`, written
  the moment it is decided, carried over by later runs (`DispatchSettings.retry_quarantined` sends it again). The
  suspects and their deaths are written too (the `suspects` table), so deaths add up across runs.
- A server already down when a request was sent (a refused connection) is no death and costs no attempt. A dead
  server is down until it answers /health again (every BACK_PROBE_S, or seen by the slot picker); its next drop is a
  new death.
- Behind a gateway, which stays healthy when a worker dies (a 500, fleet/client.py UPSTREAM_LOST, or a cut stream),
  the probe asks each worker directly (fleet/gateway.py), those the run knows and those the gateway lists now; the
  one that now fails /health, and was not already down, is the death.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow.compute as pc

from dflash_assets.fleet.client import ServerClient, ServerError
from dflash_assets.fleet.gateway import GatewayClient, gateway_workers
from dflash_assets.generation.commit import ShardOutput
from dflash_assets.generation.slots import Slot
from dflash_assets.generation.turns import TurnItem
from dflash_assets.store.parts import PartStore
from dflash_assets.store.schema import CompletionRow, FailureRow
from dflash_assets.store.storage import Storage
from dflash_assets.store.stores import failure_store

QUARANTINE_AFTER_DEATHS = 2
BACK_PROBE_S = 0.5  # how often a dead server's /health is asked whether it is back
QUARANTINED = f"in flight when {QUARANTINE_AFTER_DEATHS} servers died"  # a failure row's error starts with it

Key = tuple[str, str, int | None]  # (shard, prompt_id, turn)
Send = Callable[[TurnItem, Slot, int], Awaitable[CompletionRow]]
Record = Callable[[str], Awaitable[None]]  # (shard): its suspects changed, write them


class Quarantined(Exception):
    """Raised by a guarded Send when its prompt has just been quarantined (the message is the failure's error)."""


def key_of(item: TurnItem) -> Key:
    return item.shard, item.prompt_id, item.turn


@dataclass
class Death:
    at: float  # monotonic time the death was seen (its /health probe began): requests sent before were in flight
    url: str
    keys: set[Key] = field(default_factory=set)


class Quarantine:
    """Counts, per item, the server deaths it was in flight at; `guard` wraps the dispatcher's Send."""

    def __init__(self, log: Callable[[str], None], record: Record | None = None):
        self.log, self.record = log, record
        self.deaths: dict[Key, list[Death]] = {}
        self._workers: dict[str, set[str]] = {}  # gateway url -> every worker url it has listed
        self._last: dict[str, Death] = {}  # url -> its latest death
        self._down: set[str] = set()  # urls dead and not seen answering since
        self._watching: dict[str, asyncio.Task] = {}  # url down -> its task that looks whether it is back
        self._probes: dict[str, tuple[asyncio.Task, float]] = {}  # url -> its probe running, and when it began
        self._alone = asyncio.Lock()
        self.parked = 0  # suspects waiting for their turn, or taking it

    def guard(self, send: Send) -> Send:
        async def guarded(item: TurnItem, slot: Slot, attempt: int) -> CompletionRow:
            key = key_of(item)
            if isinstance(slot.client, GatewayClient):  # a worker it drops from its list later is still probed
                self._workers.setdefault(slot.url, set()).update(w.url for w in slot.client.workers)
            if len(deaths := self.deaths.get(key, [])) >= QUARANTINE_AFTER_DEATHS:  # an earlier run's, unwritten
                raise Quarantined(f"{QUARANTINED} under it ({', '.join(d.url for d in deaths)})")  # (stopped first)
            sent = time.monotonic()
            try:
                row = await send(item, slot, attempt)
            except ServerError as e:
                if await self._died_under(key, slot, e, sent):
                    if self.record:
                        await self.record(key[0])
                    deaths = self.deaths[key]
                    if len(deaths) >= QUARANTINE_AFTER_DEATHS:
                        why = f"{QUARANTINED} under it ({', '.join(d.url for d in deaths)}); last error: {e}"
                        self.log(f"shard {key[0]} prompt {key[1]} quarantined: {why}")
                        raise Quarantined(why) from None
                elif e.kind == "refused" or (e.kind == "upstream_lost" and self._down):
                    e.down = True  # its server was down already: no fault of this request's
                raise
            last = self._last.get(slot.url)
            if last is None or last.at < sent:  # it answers a request sent after its death: back, a later drop
                self._down.discard(slot.url)  # there is a new death (an answer sent before says nothing of that)
            return row

        return guarded

    @asynccontextmanager
    async def turn(self, item: TurnItem, quiet: Callable[[], bool]) -> AsyncIterator[None]:
        """An attempt of `item`; a suspect's waits until nothing but suspects is left to send (`quiet`), then goes
        alone on the fleet: a death under it is its own, never an innocent's second."""
        if not self.deaths.get(key_of(item)):
            yield
            return
        self.parked += 1
        try:
            async with self._alone:
                while not quiet():
                    await asyncio.sleep(0.1)
                yield
        finally:
            self.parked -= 1

    def suspects(self, shard: str) -> list[tuple[Key, list[str]]]:
        """The shard's suspects and the servers that died under each (this run's deaths and the earlier runs')."""
        return [(k, [d.url for d in deaths]) for k, deaths in self.deaths.items() if k[0] == shard]

    def carry(self, key: Key, urls: list[str]) -> None:
        """A suspect of an earlier run: the deaths it was in flight at count here too."""
        self.deaths[key] = [Death(float("-inf"), url, {key}) for url in urls]

    async def _died_under(self, key: Key, slot: Slot, error: ServerError, sent: float) -> bool:
        """Whether `slot`'s server died while this request was in flight there (counted once per death)."""
        dropped = error.status is None or error.kind == "upstream_lost"  # a gateway says it lost its worker
        if not dropped or error.kind in ("stalled", "refused", "prompt", "unhealthy"):
            return False
        url = slot.url
        death = self._last.get(url)
        while death is None or death.at < sent:
            if url in self._down:
                return False  # it was already down when this request was sent
            probe = self._probes.get(url)
            if probe is None:
                probe = self._probes[url] = (asyncio.create_task(self._probe(slot)), time.monotonic())
            death = await asyncio.shield(probe[0])
            if probe[1] >= sent and (death is None or death.at < sent):
                return False  # a probe begun after it was sent found no new death
            # else a probe begun before it was sent (of another worker's death behind the gateway): probe again
        if key not in death.keys:
            death.keys.add(key)
            self.deaths.setdefault(key, []).append(death)
        return True

    async def _probe(self, slot: Slot) -> Death | None:
        at = time.monotonic()
        try:
            dead = await self._newly_dead(slot)
        finally:
            self._probes.pop(slot.url, None)
        if not dead:
            return None  # a dropped connection, but the server (every worker behind the gateway) answers
        url, problem, server = dead[0]
        death = self._last[slot.url] = Death(at, url)
        self._down.add(url)
        if url not in self._watching:
            self._watching[url] = asyncio.create_task(self._until_back(url, server))
        where = url if url == slot.url else f"{url} (behind the gateway {slot.url})"
        self.log(f"{where} died with requests in flight ({problem.message}): they are suspects, sent one at a time")
        return death

    def back(self, url: str, since: float) -> None:
        """`url` answered /health to a probe begun at `since` (the slot picker's, which re-admits it): after its death,
        it is back, whichever probe saw it first, and its next drop is a new death."""
        if (death := self._last.get(url)) is None or death.at < since:
            self._down.discard(url)

    async def _until_back(self, url: str, server: ServerClient) -> None:
        """A dead server is down until it answers /health again: relaunched (by a supervisor, at once maybe), a drop
        there is a new death, not its old one."""
        try:
            while url in self._down:
                await asyncio.sleep(BACK_PROBE_S)
                if not isinstance(await server.health_problem(), ServerError):
                    self._down.discard(url)
        finally:
            self._watching.pop(url, None)

    async def _newly_dead(self, slot: Slot) -> list[tuple[str, ServerError, ServerClient]]:
        """The server a request dropped on, if it now fails /health; behind a gateway, the workers that fail it now
        and were not already down (a worker that answers again is no longer down)."""
        client = slot.client
        if not isinstance(client, GatewayClient):
            problem = await client.health_problem()
            return [(slot.url, problem, client)] if isinstance(problem, ServerError) else []
        known = self._workers.setdefault(slot.url, set())
        with suppress(ServerError):  # the gateway's list now: a worker it took back after a death (healthy
            known.update(w.url for w in await gateway_workers(client) or [])  # again) can be unknown to the run yet
        workers = client.workers + [client.worker(u) for u in sorted(known - {w.url for w in client.workers})]
        problems = await asyncio.gather(*(w.health_problem() for w in workers))
        dead = []
        for worker, problem in zip(workers, problems):
            if not isinstance(problem, ServerError):
                self._down.discard(worker.url)
            elif worker.url not in self._down:
                dead.append((worker.url, problem, worker))
        return dead

    async def close(self) -> None:
        tasks = [task for task, _ in self._probes.values()] + list(self._watching.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Plan(Protocol):
    todo: dict[str, Any]


def carry_over(failures: PartStore, config_hash: str, plan: Plan, retry: bool) -> list[FailureRow]:
    """The failure rows of prompts quarantined by an earlier run of this config. Unless `retry`, their prompts are
    taken out of `plan.todo` (not sent) and the rows returned, to be written again with this run's failures."""
    if retry:
        return []
    rows = [r for r in rows_of(failures, config_hash) if (r.error or "").startswith(QUARANTINED)]
    for r in rows:
        plan.todo.pop(r.prompt_id, None)
    return rows


def rows_of(store: PartStore, config_hash: str | None) -> list[FailureRow]:
    """A failures (or suspects) table's rows of one config (None: of every config)."""
    table = store.read()
    if config_hash is not None:
        table = table.filter(pc.equal(table["config_hash"], config_hash))
    return [FailureRow(**r) for r in table.to_pylist()]


def suspect_rows(output: ShardOutput) -> list[FailureRow]:
    """The suspects earlier runs of the output's config wrote for its shard (`error`: the servers that died)."""
    return [] if output.suspects is None else rows_of(output.suspects, output.run.config_hash)


def quarantined(data_dir: str | Path | Storage, shards: list[str], config_hash: str | None) -> list[FailureRow]:
    """The quarantined prompts of `shards` (of one config, or of every config)."""
    rows = [r for shard in shards for r in rows_of(failure_store(data_dir, shard), config_hash)]
    return [r for r in rows if (r.error or "").startswith(QUARANTINED)]


def quarantine_note(shard: str, failures: Iterable[FailureRow]) -> list[str]:
    """The shard's note on its quarantined prompts (none: no note)."""
    ids = [r.prompt_id for r in failures if (r.error or "").startswith(QUARANTINED)]
    if not ids:
        return []
    return [
        f"shard {shard}: {len(ids)} prompt(s) quarantined, {QUARANTINED} ({', '.join(ids[:3])}"
        f"{', ...' if len(ids) > 3 else ''}): in the failures table, not sent again; --retry-quarantined sends them"
    ]
