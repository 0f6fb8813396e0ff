"""An SGLang model gateway (`smg`) in front of many servers: attached by its one URL, sized by its workers.

What preflight and the dispatcher need (context length, input limit, effective max_running_requests, the chat
template) is each worker's: the gateway's `/v1/tokenize` uses its own tokenizer, its `/v1/models` has no
max_model_len, its worker labels carry flags. So a gateway (`GET /workers`) has each healthy worker probed with
`ServerClient.info()` and counting prompts, and generation goes through the gateway with as many in flight as its
workers run. The workers must be reachable at the URLs the gateway lists. Retries are ours
(`deploy/sglang-router.sh` passes `--disable-retries`): two layers would multiply attempts unseen.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, replace

import aiohttp

from dflash_assets.fleet.client import ServerClient, ServerError, ServerInfo
from dflash_assets.settings import FleetSettings

WORKERS_ROUTE = "/workers"  # smg's worker list: {"workers": [{"url", "model_id", "is_healthy", ...}], "total"}
LOADS_ROUTE = "/get_loads"  # smg's per-worker, per-DP-rank /v1/loads of every worker


class GatewayError(ValueError):
    """The gateway cannot be used as a fleet: no healthy worker, several models, or workers out of reach."""


@dataclass(frozen=True)
class GatewayWorker:
    url: str
    model: str | None
    healthy: bool
    status: str | None


def parse_workers(body) -> list[GatewayWorker] | None:
    """The workers of an smg `/workers` answer, or None when the body is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
        return None
    return [
        GatewayWorker(
            url=str(w["url"]).rstrip("/"),
            model=w.get("model_id"),
            healthy=bool(w.get("is_healthy")),
            status=w.get("status"),
        )
        for w in body["workers"]
        if isinstance(w, dict) and w.get("url")
    ]


class GatewayClient(ServerClient):
    """One gateway URL: generation through it, facts and token counts from the servers behind it."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        workers: list[ServerClient],
        api_key: str | None = None,
        request_timeout_s: float = FleetSettings().request_timeout_s,
    ):
        super().__init__(session, url, api_key, request_timeout_s)
        self._api_key, self._request_timeout_s = api_key, request_timeout_s
        self.adopt(workers)

    def worker(self, url: str) -> ServerClient:
        """A client of one worker behind the gateway, with the gateway's key and timeout."""
        return ServerClient(self.session, url, self._api_key, self._request_timeout_s)

    def adopt(self, workers: list[ServerClient]) -> None:
        """The workers behind the gateway now (fleet/membership.py follows them during a run)."""
        self.workers = workers
        self._next_worker = itertools.cycle(workers)

    def __repr__(self) -> str:
        return f"GatewayClient({self.url}, {len(self.workers)} workers)"

    async def info(self) -> ServerInfo:
        infos = list(await asyncio.gather(*(w.info() for w in self.workers)))
        return combine(self.url, infos)

    async def loads(self) -> dict:
        return await self._request("GET", LOADS_ROUTE, timeout=10)

    async def count_prompt_tokens(
        self, messages: list[dict], chat_template_kwargs: dict, tools: list[dict] | None = None
    ) -> int:
        return await next(self._next_worker).count_prompt_tokens(messages, chat_template_kwargs, tools)

    async def tokenize(self, text: str) -> list[int]:
        return await self.workers[0].tokenize(text)


def combine(url: str, infos: list[ServerInfo]) -> ServerInfo:
    """What the fleet behind one gateway can honour: one model, the smallest context and input limit, the sum
    of the servers' effective max_running_requests; a reasoning parser only if every server runs one."""
    models = sorted({i.model for i in infos})
    if len(models) > 1:
        detail = ", ".join(f"{i.url} serves {i.model!r}" for i in infos)
        raise GatewayError(
            f"the gateway {url} routes to {len(models)} different models, refusing to mix them: {detail}"
        )
    parsers, tool_parsers = {i.reasoning_parser for i in infos}, {i.tool_call_parser for i in infos}
    input_limits = [i.max_req_input_len for i in infos if i.max_req_input_len is not None]
    kv_pools = [i.max_total_num_tokens for i in infos if i.max_total_num_tokens is not None]
    return replace(
        infos[0],
        url=url,
        context_length=min(i.context_length for i in infos),
        max_running_requests=sum(i.max_running_requests for i in infos),
        max_req_input_len=min(input_limits) if input_limits else None,
        max_total_num_tokens=sum(kv_pools) if len(kv_pools) == len(infos) else None,
        reasoning_parser=parsers.pop() if len(parsers) == 1 else None,
        tool_call_parser=tool_parsers.pop() if len(tool_parsers) == 1 else None,
        servers=len(infos),
    )


async def gateway_workers(client: ServerClient) -> list[GatewayWorker] | None:
    """The workers an smg gateway at `client.url` routes to; None for an SGLang server (no `/workers`)."""
    try:
        body = await client._optional(WORKERS_ROUTE)  # None on a 404
    except ServerError as e:
        if e.status == 405:
            return None
        raise
    return None if body is None else parse_workers(body)


async def open_gateway(
    session: aiohttp.ClientSession,
    url: str,
    workers: list[GatewayWorker],
    api_key: str | None = None,
    request_timeout_s: float = FleetSettings().request_timeout_s,
) -> GatewayClient:
    """A GatewayClient over the gateway's healthy workers, each checked to answer this host directly."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        listed = ", ".join(f"{w.url} ({w.status})" for w in workers) or "none"
        raise GatewayError(f"the gateway {url} has no healthy worker (workers: {listed})")
    servers = [ServerClient(session, w.url, api_key, request_timeout_s) for w in healthy]
    reachable = await asyncio.gather(*(s.healthy(timeout=10) for s in servers))
    if not all(reachable):
        lost = ", ".join(s.url for s, ok in zip(servers, reachable) if not ok)
        raise GatewayError(
            f"the gateway {url} routes to {lost}, which this host cannot reach (GET /health): preflight reads "
            f"each server's context length, input limit and capacity, and counts prompt tokens, on the servers "
            f"themselves; register the workers with the gateway at addresses this host can reach too"
        )
    return GatewayClient(session, url, servers, api_key, request_timeout_s)
