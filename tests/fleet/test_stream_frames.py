"""A stream's bytes, cut anywhere by the socket, assemble the answer they assemble whole (fleet/stream.py Frames).

The reads of a real stream end wherever TCP cut it: inside an event, inside a UTF-8 character, inside `[DONE]`.
The body here is the emulator's own, one event per token and non-ASCII text, re-read in pieces of every size.
And what a streamed request leaves behind is freed by reference counts, not by the collector.
"""

import gc

import pytest

from dflash_assets.fleet.client import ChatResult, ServerClient
from dflash_assets.fleet.fleet import open_session, run
from dflash_assets.fleet.stream import ChatAnswer, Frames, Watch, chat_stream_body
from dflash_assets.generation.request import chat_body
from dflash_assets.generation.send import watch_of
from dflash_assets.settings import DispatchSettings, GenerationSettings
from tests.support.forks import start_emulator

pytestmark = pytest.mark.timeout(120)
WATCH = Watch(check_every_tokens=16, looping=lambda text: False)


def assemble(pieces: list[bytes], watch: Watch = WATCH) -> tuple[dict, Frames]:
    """What Silence.read does with each read: keep it, and fold what it completed (every read while watched)."""
    frames, answer = Frames(), ChatAnswer(watch)
    for piece in pieces:
        frames.add(piece)
        assert not answer.fold(frames.take())
        if frames.done:
            break
    return answer.response(False), frames


def test_a_stream_read_in_pieces_of_any_size_assembles_the_answer_it_assembles_whole(emulator):
    server = emulator("--reasoning-parser", "qwen3", "--non-ascii", "--stream-interval", "1", "--random-seed", "5")
    messages = [{"role": "user", "content": "pieces"}]
    body = chat_stream_body(chat_body(GenerationSettings(max_output_tokens=48), "m", messages, token_ids=True), WATCH)
    status, text = server.post("/v1/chat/completions", body)
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    raw = text.encode()
    whole, frames = assemble([raw])
    choice = whole["choices"][0]
    assert frames.done and choice["finish_reason"] in ("stop", "length")
    assert len(choice["response_token_ids"]) == whole["usage"]["completion_tokens"] > 1
    assert choice["message"]["reasoning_content"] and choice["prompt_token_ids"]
    assert any(ord(c) > 127 for c in choice["message"]["reasoning_content"] + choice["message"]["content"])
    for size in (1, 2, 3, 5, 13, 64, 1000):
        answer, frames = assemble([raw[i : i + size] for i in range(0, len(raw), size)])
        assert frames.done and answer == whole, size


def test_nothing_after_done_is_read_and_a_stream_cut_before_it_is_not_done():
    events = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: [DONE]\n\ndata: {"choices":[]}\n\n'
    frames = Frames()
    frames.add(events)
    assert len(frames.take()) == 1 and frames.done
    cut = Frames()
    cut.add(events[: events.index(b"[DONE]") + 3])
    assert len(cut.take()) == 1 and not cut.done


def test_a_streamed_request_leaves_no_reference_cycle_for_the_collector():
    """A cycle per request (an answer and its watch pointing at each other) is freed by the collector only, with the
    answer's token ids in it: 14 objects a request, and the collector's passes over them, before this test."""
    watch = watch_of(DispatchSettings())
    messages = [{"role": "user", "content": "cycles"}]
    body = chat_body(GenerationSettings(max_output_tokens=300), "m", messages, token_ids=True)

    async def requests(url: str, n: int) -> list[ChatResult]:
        async with open_session() as session:
            client = ServerClient(session, url)
            return [await client.chat(body, watch) for _ in range(n)]

    with start_emulator(["--reasoning-parser", "qwen3", "--length-median", "200"]) as server:
        run(requests(server.url, 2))  # the session, the loop and the imports' own objects made once
        gc.collect()
        gc.disable()
        try:
            answers = run(requests(server.url, 20))
            unreachable = gc.collect()
        finally:
            gc.enable()
    assert all(a.output_ids for a in answers)
    assert unreachable < 20, f"{unreachable} objects in reference cycles after 20 streamed requests"
