"""HTTP client for one SGLang 0.5.23 server: what the pipeline reads from it and sends to it.

Errors are classified once, here (`ServerError.kind`), so every caller's retry loop does the right thing:
- 400/413/422: "prompt", never resent at the same budget;
- 401/403/404: the key or the URL is wrong: ServerAccessError, not a ServerError, so the run stops;
- anything else, a timeout, a dropped connection, a 200 whose finish_reason is "abort": "server";
- a silent stream (fleet/stream.py Watch): "stalled", after `POST /abort_request`;
- a gateway's 503 `no_available_workers`: "no_worker" (generation/send.py spends no attempt on it); its lost
  worker connection: "upstream_lost";
- nothing listening: "refused"; never healthy: "unhealthy" (not retried).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import aiohttp
import msgspec

from dflash_assets.fleet.stream import (
    ChatAnswer,
    GenerateAnswer,
    Silence,
    StreamError,
    Watch,
    Watchdog,
    chat_stream_body,
)
from dflash_assets.settings import FleetSettings

UNKNOWN_MAX_RUNNING = 64  # in flight per URL when it does not say (a router): the router spreads and queues
PROMPT_FAULT = (400, 413, 422)  # the request itself is wrong: a reject, never a retry
ACCESS_FAULT = (401, 403, 404)  # the key or the URL is wrong: no prompt will ever get through
INPUT_LEN_RESERVE = 5  # tp_worker.py: max_req_input_len = max_req_len - 5
# /health is a one-token generation in 0.5.23: 200 once the scheduler answers, 503 after SGLANG_HEALTH_CHECK_TIMEOUT
# (20 s); a probe outwaits that, or a busy healthy server looks dead
HEALTH_PROBE_TIMEOUT_S = 25.0
ABORT_TIMEOUT_S = 5.0  # a stalled request's /abort_request: best effort, the retry waits for it no longer
DRAIN_S = 1.0  # how long the end of a streamed body may take after its `data: [DONE]`
TOKENIZE_ATTEMPTS = 4  # a transient error while counting a prompt's tokens is retried, never made a reject
# smg 1.13's answer when no worker can take a request (all unhealthy or circuit breakers open): HTTP 503 with
# {"error": {"code": "no_available_workers", ...}} (tests/engines/test_gateway.py)
NO_WORKER = (503, "no_available_workers")
# smg 1.13's HTTP 500 when the connection to a worker dropped or could not be made (routers/http/router.rs
# convert_reqwest_error); generation/quarantine.py probes the worker to tell a dead one from a down one
UPSTREAM_LOST = ("call_upstream_request_error", "call_upstream_body_error", "call_upstream_connection_failed")


# JSON en/decoded on raw bytes (msgspec: several times json's speed on the bodies of every request and answer)
_encode, _decode = msgspec.json.encode, msgspec.json.decode


async def _body(resp: aiohttp.ClientResponse) -> Any:
    """An answer's body: JSON decoded (None when empty), any other content type its text."""
    if resp.content_type != "application/json":
        return await resp.text()
    raw = await resp.read()
    return _decode(raw) if raw.strip() else None


ErrorKind = Literal["server", "prompt", "unhealthy", "refused", "stalled", "no_worker", "upstream_lost"]


class ServerError(Exception):
    """A request the server did not complete: `kind` what failed; `down` set by the quarantine."""

    def __init__(self, url: str, message: str, *, status: int | None = None, kind: ErrorKind = "server"):
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status
        self.message = message
        self.kind: ErrorKind = kind
        self.down = False

    @property
    def retryable(self) -> bool:
        return self.kind not in ("prompt", "unhealthy")


def _kind_of(status: int, code: str | None) -> ErrorKind:
    """What an HTTP error status (and its body's error code) says of a failed request."""
    if status in PROMPT_FAULT:
        return "prompt"
    if (status, code) == NO_WORKER:
        return "no_worker"
    return "upstream_lost" if status == 500 and code in UPSTREAM_LOST else "server"


class ServerAccessError(RuntimeError):
    """401/403/404: the server refuses us (API key) or the route is not there (URL). Stops the run."""

    def __init__(self, url: str, method: str, path: str, status: int, message: str):
        what = "the API key is missing or wrong" if status in (401, 403) else "the URL does not point at SGLang"
        super().__init__(
            f"{url}: HTTP {status} on {method} {path} ({message}): {what}; nothing more is sent to "
            f"this fleet until it is fixed (check the server URL and the API key's environment variable)"
        )
        self.url, self.path, self.status, self.message = url, path, status, message


