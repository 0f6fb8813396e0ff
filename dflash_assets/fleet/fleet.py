"""A connected fleet: one aiohttp session, a client and the probed facts for every server.

`connected()` is the one way to talk to the fleet: connect, run, close (`on_fleet` is its face outside an event
loop, for scripts and tests)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from dflash_assets.fleet.client import ServerClient, ServerError, ServerInfo
from dflash_assets.fleet.gateway import gateway_workers, open_gateway
from dflash_assets.settings import FleetSettings

T = TypeVar("T")

new_event_loop: Callable[[], asyncio.AbstractEventLoop]
try:  # one event-loop wake-up costs ~14 µs on uvloop against ~36 µs on asyncio's own loop (docs/streaming.md)
    import uvloop

    new_event_loop = uvloop.new_event_loop
except ImportError:  # Windows: asyncio's loop
    new_event_loop = asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on uvloop: how every run talks to its fleet outside an event loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


@dataclass
class Fleet:
    clients: list[ServerClient]
    infos: list[ServerInfo]
    session: aiohttp.ClientSession

    @property
    def model(self) -> str:
        return self.infos[0].model


def open_session(total_connections: int = 0) -> aiohttp.ClientSession:
    # limit=0 would mean unlimited; the dispatcher bounds requests, so size the pool to match it
    connector = aiohttp.TCPConnector(limit=total_connections or 1024, limit_per_host=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def wait_healthy(client: ServerClient, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await client.healthy():
        if time.monotonic() > deadline:
            raise ServerError(client.url, f"not healthy after {timeout_s:.0f}s (GET /health)", retryable=False)
        await asyncio.sleep(0.2)


@asynccontextmanager
async def connected(
    urls: list[str],
    api_key: str | None = None,
    *,
    health_timeout_s: float = FleetSettings().health_timeout_s,
    request_timeout_s: float = FleetSettings().request_timeout_s,
) -> AsyncIterator[Fleet]:
    """Connect to every server, wait until each is healthy and read what it says about itself; the fleet, its
    session closed when the block ends, however it ends."""
    if not urls:
        raise ValueError("the fleet has no servers")
    async with open_session() as session:
        clients = [ServerClient(session, u, api_key, request_timeout_s) for u in urls]
        await asyncio.gather(*(wait_healthy(c, health_timeout_s) for c in clients))
        clients = list(await asyncio.gather(*(_behind_gateway(c, api_key, request_timeout_s) for c in clients)))
        infos = list(await asyncio.gather(*(c.info() for c in clients)))
        yield Fleet(clients, infos, session)


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


def read_info(url: str, api_key: str | None = None) -> ServerInfo:
    """What the fleet reads of one server (context length, slots, limits, parser), outside any event loop."""

    async def first(fleet: Fleet) -> ServerInfo:
        return fleet.infos[0]

    return on_fleet([url], first, api_key)
