"""What each server says now: health, effective context length and capacity, load; pid/GPU/uptime if ours.

The figures are the servers' own, never their launch args; the API key is never in what is returned. A gateway
gets a row of its own (the capacity the pipeline sizes by), then one row per worker, probed as an attached server.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.table import Table

from dflash_assets.fleet import processes, registry
from dflash_assets.fleet.attach import parse_urls
from dflash_assets.fleet.client import ServerAccessError, ServerClient, ServerError
from dflash_assets.fleet.fleet import open_session
from dflash_assets.fleet.gateway import gateway_workers
from dflash_assets.fleet.registry import ServerRecord
from dflash_assets.fleet.tuning import parse_loads


@dataclass
class ServerStatus:
    name: str
    url: str
    healthy: bool
    context_length: int | None = None  # /v1/models max_model_len
    max_running_requests: int | None = None  # /server_info internal_states, summed over DP ranks
    running: int | None = None  # /v1/loads, summed over DP ranks
    waiting: int | None = None
    token_usage: float | None = None  # KV tokens in use / KV pool
    pid: int | None = None  # launched servers only
    gpus: list[int] | None = None
    uptime_s: float | None = None
    process: str | None = None  # "running" / "not running" for launched servers; None when attached
    error: str | None = None
    workers: int | None = None  # a gateway's row: the workers it lists (its worker rows follow it)
    gateway: str | None = None  # a worker's row: the gateway URL that lists it

    def as_dict(self) -> dict:
        return asdict(self)


def fleet_status(
    fleet_dir: Path | None = None, attach_urls: str | Sequence[str] = (), api_key_env: str = "DFLASH_API_KEY"
) -> list[ServerStatus]:
    """Status of the launched servers in `fleet_dir`'s registry and of any attached URLs."""
    records = list(registry.load(fleet_dir).values()) if fleet_dir else []
    urls = parse_urls(attach_urls) if attach_urls else []
    return asyncio.run(probe(records, urls, os.environ.get(api_key_env) or None))


async def probe(records: list[ServerRecord], urls: list[str], api_key: str | None) -> list[ServerStatus]:
    async with open_session() as session:
        jobs: list[Awaitable[ServerStatus | list[ServerStatus]]] = [
            _probe_launched(ServerClient(session, r.url, api_key), r) for r in records
        ]
        jobs += [_probe_attached(ServerClient(session, u, api_key), api_key) for u in urls]
        rows = await asyncio.gather(*jobs)
        return [s for row in rows for s in (row if isinstance(row, list) else [row])]


async def _probe_attached(client: ServerClient, api_key: str | None) -> list[ServerStatus]:
    """An attached URL: one server's row, or a gateway's row followed by its workers' rows."""
    status = ServerStatus(name=client.url, url=client.url, healthy=False)
    if not await client.healthy(timeout=30):
        status.error = "GET /health did not answer 200 (still loading, or down)"
        return [status]
    try:
        listed = await gateway_workers(client)
    except (ServerError, ServerAccessError) as e:
        status.error = e.message
        return [status]
    if listed is None:
        return [await _probe_url(client, status)]
    status.name, status.workers = "smg gateway", len(listed)
    workers = list(
        await asyncio.gather(
            *(
                _probe_url(
                    ServerClient(client.session, w.url, api_key),
                    ServerStatus(name=f"worker {i}", url=w.url, healthy=False, gateway=client.url),
                )
                for i, w in enumerate(listed, 1)
            )
        )
    )
    for w, row in zip(listed, workers):
        if not w.healthy:  # the gateway's own view, next to what this host sees
            row.error = "; ".join(filter(None, [f"the gateway marks it unhealthy ({w.status})", row.error]))
    answered = [
        (w.context_length, w.max_running_requests)
        for w in workers
        if w.healthy and w.context_length is not None and w.max_running_requests is not None  # set together
    ]
    if answered:
        status.context_length = min(context for context, _ in answered)
        status.max_running_requests = sum(running for _, running in answered)
    healthy = sum(w.healthy for w in listed)
    status.error = (f"{len(listed)} workers, {healthy} healthy" if listed else "it lists no worker") + (
        f"; {len(answered)} answer this host" if len(answered) != healthy else ""
    )
    status.healthy = bool(listed)
    return [status, *workers]


async def _probe_launched(client: ServerClient, rec: ServerRecord) -> ServerStatus:
    status = ServerStatus(name=rec.name, url=rec.url, healthy=False, pid=rec.pid, gpus=rec.gpus)
    if not processes.is_ours(rec.pid, rec.proc_start):
        status.process, status.error = "not running", "process not running (`dflash fleet up` relaunches it)"
        return status
    status.process = "running"
    started = datetime.fromisoformat(rec.started_at)
    status.uptime_s = round((datetime.now(UTC) - started).total_seconds(), 1)
    return await _probe_url(client, status)


async def _probe_url(client: ServerClient, status: ServerStatus) -> ServerStatus:
    status.healthy = await client.healthy(timeout=30)
    if not status.healthy:
        status.error = "GET /health did not answer 200 (still loading, or down)"
        return status
    try:
        info = await client.info()
        status.context_length, status.max_running_requests = info.context_length, info.max_running_requests
        load = parse_loads(client.url, 0.0, await client.loads())
    except (ServerError, ServerAccessError, KeyError, IndexError, TypeError, ValueError) as e:
        status.error = (
            e.message
            if isinstance(e, (ServerError, ServerAccessError))
            else f"unexpected answer: {type(e).__name__}: {e}"
        )
        return status
    if load.error is None:  # /v1/loads answered with its DP ranks' loads, summed (tuning.parse_loads)
        status.running, status.waiting = load.running, load.waiting
        status.token_usage = None if load.token_usage is None else round(load.token_usage, 4)
    return status


def _uptime(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def status_table(statuses: list[ServerStatus]) -> Table:
    table = Table(title="SGLang fleet")
    numbers = ("context length", "max running", "running", "waiting", "KV usage", "pid")  # aligned right
    for col in ("server", "url", "health", *numbers, "GPU", "uptime", "note"):
        table.add_column(
            col,
            justify="right" if col in numbers else "left",
            # a URL is what a person copies: never cut it
            min_width=max((len(s.url) for s in statuses), default=0) if col == "url" else None,
        )

    def num(v) -> str:
        return "-" if v is None else f"{v:,}"

    for s in statuses:
        name = f"  {s.name}" if s.gateway else s.name  # a gateway's workers, indented under it
        table.add_row(
            name,
            s.url,
            "[green]healthy[/]" if s.healthy else "[red]unhealthy[/]",
            num(s.context_length),
            num(s.max_running_requests),
            num(s.running),
            num(s.waiting),
            "-" if s.token_usage is None else f"{s.token_usage:.1%}",
            "-" if s.pid is None else str(s.pid),
            ",".join(map(str, s.gpus)) if s.gpus else "-",
            _uptime(s.uptime_s),
            s.error or "",
        )
    return table