class ChatResult(NamedTuple):
    """A chat completion as the pipeline reads it (0.5.23 ChatCompletionResponse); a tuple, cheap per answer."""

    finish_reason: str
    content: str | None
    reasoning_content: str | None  # null when the server did not separate reasoning
    tool_calls: list[dict] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int  # usage.reasoning_tokens, else the OpenAI location completion_tokens_details'
    cached_tokens: int | None  # prompt tokens the prefix cache held: a server started with --enable-cache-report
    prompt_token_ids: list[int] | None  # asked with return_token_ids
    output_ids: list[int] | None  # response_token_ids, asked with return_token_ids
    loop_start_tokens: int | None  # a runaway stopped while streaming (fleet/stream.py)

    @classmethod
    def of(cls, resp: dict) -> ChatResult:
        choice, usage = resp["choices"][0], resp.get("usage") or {}
        message, reasoning = choice["message"], usage.get("reasoning_tokens")
        if reasoning is None:
            reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
        return cls(
            choice.get("finish_reason"),
            message.get("content"),
            message.get("reasoning_content"),
            message.get("tool_calls"),
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
            reasoning or 0,
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            choice.get("prompt_token_ids"),
            choice.get("response_token_ids"),
            choice.get("loop_start_tokens"),
        )


@dataclass(frozen=True)
class ServerInfo:
    """What a server says about itself; the numbers preflight and the dispatcher size work by."""

    url: str
    model: str
    context_length: int  # /v1/models data[0].max_model_len: the effective context length
    max_running_requests: (
        int  # /server_info internal_states[*].effective_max_running_requests_per_dp, summed over DP ranks
    )
    max_req_input_len: int | None  # /server_info: the scheduler's input limit, max_req_len - 5
    max_total_num_tokens: int | None  # /server_info: KV pool size in tokens
    reasoning_parser: str | None = None  # without one, thinking stays inside `content`
    mamba_slots_per_request: int | None = None  # hybrid models only: see mamba_slots_per_request()
    always_thinks: bool = False  # its chat template opens <think> even with enable_thinking false
    servers: int = 1  # SGLang servers answering at this URL: a gateway's workers (fleet/gateway.py)
    tool_call_parser: str | None = None  # /server_info: without one, a tool call stays inside `content`

    @property
    def max_req_len(self) -> int:
        """What one request (prompt + output) may hold before the scheduler cuts its output silently.

        0.5.23 tp_worker.get_worker_info: min(context_len - 1, KV pool - 1); the scheduler (init_req_max_new_tokens)
        lowers max_new_tokens to max_req_len - prompt - 1 without an error.
        """
        if self.max_req_input_len is not None:
            return self.max_req_input_len + INPUT_LEN_RESERVE
        if self.max_total_num_tokens is not None:
            return min(self.context_length, self.max_total_num_tokens) - 1
        return self.context_length - 1


# at least, per running request with the radix cache (0.5.23 MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO)
MAMBA_SLOTS_PER_REQUEST = 3


def mamba_slots_per_request(server: dict) -> int | None:
    """Mamba state slots one running request holds, as the server resolved them; None for a dense model.

    0.5.23 kv_cache_configurator._calculate_mamba_ratio: 1 without the radix cache, else 3, plus the extra-buffer
    strategy's tracking slots (allocation_sizing.get_mamba_tracking_slots: 1 lazy or without overlap, else 2).
    """
    if server.get("max_mamba_cache_size") is None:
        return None
    if server.get("disable_radix_cache"):
        return 1
    strategy = server.get("mamba_radix_cache_strategy")
    if strategy == "extra_buffer_lazy":
        return MAMBA_SLOTS_PER_REQUEST + 1
    if strategy == "extra_buffer":
        return MAMBA_SLOTS_PER_REQUEST + (1 if server.get("disable_overlap_schedule") else 2)
    return MAMBA_SLOTS_PER_REQUEST


def error_code(body: Any) -> str | None:
    """The `code` of an OpenAI-style error body (`{"error": {"code"}}`), if it has one."""
    error = body.get("error") if isinstance(body, dict) else None
    return str(error["code"]) if isinstance(error, dict) and error.get("code") is not None else None


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


async def _drained(resp: aiohttp.ClientResponse) -> bool:
    """Read what follows `data: [DONE]` so the connection goes back to the pool (aiohttp closes one released before
    its end). False (then closed) when the server keeps the body open past DRAIN_S."""
    if resp.content.at_eof():
        return True
    try:
        async with asyncio.timeout(DRAIN_S):
            await resp.content.read()
    except TimeoutError:
        return False
    return resp.content.at_eof()


