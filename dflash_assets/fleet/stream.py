"""Streamed generation (SSE, `stream: true`): the answer assembled from its events, and the request watched live.

SGLang 0.5.23's streams, assembled here into the non-streamed answer's shape:
- /v1/chat/completions (serving_chat._generate_chat_stream): delta.role, then delta.reasoning_content /
  delta.content, finish_reason and matched_stop, a `sglext` chunk (input_ids, output_ids) when asked, the usage chunk
  (choices []) only with stream_options.include_usage, `data: [DONE]`; an abort after the 200 is an error event.
- /generate (http_server.serve_generate_request): `data: {text, output_ids, meta_info}`, cumulative unless
  --incremental-streaming-output; meta_info.finish_reason null until the last.
Watched (`Watch`, `Silence`): a stream silent for `stall_timeout_s` (`first_token_timeout_s` before its first event)
is closed (SGLang aborts a disconnected request: tokenizer_manager._stream_one_response); every `check_every_tokens`
tokens the runaway rule reads the text, and a loop ends the answer with finish_reason RUNAWAY.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp.client_proto import ResponseHandler
from aiohttp.streams import StreamReader

from dflash_assets.rules import RUNAWAY_FINISH
from dflash_assets.settings import DispatchSettings

DATA, DONE = b"data: ", b"[DONE]"
DONE_EVENT = DATA + DONE + b"\n\n"
FOLD_BYTES = 1 << 16  # a stream not watched for runaways is still decoded every this many bytes, to bound memory
# the watchdog ticks every quarter of the stall timeout: a stall is noticed after 1 to 1.25 times it
TICK_SHARE = 0.25
# an open event stream's socket is read once per this many seconds at most (Gather; docs/streaming.md)
GATHER_S = 0.05


_DEFAULTS = DispatchSettings()


@dataclass(frozen=True)
class Watch:
    """How a streamed request is watched while it runs (the dispatch settings' defaults; send.watch_of)."""

    stall_timeout_s: float = _DEFAULTS.stall_timeout_s
    first_token_timeout_s: float = _DEFAULTS.first_token_timeout_s
    check_every_tokens: int = 0  # 0: the runaway rule is not applied while streaming
    looping: Callable[[str], bool] | None = None  # the runaway rule, on the text so far
    loop_start: Callable[[str], int] | None = None  # where in that text the loop began (a character offset)

    @property
    def watches_runaways(self) -> bool:
        return self.check_every_tokens > 0 and self.looping is not None


class Tokens:
    """Output tokens at each position of the streamed text: (characters, tokens) at every event."""

    __slots__ = ("chars", "tokens")

    def __init__(self) -> None:
        self.chars: list[int] = []
        self.tokens: list[int] = []

    def add(self, chars: int, tokens: int) -> None:
        self.chars.append(chars)
        self.tokens.append(tokens)

    def at(self, char: int) -> int:
        """Tokens decoded when character `char` of the text had arrived (to the stream's granularity)."""
        i = bisect.bisect_right(self.chars, char)
        return self.tokens[min(i, len(self.tokens) - 1)] if self.tokens else 0


class Runaway:
    """The runaway rule, every `check_every_tokens` tokens; it holds nothing of its answer (no cycle)."""

    __slots__ = ("loop_start_tokens", "next_check", "positions", "watch")

    def __init__(self, watch: Watch):
        self.watch, self.next_check = watch, watch.check_every_tokens
        self.positions = Tokens()
        self.loop_start_tokens: int | None = None

    def looping(self, text: Callable[[], str], chars: int, tokens: int) -> bool:
        """Whether the answer loops, `tokens` decoded and `chars` characters of the judged text arrived."""
        w = self.watch
        if not w.watches_runaways:
            return False
        self.positions.add(chars, tokens)
        if tokens < self.next_check:
            return False
        self.next_check = tokens + w.check_every_tokens
        whole = text()
        if w.looping is None or not w.looping(whole):
            return False
        start = w.loop_start(whole) if w.loop_start is not None else len(whole)
        self.loop_start_tokens = self.positions.at(start)
        return True


class Watchdog:
    """One timer for every watched stream of a client: each tick cancels the streams past their deadline."""

    def __init__(self) -> None:
        self.streams: set[Silence] = set()
        self.tick = math.inf
        self._handle: asyncio.TimerHandle | None = None

    def add(self, silence: Silence, loop: asyncio.AbstractEventLoop) -> None:
        self.streams.add(silence)
        tick = silence.watch.stall_timeout_s * TICK_SHARE
        if self._handle is None or tick < self.tick:
            if self._handle is not None:
                self._handle.cancel()
            self.tick = min(self.tick, tick)
            self._handle = loop.call_later(self.tick, self._check, loop)

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for silence in sorted((s for s in self.streams if s.deadline <= now), key=lambda s: s.deadline):
            self.streams.discard(silence)
            silence.expire()
        if self.streams:
            self._handle = loop.call_later(self.tick, self._check, loop)
        else:
            self._handle, self.tick = None, math.inf

    def discard(self, silence: Silence) -> None:
        self.streams.discard(silence)


class Gather:
    """The reads of a session's event streams gathered: after a read that leaves an event stream open, its socket
    is not read again until the next tick (`every_s`), so the events SGLang writes one by one come in one read.
    Events arrive up to `every_s` later, far from any deadline."""

    __slots__ = ("_handle", "every_s", "paused")

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.paused: list[Any] = []  # uvloop's transports are no asyncio.ReadTransport, though they read alike
        self._handle: asyncio.TimerHandle | None = None

    def hold(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Read `transport` again at the next tick."""
        if transport.is_closing() or not transport.is_reading():
            return
        transport.pause_reading()
        self.paused.append(transport)
        if self._handle is None:
            self._handle = loop.call_later(self.every_s, self.release)

    def release(self) -> None:
        """Read every held stream again (the tick)."""
        paused, self.paused, self._handle = self.paused, [], None
        for transport in paused:
            if not transport.is_closing():
                transport.resume_reading()


class EventStreamReader(StreamReader):
    """aiohttp's body reader for an event stream: read whole, without aiohttp's per-chunk bookkeeping."""

    __slots__ = ()

    def begin_http_chunk_receiving(self) -> None:
        pass

    def end_http_chunk_receiving(self) -> None:
        pass

    def _read_nowait(self, n: int) -> bytes:
        if n != -1:
            return super()._read_nowait(n)
        self._timer.assert_timeout()
        buffer = self._buffer
        data = buffer[0] if len(buffer) == 1 else b"".join(buffer)
        if self._buffer_offset:
            data, self._buffer_offset = data[self._buffer_offset :], 0
        buffer.clear()
        self._size = 0
        self._cursor += len(data)
        self._protocol.resume_reading()  # the buffer is empty: below any low water mark
        return data


class GatheredHandler(ResponseHandler):
    """aiohttp's connection protocol; an event stream's read that leaves its body open waits for the Gather's tick."""

    __slots__ = ("_gather", "_streamed")

    def __init__(self, loop: asyncio.AbstractEventLoop, gather: Gather):
        super().__init__(loop=loop)
        self._gather, self._streamed = gather, None

    def feed_data(self, data: Any, *size: int) -> None:  # a parsed response: (message, payload), and its size
        message, payload = data
        content_type = message.headers.get("Content-Type", "")
        self._streamed = payload if content_type.startswith("text/event-stream") else None
        if self._streamed is not None and type(payload) is StreamReader:
            payload.__class__, payload._http_chunk_splits = EventStreamReader, None
        super().feed_data(data, *size)

    def resume_reading(self, resume_parser: bool = True) -> None:
        """Only when paused: aiohttp calls it after every HTTP chunk, undoing the Gather's hold."""
        if self._reading_paused:
            super().resume_reading(resume_parser)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        streamed = self._streamed
        if streamed is None:
            return
        if streamed.is_eof() or streamed is not self._payload:
            self._streamed = None  # held no longer than its body: the body points back at this protocol
        elif self._gather.every_s > 0 and self.transport is not None:
            self._gather.hold(self.transport, self._loop)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._streamed = None
        super().connection_lost(exc)


class GatheredConnector(aiohttp.TCPConnector):
    """A TCPConnector whose connections are GatheredHandlers (through aiohttp's `_factory`)."""

    def __init__(self, *, gather_s: float = GATHER_S, **kwargs: Any):
        super().__init__(**kwargs)
        # typeshed-wise a partial of ResponseHandler; a subclass is what aiohttp calls it with
        self._factory = functools.partial(GatheredHandler, loop=self._loop, gather=Gather(gather_s))  # type: ignore[assignment]


class Silence:
    """The deadline of one watched request: `first_token_timeout_s` from its start, then `stall_timeout_s` after
    every read. `async with silence:` around the request; past its deadline the Watchdog cancels it and it ends in
    TimeoutError, as under asyncio.timeout (without a timer per request)."""

    __slots__ = ("_cancelling", "_expired", "_task", "deadline", "started", "watch", "watchdog")

    def __init__(self, watch: Watch, watchdog: Watchdog):
        self.watch, self.watchdog, self.started = watch, watchdog, False
        self.deadline = math.inf
        self._task: asyncio.Task | None = None
        self._cancelling = 0
        self._expired = False

    async def __aenter__(self) -> Silence:
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        if self._task is None:
            raise RuntimeError("Silence watches a task")
        self._cancelling = self._task.cancelling()
        self.deadline = loop.time() + self.watch.first_token_timeout_s
        self.watchdog.add(self, loop)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.watchdog.discard(self)
        # as asyncio.Timeout.__aexit__: the cancel was ours unless another one came too
        if self._expired and self._task is not None and self._task.uncancel() <= self._cancelling:
            if exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def expire(self) -> None:
        """Past the deadline: the request is cancelled where it waits."""
        if not self._expired and self._task is not None:
            self._expired = True
            self._task.cancel()

    @property
    def expired(self) -> bool:
        """The request was cut by this deadline (not by any other timeout)."""
        return self._expired

    def why(self) -> str:
        return (
            f"no token for {self.watch.stall_timeout_s:g}s"
            if self.started
            else f"no first token for {self.watch.first_token_timeout_s:g}s"
        )

    async def read(self, resp: aiohttp.ClientResponse, answer: ChatAnswer | GenerateAnswer) -> bool:
        """Read an SSE response into `answer` until its `data: [DONE]`; True when the answer stopped it (a loop).
        Each read moves the deadline; events are decoded in batches (Frames): per read while the runaway rule
        watches, else at the end or every FOLD_BYTES."""
        if self._task is None:
            raise RuntimeError("Silence.read reads inside `async with silence:` only")
        clock, stall = asyncio.get_running_loop().time, self.watch.stall_timeout_s
        frames, watching, content = Frames(), self.watch.watches_runaways, resp.content
        while data := await content.readany():  # b"" at the end of the body
            self.deadline, self.started = clock() + stall, True
            if (frames.add(data) or watching or frames.size >= FOLD_BYTES) and answer.fold(frames.take()):
                return True
            if frames.done:
                return False
        stopped = answer.fold(frames.take())  # whatever the last reads held
        if stopped or frames.done:
            return stopped
        raise aiohttp.ClientPayloadError("the stream ended before data: [DONE]")


class Frames:
    """The `data:` payloads of an SSE body, kept as bytes and decoded in batches."""

    __slots__ = ("done", "reads", "rest", "size")

    def __init__(self) -> None:
        self.reads: list[bytes] = []
        self.size = 0  # bytes not taken yet
        self.rest = b""  # an incomplete last line
        self.done = False  # `data: [DONE]` was taken: nothing after it is read

    def add(self, data: bytes) -> bool:
        """Keep one read; True when it ends the stream (SGLang writes `data: [DONE]` on its own, last)."""
        self.reads.append(data)
        self.size += len(data)
        return data.endswith(DONE_EVENT)

    def take(self) -> list[bytes]:
        """The payloads of the whole lines kept so far, up to `[DONE]`."""
        if not self.reads:
            return []
        *lines, self.rest = (self.rest + b"".join(self.reads)).split(b"\n")
        self.reads, self.size = [], len(self.rest)
        payloads = [line[len(DATA) :] for line in lines if line.startswith(DATA)]
        if DONE in payloads:
            self.done = True
            del payloads[payloads.index(DONE) :]
        return payloads


def _decoded(decoder: msgspec.json.Decoder, payloads: list[bytes]) -> list:
    """The events of a batch of payloads, decoded as one JSON array; an error event raises StreamError."""
    events = decoder.decode(b"[" + b",".join(payloads) + b"]") if payloads else []
    for event in events:
        if event.error is not None:
            raise StreamError(event.error)
    return events


class Delta(msgspec.Struct, gc=False):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None  # with a tool-call parser: a call's id and name, then its arguments


class Choice(msgspec.Struct, gc=False):
    delta: Delta | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class Usage(msgspec.Struct, gc=False):
    """A chunk's usage: the fields a row reads (generation/engine.make_row, continuation), the rest skipped."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    reasoning_tokens: int | None = None
    prompt_tokens_details: dict | None = None
    completion_tokens_details: dict | None = None


class ChatChunk(msgspec.Struct, gc=False):
    """What the pipeline reads of a `chat.completion.chunk` (the rest is skipped); untracked by the gc."""

    choices: list[Choice] | None = None
    usage: Usage | None = None
    sglext: dict | None = None
    error: Any = None


class GenerateChunk(msgspec.Struct, gc=False):
    """A /generate event: {text, output_ids, meta_info}, or {error}."""

    text: str | None = None
    output_ids: list[int] | None = None
    meta_info: dict | None = None
    error: Any = None


_chat_chunks = msgspec.json.Decoder(list[ChatChunk])
_generate_chunks = msgspec.json.Decoder(list[GenerateChunk])


class ChatAnswer:
    """A streamed chat completion, assembled into the non-streamed ChatCompletionResponse shape."""

    __slots__ = (
        "chars",
        "content",
        "finish_reason",
        "matched_stop",
        "reasoning",
        "runaway",
        "sglext",
        "tokens",
        "tool_calls",
        "usage",
    )

    def __init__(self, watch: Watch):
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.chars = 0
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None
        self.usage: Usage | None = None
        self.sglext: dict = {}
        self.tool_calls: dict[int, dict] = {}  # index -> the call assembled from its deltas
        self.tokens = 0
        self.runaway = Runaway(watch)

    def text(self) -> str:
        """What the runaway rule judges: the answer, or the reasoning while no answer has come (runaway_sql)."""
        return "".join(self.content) if self.content else "".join(self.reasoning)

    def fold(self, payloads: list[bytes]) -> bool:
        """Take a batch of events in; True when the stream is to be stopped (a loop)."""
        for event in _decoded(_chat_chunks, payloads):
            if event.usage is not None:
                self.usage = event.usage
                self.tokens = event.usage.completion_tokens or self.tokens
            if event.sglext:
                self.sglext = event.sglext
            for choice in event.choices or ():
                delta = choice.delta
                thought, answer = (delta.reasoning_content, delta.content) if delta is not None else (None, None)
                for call in (delta.tool_calls if delta is not None else None) or ():
                    self.add_call(call)
                if thought:
                    self.reasoning.append(thought)
                    if not self.content:
                        self.chars += len(thought)
                if answer:
                    if not self.content:  # the answer begins: from now on it is what is judged
                        self.chars, self.runaway.positions = 0, Tokens()
                    self.content.append(answer)
                    self.chars += len(answer)
                if choice.finish_reason is not None:  # finished: no rule to apply (the sglext and usage follow)
                    self.finish_reason, self.matched_stop = choice.finish_reason, choice.matched_stop
                elif (thought or answer) and self.runaway.looping(self.text, self.chars, self.tokens):
                    return True
        return False

    def add_call(self, delta: dict) -> None:
        """A tool-call delta into its call (by index): id and name from the first, the arguments appended."""
        call = self.tool_calls.setdefault(delta.get("index") or 0, {"type": "function", "function": {"arguments": ""}})
        function = delta.get("function") or {}
        if delta.get("id"):
            call["id"] = delta["id"]
        if function.get("name"):
            call["function"]["name"] = function["name"]
        call["function"]["arguments"] += function.get("arguments") or ""

    def response(self, stopped: bool) -> dict:
        ext = self.sglext
        usage = msgspec.structs.asdict(self.usage) if self.usage is not None else {}
        if stopped:  # closed by us: the tokens decoded so far (continuous usage), no final usage chunk came
            usage = {**usage, "completion_tokens": self.tokens}
        content = "".join(self.content)
        choice = {
            "index": 0,
            "message": {
                "role": "assistant",
                # the reply's content where the parser took calls out: the text before them, stripped (Qwen25Detector)
                "content": content.strip() if self.tool_calls else content,
                "reasoning_content": "".join(self.reasoning) or None,
                **({"tool_calls": [self.tool_calls[k] for k in sorted(self.tool_calls)]} if self.tool_calls else {}),
            },
            "finish_reason": RUNAWAY_FINISH if stopped else self.finish_reason,
            "matched_stop": None if stopped else self.matched_stop,
        }
        if ext.get("input_ids") is not None:
            choice["prompt_token_ids"] = ext["input_ids"]
        if ext.get("output_ids"):
            choice["response_token_ids"] = ext["output_ids"][0]
        if stopped:
            choice["loop_start_tokens"] = self.runaway.loop_start_tokens
        return {"choices": [choice], "usage": usage}


class GenerateAnswer:
    """A streamed /generate answer, assembled into the non-streamed {text, output_ids, meta_info} shape."""

    __slots__ = ("chars", "meta_info", "output_ids", "runaway", "text_parts")

    def __init__(self, watch: Watch):
        self.text_parts: list[str] = []
        self.output_ids: list[int] = []
        self.meta_info: dict = {}
        self.chars = 0
        self.runaway = Runaway(watch)

    def text(self) -> str:
        return "".join(self.text_parts)

    def fold(self, payloads: list[bytes]) -> bool:
        for event in _decoded(_generate_chunks, payloads):
            ids, self.meta_info = event.output_ids or [], event.meta_info or {}
            tokens = self.meta_info.get("completion_tokens", len(self.output_ids) + len(ids))
            text = event.text or ""
            if len(ids) == tokens:  # cumulative (SGLang's default): this event holds everything so far
                self.output_ids, self.text_parts, self.chars = ids, [text], len(text)
            else:  # --incremental-streaming-output: a delta
                self.output_ids += ids
                self.text_parts.append(text)
                self.chars += len(text)
            if self.meta_info.get("finish_reason") is None and self.runaway.looping(
                self.text, self.chars, len(self.output_ids)
            ):
                return True
        return False

    def response(self, stopped: bool) -> dict:
        meta = dict(self.meta_info)
        if stopped:
            meta["finish_reason"] = {"type": RUNAWAY_FINISH, "loop_start_tokens": self.runaway.loop_start_tokens}
            meta["completion_tokens"] = len(self.output_ids)
        return {"text": self.text(), "output_ids": self.output_ids, "meta_info": meta}


class StreamError(Exception):
    """An error event inside a 200 stream: `{"error": {"message", "type", "code"}}`."""

    def __init__(self, error: Any):
        error = error if isinstance(error, dict) else {"message": error}
        super().__init__(str(error.get("message", error)))
        self.message = str(error.get("message", error))
        self.code = error.get("code")


def chat_stream_body(body: dict, watch: Watch) -> dict:
    """The chat body, streamed: the usage chunk, ids through sglext, usage per chunk when the runaway rule counts."""
    body = dict(body)
    ids = body.pop("return_token_ids", False)
    if ids:
        body |= {"return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
    return body | {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": watch.watches_runaways},
    }
