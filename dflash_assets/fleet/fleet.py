"""A connected fleet: one aiohttp session, a client and the probed facts for every server. `connected()` is the one
way to talk to it (`on_fleet` outside an event loop).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from dflash_assets.fleet.client import ServerClient, ServerError, ServerInfo
from dflash_assets.fleet.gateway import gateway_workers, open_gateway
from dflash_assets.fleet.provenance import Provenance, read_provenance
from dflash_assets.fleet.stream import GatheredConnector
from dflash_assets.settings import FleetSettings

T = TypeVar("T")

new_event_loop: Callable[[], asyncio.AbstractEventLoop]
try:  # one event-loop wake-up costs ~14 µs on uvloop against ~36 µs on asyncio's own loop (docs/streaming.md)
    import uvloop

    new_event_loop = uvloop.new_event_loop
except ImportError:  # Windows: asyncio's loop
    new_event_loop = asyncio.new_event_loop


# The collector's first threshold while a run talks to its fleet: above the young objects of the requests in flight
# (tens of thousands), or each young collection walks them all (at 700 or 10,000: 6% of a backfill's CPU)
YOUNG_COLLECTION_EVERY = 100_000


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The heap that is there before a run talks to its fleet (about a million objects) frozen while it does
    (gc.freeze), so a full collection walks only what the requests allocated, and young collections every
    YOUNG_COLLECTION_EVERY objects. Both put back after (a heap frozen already stays so)."""
    ours = gc.get_freeze_count() == 0
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(thresholds[0], YOUNG_COLLECTION_EVERY), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if ours:
            gc.unfreeze()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on uvloop, the heap before it frozen."""
    with frozen_heap(), asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


@dataclass
class Fleet:
    clients: list[ServerClient]
    infos: list[ServerInfo]
    session: aiohttp.ClientSession
    provenance: Provenance | None = None  # what every server says it serves (fleet/provenance.py)
    relaunch_s: float = 0.0  # the longest a server the run relaunches takes to come back (launch mode's health wait)

    @property
    def model(self) -> str:
        return self.infos[0].model


def open_session(total_connections: int = 0) -> aiohttp.ClientSession:
    # the dispatcher bounds requests, so the pool matches it (limit=0 would mean unlimited)
    connector = GatheredConnector(limit=total_connections or 1024, limit_per_host=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


WAIT_SAY_EVERY_S = 5.0  # a wait for /health is said at once, then this often


async def wait_healthy(
    clients: list[ServerClient],
    timeout_s: float,
    refused_s: float = FleetSettings().connect_refused_s,
    say: Callable[[str], None] | None = None,
) -> int:
    """Poll /health until every server answers; the rounds. Ends at `timeout_s`, or after `refused_s` of refusals."""
    start = time.monotonic()
    pending, said, rounds = list(clients), None, 0
    refused_since: dict[str, float] = {}  # URL -> when it first refused the connection (this streak)
    while True:
        rounds += 1
        problems = await asyncio.gather(*(c.health_problem() for c in pending))
        now = time.monotonic()
        waiting = [(c, p) for c, p in zip(pending, problems, strict=True) if p is not None]
        if not waiting:
            return rounds
        pending = [c for c, _ in waiting]
        for client, problem in waiting:
            if getattr(problem, "kind", None) == "refused":
                refused_since.setdefault(client.url, now)
            else:
                refused_since.pop(client.url, None)
        urls = ", ".join(c.url + "/health" for c in pending)
        waited = now - start
        if refused_s > 0 and all(now - refused_since.get(c.url, now) >= refused_s for c in pending):
            raise ServerError(
                pending[0].url,
                f"nothing listens at {urls}: the connection was refused for {refused_s:g} s "
                f"(connect_refused_s); start the servers or check the URLs and ports",
                kind="refused",
            )
        if waited > timeout_s:
            raise ServerError(
                pending[0].url,
                f"not healthy after {timeout_s:.0f}s (GET {urls}): {waiting[0][1]}; check the servers' logs",
                kind="unhealthy",
            )
        if say is not None and (said is None or now - said >= WAIT_SAY_EVERY_S):
            said = now
            say(f"waiting for {urls} ({waited:.0f} s of {timeout_s:.0f} s) ...")
        await asyncio.sleep(0.2)


@asynccontextmanager
async def connected(
    urls: list[str],
    api_key: str | None = None,
    *,
    health_timeout_s: float = FleetSettings().health_timeout_s,
    request_timeout_s: float = FleetSettings().request_timeout_s,
    connect_refused_s: float = FleetSettings().connect_refused_s,
    say: Callable[[str], None] | None = None,
    relaunch_s: float = 0.0,
) -> AsyncIterator[Fleet]:
    """Connect, wait until every server is healthy, read facts and provenance; the fleet, closed after."""
    if not urls:
        raise ValueError("the fleet has no servers")
    async with open_session() as session:
        clients = [ServerClient(session, u, api_key, request_timeout_s) for u in urls]
        await wait_healthy(clients, health_timeout_s, connect_refused_s, say)
        clients = list(await asyncio.gather(*(_behind_gateway(c, api_key, request_timeout_s) for c in clients)))
        infos = list(await asyncio.gather(*(c.info() for c in clients)))
        provenance = await read_provenance(clients)  # a server that differs is refused here, before any request
        yield Fleet(clients, infos, session, provenance, relaunch_s)


async def _behind_gateway(client: ServerClient, api_key: str | None, request_timeout_s: float) -> ServerClient:
    """The client itself for an SGLang server; for an SGLang model gateway, one that reads its workers."""
    workers = await gateway_workers(client)
    if workers is None:
        return client
    return await open_gateway(client.session, client.url, workers, api_key, request_timeout_s)


def on_fleet(urls: list[str], work: Callable[[Fleet], Awaitable[T]], api_key: str | None = None, **kw) -> T:
    """`work(fleet)` on a `connected()` fleet, outside any event loop (scripts, tests, Dagster's assets)."""

    async def go() -> T:
        async with connected(urls, api_key, **kw) as fleet:
            return await work(fleet)

    return run(go())