class ServerClient:
    """One server, spoken to through a shared aiohttp session (one connection pool for the fleet)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        api_key: str | None = None,
        request_timeout_s: float = FleetSettings().request_timeout_s,
    ):
        self.session = session
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._json_headers = {**self._headers, "Content-Type": "application/json"}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._watchdog = Watchdog()  # the deadlines of this client's streams in flight

    def __repr__(self) -> str:  # never shows the key
        return f"ServerClient({self.url})"

    async def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None) -> Any:
        t = aiohttp.ClientTimeout(total=timeout) if timeout else self._timeout
        try:
            data, headers = (None, self._headers) if json is None else (_encode(json), self._json_headers)
            async with self.session.request(method, self.url + path, data=data, headers=headers, timeout=t) as resp:
                body = await _body(resp)
                if resp.status == 200:
                    return body
                self._refused(resp.status, method, path, body)
        except (ServerError, ServerAccessError):
            raise
        except TimeoutError:
            raise ServerError(self.url, f"{method} {path} timed out") from None
        except (aiohttp.ClientError, OSError) as e:
            refused = isinstance(getattr(e, "os_error", e), ConnectionRefusedError)
            kind: ErrorKind = "refused" if refused else "server"
            raise ServerError(self.url, f"{method} {path} failed: {type(e).__name__}: {e}", kind=kind) from None

    def _refused(self, status: int, method: str, path: str, body: Any) -> None:
        if status in ACCESS_FAULT:
            raise ServerAccessError(self.url, method, path, status, error_message(body))
        raise ServerError(self.url, error_message(body), status=status, kind=_kind_of(status, error_code(body)))

    async def _stream(self, path: str, body: dict, answer: ChatAnswer | GenerateAnswer, watch: Watch) -> dict:
        """POST a streamed request and assemble its answer; a stall or a loop closes the stream (SGLang aborts the
        request), and a stall is aborted by its `rid` too (a half-open connection hides the close)."""
        silence = Silence(watch, self._watchdog)
        rid = os.urandom(16).hex()  # what uuid4().hex holds, without building a UUID per request
        body = {**body, "rid": rid}
        try:
            async with (
                silence,
                self.session.post(
                    self.url + path, data=_encode(body), headers=self._json_headers, timeout=self._timeout
                ) as resp,
            ):
                if resp.status != 200:
                    self._refused(resp.status, "POST", path, await _body(resp))
                stopped = drained = False
                try:
                    stopped = await silence.read(resp, answer)  # True: a loop, stop decoding it
                    drained = not stopped and await _drained(resp)
                finally:
                    if not drained:
                        resp.close()  # not back to the pool: the server must see the client go
                return answer.response(stopped)
        except (ServerError, ServerAccessError):
            raise
        except StreamError as e:  # an abort with a status, after the 200
            code = e.code if isinstance(e.code, int) else None
            raise ServerError(
                self.url, e.message, status=code, kind="prompt" if code in PROMPT_FAULT else "server"
            ) from None
        except TimeoutError:
            if silence.expired:
                await self.abort(rid)
                raise ServerError(
                    self.url, f"POST {path}: {silence.why()}, the stream was closed", kind="stalled"
                ) from None
            raise ServerError(self.url, f"POST {path} timed out") from None
        except (aiohttp.ClientError, OSError, ValueError) as e:
            raise ServerError(self.url, f"POST {path} failed: {type(e).__name__}: {e}") from None

    async def abort(self, rid: str) -> bool:
        """POST /abort_request for one request, best effort: False when refused (0.5.23 with --admin-api-key)."""
        try:
            await self._request("POST", "/abort_request", json={"rid": rid}, timeout=ABORT_TIMEOUT_S)
        except (ServerError, ServerAccessError):
            return False
        return True

    async def healthy(self, timeout: float = HEALTH_PROBE_TIMEOUT_S) -> bool:
        return await self.health_problem(timeout) is None

    async def health_problem(self, timeout: float = HEALTH_PROBE_TIMEOUT_S) -> ServerError | ServerAccessError | None:
        """Why GET /health did not answer 200 (a refused connection says `refused`), or None when it did."""
        try:
            await self._request("GET", "/health", timeout=timeout)
            return None
        except (ServerError, ServerAccessError) as e:
            return e

    async def _optional(self, path: str, timeout: float = 30) -> Any:
        """A route a router / gateway (or a server without --enable-metrics) does not have: None on a 404."""
        try:
            return await self._request("GET", path, timeout=timeout)
        except ServerAccessError as e:
            if e.status != 404:
                raise
            return None

    async def info(self) -> ServerInfo:
        models = await self._request("GET", "/v1/models", timeout=30)
        server = await self._optional("/server_info") or {}
        card = models["data"][0]
        # one entry per DP rank (http_server.server_info), each scheduler with its own slots
        per_rank = [s.get("effective_max_running_requests_per_dp") for s in server.get("internal_states") or []]
        max_running = (sum(per_rank) if per_rank and all(per_rank) else None) or server.get("max_running_requests")
        parser = server.get("reasoning_parser")
        if parser == "auto" or "reasoning_parser" not in server:
            # `--reasoning-parser auto` stays "auto" in /server_info; the one matched is in /model_info (engine.py)
            parser = (await self._optional("/model_info") or {}).get("reasoning_parser", parser)
        return ServerInfo(
            url=self.url,
            model=card["id"],
            context_length=int(card["max_model_len"]),
            max_running_requests=int(max_running or UNKNOWN_MAX_RUNNING),
            max_req_input_len=server.get("max_req_input_len"),
            max_total_num_tokens=server.get("max_total_num_tokens"),
            reasoning_parser=parser,
            mamba_slots_per_request=mamba_slots_per_request(server),
            always_thinks=await self._always_thinks(),
            tool_call_parser=server.get("tool_call_parser"),
        )

    async def _always_thinks(self) -> bool:
        """Whether the chat template opens `<think>` with enable_thinking false, read from what the server renders:
        0.5.23 then forces reasoning for every request (template_detection.py force_reasoning_pattern). A server
        without /v1/tokenize (a gateway) is taken not to."""
        probe = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}}
        try:
            rendered = (await self._request("POST", "/v1/tokenize", json=probe, timeout=30))["tokens"]
            opener = await self.tokenize("<think>\n")
        except (ServerError, ServerAccessError):
            return False
        return bool(opener) and rendered[-len(opener) :] == opener

    async def metrics(self) -> str | None:
        """The Prometheus text of /metrics; None when the server runs without --enable-metrics (404)."""
        return await self._optional("/metrics", timeout=10)

    async def loads(self) -> dict:
        return await self._request("GET", "/v1/loads", timeout=10)

    async def count_prompt_tokens(
        self, messages: list[dict], chat_template_kwargs: dict, tools: list[dict] | None = None
    ) -> int:
        """Exact chat-template token count, rendered by the server as a chat completion is, `tools` included."""
        body = {
            "messages": messages,
            "chat_template_kwargs": chat_template_kwargs,
            **({"tools": tools} if tools else {}),
        }
        return int((await self.tokenize_chat(body))["count"])

    async def tokenize_chat(self, body: dict) -> dict:
        """`POST /v1/tokenize` of a chat body, a transient error retried with backoff (TOKENIZE_ATTEMPTS)."""
        attempt = 1
        while True:
            try:
                return await self._request("POST", "/v1/tokenize", json=body, timeout=60)
            except ServerError as e:
                if not e.retryable or attempt >= TOKENIZE_ATTEMPTS:
                    raise
            await asyncio.sleep(0.2 * 2 ** (attempt - 1))
            attempt += 1

    async def tokenize(self, text: str) -> list[int]:
        """The ids of a plain string (no chat template, no special tokens added)."""
        body = {"prompt": text, "add_special_tokens": False}
        return list((await self._request("POST", "/v1/tokenize", json=body, timeout=60))["tokens"])

    async def detokenize(self, ids: list[int]) -> str:
        """Token ids decoded in one piece (special tokens skipped): halves joined can split a character."""
        body = {"tokens": list(ids), "skip_special_tokens": True}
        return (await self._request("POST", "/v1/detokenize", json=body, timeout=60))["text"]

    async def chat(self, body: dict, watch: Watch | None = None) -> ChatResult:
        """The chat completion of `body`; with a `watch`, streamed and watched, assembled into the same answer."""
        if watch is None:
            resp = await self._request("POST", "/v1/chat/completions", json=body)
        else:
            resp = await self._stream("/v1/chat/completions", chat_stream_body(body, watch), ChatAnswer(watch), watch)
        aborted = [c.get("index") for c in resp.get("choices") or [] if c.get("finish_reason") == "abort"]
        if aborted:  # a status-less abort (FINISH_ABORT without status_code) arrives as an HTTP 200
            raise ServerError(
                self.url,
                f"/v1/chat/completions answered 200 with finish_reason 'abort' "
                f"(choice {aborted[0]}): aborted by the server, not finished",
            )
        return ChatResult.of(resp)

    async def generate(self, body: dict, watch: Watch | None = None) -> Any:
        """/generate of one request; with a `watch`, streamed and watched, assembled into the same answer."""
        if watch is None:
            return await self._request("POST", "/generate", json=body)
        return await self._stream("/generate", {**body, "stream": True}, GenerateAnswer(watch), watch)
