"""HTTP client for one SGLang 0.5.23 server: what the pipeline reads from it and sends to it.

Errors are classified once, here: a 400 is the caller's (never retried at the same budget), a 5xx,
a 503 abort, a timeout or a dropped connection is the server's (retried elsewhere).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp


UNKNOWN_MAX_RUNNING = 64  # in flight per URL when it does not say (a router): the router spreads and queues


class ServerError(Exception):
    """A request the server did not complete. `retryable` tells the dispatcher what to do with it."""

    def __init__(self, url: str, message: str, *, status: int | None = None, retryable: bool):
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status
        self.message = message
        self.retryable = retryable


@dataclass(frozen=True)
class ServerInfo:
    """What a server says about itself; the numbers preflight and the dispatcher size work by."""

    url: str
    model: str
    context_length: int  # /v1/models data[0].max_model_len: the effective context length
    max_running_requests: int  # /server_info internal_states[0].effective_max_running_requests_per_dp
    max_req_input_len: int | None  # the scheduler's own input limit (context_length - ~6)
    max_total_num_tokens: int | None  # KV pool size in tokens
    reasoning_parser: str | None = None  # without one, thinking stays inside `content`
    servers: int = 1  # SGLang servers answering at this URL: a gateway's workers (fleet/gateway.py)


def error_message(body: Any) -> str:
    """SGLang's error bodies: `{"error": {"message"}}` (/generate), `{"object": "error", "message"}` (OpenAI)."""
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict):
            return str(body["error"].get("message", body["error"]))
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
        if isinstance(body.get("error"), str):
            return body["error"]
    return str(body)[:500]


class ServerClient:
    """One server, spoken to through a shared aiohttp session (one connection pool for the fleet)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, api_key: str | None = None,
                 request_timeout_s: float = 3600.0):
        self.session = session
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)

    def __repr__(self) -> str:  # never shows the key
        return f"ServerClient({self.url})"

    async def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None) -> Any:
        t = aiohttp.ClientTimeout(total=timeout) if timeout else self._timeout
        try:
            async with self.session.request(method, self.url + path, json=json, headers=self._headers,
                                            timeout=t) as resp:
                if resp.content_type == "application/json":
                    body = await resp.json()
                else:
                    body = await resp.text()
                if resp.status == 200:
                    return body
                retryable = resp.status >= 500 or resp.status in (408, 429)
                raise ServerError(self.url, error_message(body), status=resp.status, retryable=retryable)
        except ServerError:
            raise
        except asyncio.TimeoutError:
            raise ServerError(self.url, f"{method} {path} timed out", retryable=True) from None
        except (aiohttp.ClientError, OSError) as e:
            raise ServerError(self.url, f"{method} {path} failed: {type(e).__name__}: {e}", retryable=True) from None

    async def healthy(self, timeout: float = 5.0) -> bool:
        try:
            await self._request("GET", "/health", timeout=timeout)
            return True
        except ServerError:
            return False

    async def info(self) -> ServerInfo:
        models = await self._request("GET", "/v1/models", timeout=30)
        try:
            server = await self._request("GET", "/server_info", timeout=30)
        except ServerError as e:
            if e.status != 404:
                raise
            server = {}  # a router / gateway in front of many servers has no /server_info of its own
        card = models["data"][0]
        states = server.get("internal_states") or [{}]
        max_running = (states[0].get("effective_max_running_requests_per_dp") or server.get("max_running_requests")
                       or UNKNOWN_MAX_RUNNING)
        return ServerInfo(
            url=self.url,
            model=card["id"],
            context_length=int(card["max_model_len"]),
            max_running_requests=int(max_running),
            max_req_input_len=server.get("max_req_input_len"),
            max_total_num_tokens=server.get("max_total_num_tokens"),
            reasoning_parser=server.get("reasoning_parser"),
        )

    async def loads(self) -> dict:
        return await self._request("GET", "/v1/loads", timeout=10)

    async def count_prompt_tokens(self, messages: list[dict], chat_template_kwargs: dict) -> int:
        """Exact chat-template token count, rendered by the server the way a chat completion is."""
        body = {"messages": messages, "chat_template_kwargs": chat_template_kwargs}
        return int((await self._request("POST", "/v1/tokenize", json=body, timeout=60))["count"])

    async def tokenize(self, text: str) -> list[int]:
        """The ids of a plain string (no chat template, no special tokens added)."""
        body = {"prompt": text, "add_special_tokens": False}
        return list((await self._request("POST", "/v1/tokenize", json=body, timeout=60))["tokens"])

    async def chat(self, body: dict) -> dict:
        return await self._request("POST", "/v1/chat/completions", json=body)

    async def generate(self, body: dict) -> Any:
        return await self._request("POST", "/generate", json=body)
