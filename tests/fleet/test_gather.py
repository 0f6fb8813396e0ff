"""Event streams read a tick at a time (fleet/stream.Gather, GatheredHandler), over real loopback HTTP.

1. The session's connections are GatheredHandlers: aiohttp still builds a connection's protocol with its
   connector's `_factory`, which GatheredConnector replaces.
2. Events the server writes while a stream is held wait in the kernel's buffer and come in one read at the tick:
   forced, the tick is released by the test once the server has written them (no timing).
3. No empty reads: aiohttp's StreamReader resumes its protocol after every chunk it hands out, and each resume
   parsed an empty read; a streamed answer of many events now costs its socket reads only.
4. An event stream's body is an EventStreamReader (read whole, not a chunk at a time); any other body keeps
   aiohttp's StreamReader. A part read first (read(n)) and the rest read whole add up to the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from dflash_assets.fleet.client import ChatResult, ServerClient
from dflash_assets.fleet.fleet import open_session, run
from dflash_assets.fleet.stream import EventStreamReader, Gather, GatheredConnector, GatheredHandler
from dflash_assets.generation.request import chat_body
from dflash_assets.generation.send import watch_of
from dflash_assets.settings import DispatchSettings, GenerationSettings
from tests.support.forks import start_emulator


class Counted(GatheredHandler):
    """A GatheredHandler that records each read it is given (what the socket brought, and the empty ones)."""

    reads: list[bytes]

    def data_received(self, data: bytes) -> None:
        Counted.reads.append(data)
        super().data_received(data)


def counted(connector: GatheredConnector, gather: Gather) -> GatheredConnector:
    Counted.reads = []
    connector._factory = functools.partial(Counted, loop=connector._loop, gather=gather)  # type: ignore[assignment]
    return connector


@contextlib.asynccontextmanager
async def serving(handler) -> AsyncIterator[str]:
    """`handler` at GET / of an aiohttp server on a loopback port; its URL."""
    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/"
    finally:
        await runner.cleanup()


def test_a_session_s_connections_are_gathered_handlers():
    async def go():
        finish = asyncio.Event()

        async def open_body(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            await resp.write(b"open")
            await finish.wait()  # the connection stays the response's while the test looks at it
            return resp

        async with serving(open_body) as url, open_session() as session, session.get(url) as resp:
            protocol = type(resp.connection.protocol) if resp.connection else None
            assert type(resp.content) is aiohttp.StreamReader  # not an event stream: aiohttp's own reader
            finish.set()
            assert await resp.read() == b"open"
            return protocol

    assert run(go()) is GatheredHandler


def test_events_written_while_a_stream_is_held_come_in_one_read_at_the_tick():
    events = [f"data: {{\"n\": {i}}}\n\n".encode() for i in range(4)]
    go_on, written, finish = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(events[0])
        await go_on.wait()
        for event in events[1:]:  # each written on its own, as SGLang writes its events
            await resp.write(event)
        written.set()
        await finish.wait()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def released(gather: Gather, read: asyncio.Future, content: aiohttp.StreamReader, before: int) -> bytes:
        """`read`'s bytes, the tick given by hand (its timer is an hour) while nothing past `before` bytes of the
        body has come: what holds the stream then is its headers' read, not the one the test looks at."""
        while not read.done():
            if content.total_bytes <= before:
                gather.release()
            await asyncio.sleep(0.01)
        return read.result()

    async def go():
        gather = Gather(3600.0)
        async with (
            serving(stream) as url,
            aiohttp.ClientSession(connector=counted(GatheredConnector(gather_s=3600.0), gather)) as session,
            session.get(url) as resp,
        ):
            first = await released(gather, asyncio.ensure_future(resp.content.readany()), resp.content, 0)
            assert first == events[0]
            assert resp.connection is not None and not resp.connection.transport.is_reading()  # held
            before = len(Counted.reads)
            go_on.set()
            await written.wait()  # the server wrote three events while the client read nothing
            assert len(Counted.reads) == before
            gather.release()
            rest = await resp.content.readany()
            later = [r for r in Counted.reads[before:] if r]
            finish.set()
            done = resp.content.total_bytes
            tail = await released(gather, asyncio.ensure_future(resp.content.read()), resp.content, done)
            return rest, later, tail

    rest, later, tail = run(go())
    assert rest == b"".join(events[1:])
    assert len(later) == 1 and all(e in later[0] for e in events[1:]), later  # the three events: one read
    assert tail == b"data: [DONE]\n\n"


def test_a_streamed_answer_costs_its_socket_reads_only_no_empty_ones():
    watch = watch_of(DispatchSettings())
    body = chat_body(GenerationSettings(max_output_tokens=300), "m", [{"role": "user", "content": "reads"}], True)

    async def requests(url: str, n: int) -> tuple[list[ChatResult], int]:
        connector = counted(GatheredConnector(), Gather(0.05))
        async with aiohttp.ClientSession(connector=connector) as session:
            client = ServerClient(session, url)
            return [await client.chat(body, watch) for _ in range(n)], len(Counted.reads)

    with start_emulator(["--reasoning-parser", "qwen3", "--length-median", "200", "--stream-interval", "8"]) as server:
        answers, reads = run(requests(server.url, 10))
    events = sum(len(a.output_ids) // 8 for a in answers)
    assert events >= 10 * 10  # many events a request (a chunk each) ...
    assert b"" not in Counted.reads and 0 < reads <= 3 * 10, Counted.reads[:5]  # ... and at most 3 reads a request


def test_an_event_stream_is_read_whole_and_a_part_read_first_adds_up():
    events = [f"data: {{\"n\": {i}, \"pad\": \"{'x' * i * 50}\"}}\n\n".encode() for i in range(6)]
    body = b"".join(events) + b"data: [DONE]\n\n"

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:  # a chunk each, as SGLang writes them
            await resp.write(event)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def go():
        async with serving(stream) as url, open_session() as session, session.get(url) as resp:
            reader = type(resp.content)
            first = await resp.content.read(6)  # b"data: ": a part of the first chunk, the rest of it left
            rest = b""
            while piece := await resp.content.readany():
                rest += piece
            return reader, first, rest, resp.content.at_eof()

    reader, first, rest, at_eof = run(go())
    assert reader is EventStreamReader
    assert first == b"data: " and first + rest == body and at_eof
