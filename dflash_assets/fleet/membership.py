"""A fleet behind a gateway follows its membership during a run.

smg's workers are added (`POST /workers`), removed (`DELETE /workers/{id}`) or go down. The worker list is read
every probe interval: a worker that joins is probed as any other and its slots added, one that leaves or is
unhealthy has them removed; one that does not answer this host, or serves another model, is tried again later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from dflash_assets.fleet.client import ServerClient, ServerError, ServerInfo
from dflash_assets.fleet.gateway import GatewayClient, GatewayError, combine, gateway_workers


@dataclass(frozen=True)
class Change:
    """The gateway's workers changed: its combined facts now, and who joined and who left."""

    info: ServerInfo
    joined: list[str]
    left: list[str]


async def reread(gateway: GatewayClient) -> Change | None:
    """Read the gateway's workers again; adopt the change (None: none)."""
    workers = await gateway_workers(gateway)
    if workers is None:
        return None
    healthy = {w.url for w in workers if w.healthy}
    current = {w.url for w in gateway.workers}
    left = sorted(current - healthy)
    new = [gateway.worker(url) for url in sorted(healthy - current)]
    answers = await asyncio.gather(*(w.healthy(timeout=10) for w in new))
    new = [w for w, ok in zip(new, answers, strict=True) if ok]  # out of reach from here: next interval
    kept = [w for w in gateway.workers if w.url not in left] + new
    if (not new and not left) or not kept:  # none left: the dispatcher waits for a worker as it does today
        return None
    infos = list(await asyncio.gather(*(w.info() for w in kept)))
    info = combine(gateway.url, infos)  # GatewayError on a joiner with another model: nothing adopted
    gateway.adopt(kept)
    return Change(info, [w.url for w in new], left)


async def follow(
    clients: list[ServerClient],
    every_s: float,
    changed: Callable[[int, Change], None],
    log: Callable[[str], None],
) -> None:
    """Every `every_s`, re-read each gateway of `clients`; `changed(index, change)` on a change, till cancelled."""
    gateways = [(i, c) for i, c in enumerate(clients) if isinstance(c, GatewayClient)]
    while gateways:
        await asyncio.sleep(every_s)
        for i, gateway in gateways:
            try:
                change = await reread(gateway)
            except (ServerError, GatewayError) as e:
                log(f"{gateway.url}: its workers were not read again ({e}); next try in {every_s:g}s")
                continue
            if change is not None:
                changed(i, change)
