"""The stand-in model: a deterministic, autoregressive-consistent completion.

The uncapped completion is a pure function of the prompt tokens up to the LAST generation prompt
(`<|im_start|>assistant\\n` and its think opener) and of `sampling_seed`; tokens after it are output already
generated, so a continuation returns the next tokens of the same completion: continuing a truncated row equals
generating from scratch at the larger cap. Shape: `reasoning </think> \\n\\n answer <|im_end|>` (thinking) or
`answer <|im_end|>`; lognormal length, seeded by the prompt (`draw`: a request's own, temperature > 0 without a
seed). Text is sliced at word starts from one precomputed ASCII token stream, so every output re-tokenises to the
same ids; `non_ascii` uses a variant with byte-token em dashes (`_non_ascii_stream`).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import cast

from . import tokenizer as tok
from . import tool_calls

_NORMAL = NormalDist()

_NN_ID = tok.VOCAB["\n\n"]
_WORDS = ["report", "main", "data", "test"]  # the values of a stand-in tool call's string arguments


@dataclass(frozen=True)
class LengthModel:
    """Output lengths in tokens, `<|im_end|>` included; the defaults cut 18% at a 4096 cap, as the story's run."""

    median: float = 1640.0
    sigma: float = 1.0
    minimum: int = 16
    maximum: int = 32768
    reasoning_min: float = 0.50  # share of the body that is reasoning, when thinking
    reasoning_max: float = 0.85
    prompt_share: float = 0.5  # share of the log-length variance the prompt sets when sampling per request
    loop_share: float = 0.0  # share of prompts whose generation loops: one line repeated up to `maximum`

    def sample(self, u1: float, u2: float) -> int:
        z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)  # Box-Muller
        return self.length(z)

    def length(self, z: float) -> int:
        return max(self.minimum, min(self.maximum, round(self.median * math.exp(self.sigma * z))))

    def sample_drawn(self, u1: float, u2: float, draw: float, above: int = 0) -> int:
        """A request's draw: z = a * z_prompt + b * z_sample (a^2 + b^2 = 1: the same lognormal); with `above` > 0
        drawn from the lengths above it, as when continuing an answer `above` tokens long."""
        z_prompt = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
        a = math.sqrt(self.prompt_share)
        b = math.sqrt(1.0 - self.prompt_share)
        low = 0.0
        if above > 0 and b > 0:
            z_above = math.log((above + 0.5) / self.median) / self.sigma
            low = _NORMAL.cdf((z_above - a * z_prompt) / b)
        u = min(max(low + draw * (1.0 - low), 1e-12), 1.0 - 1e-12)
        return self.length(a * z_prompt + b * _NORMAL.inv_cdf(u))


# ---- the token stream all outputs are sliced from --------------------------------

_STREAM_LEN = 1 << 16


@functools.cache
def _stream() -> tuple[list[int], str, array, array]:
    """(ids, text, char offset of each id, word starts) of prose, stored twice over so no slice wraps."""

    # each word's two tokens (inside a sentence, capitalised) looked up once, not per word of the stream
    def tokens(words: Sequence[str]) -> tuple[list[int], list[int]]:
        return [tok.VOCAB[" " + w] for w in words], [tok.VOCAB[" " + w[:1].upper() + w[1:]] for w in words]

    (common, common_first), (words, words_first) = tokens(tok.WORDS[: tok.N_COMMON_WORDS]), tokens(tok.WORDS)
    state = 0x9E3779B97F4A7C15
    ids = array("i")
    append = ids.append

    def rnd(n: int) -> int:
        nonlocal state
        state = (state * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
        return (state >> 33) % n

    comma, period = tok.VOCAB[","], tok.VOCAB["."]
    sentence_in_para, para_len = 0, 3 + rnd(4)
    while len(ids) < _STREAM_LEN:
        n_words = 6 + rnd(13)
        for j in range(n_words):
            if rnd(5) < 2:
                k = rnd(len(common))
                append(common_first[k] if j == 0 else common[k])
            else:
                k = rnd(len(words))
                append(words_first[k] if j == 0 else words[k])
            if 0 < j < n_words - 1 and rnd(9) == 0:
                append(comma)
        append(period)
        sentence_in_para += 1
        if sentence_in_para == para_len:
            append(_NN_ID)
            sentence_in_para, para_len = 0, 3 + rnd(4)
    del ids[_STREAM_LEN:]
    while tok.TOKEN_STR[ids[-1]].isspace():  # the wrap must not join two whitespace tokens
        ids[-1] = period
    pieces = [tok.TOKEN_STR[i] for i in ids]
    text = "".join(pieces)
    offsets = array("q", itertools.accumulate(map(len, pieces), initial=0))
    starts = array("i", [i for i, t in enumerate(ids) if tok.TOKEN_STR[t][1:2].isalpha()])
    total = offsets[-1]
    doubled_offsets = offsets[:-1] + array("q", [o + total for o in offsets])
    # A list, not an array: slicing it shares the int objects instead of boxing new ones.
    return list(ids) * 2, text + text, doubled_offsets, starts


# ---- the non-ASCII variant of the stream (--non-ascii) ----------------------------

EM_DASH = " \u2014"  # " —": no token holds it, so it is 4 byte tokens (space, then the dash's 3 UTF-8 bytes)
_EM_DASH_IDS = tuple(tok.encode(EM_DASH))


@functools.cache
def _non_ascii_stream() -> tuple[list[int], array, bytearray]:
    """(ids stored twice, where each position of `_stream()` lands in them, steps forward out of a dash).

    `_stream()` with every other comma written " —", a character with no token: byte tokens a cap can cut. Derived
    from `_stream()` without touching its ids or RNG. A completion must not END inside a dash (it would re-tokenise
    to other ids), so `inside[p]` is how many tokens a boundary at p moves forward to clear it.
    """
    ids, _, _, _ = _stream()
    comma = tok.VOCAB[","]
    out: list[int] = []
    at = array("i")
    commas = 0
    for t in ids[:_STREAM_LEN]:
        at.append(len(out))
        if t == comma:
            commas += 1
            if commas % 2 == 0:
                out += _EM_DASH_IDS
                continue
        out.append(t)
    inside = bytearray(len(out))
    for g in (i for i, t in enumerate(out) if t == _EM_DASH_IDS[1]):
        for k in range(1, len(_EM_DASH_IDS)):
            inside[g - 1 + k] = len(_EM_DASH_IDS) - k  # a boundary after k tokens of the dash
    return out * 2, at, inside


def build_streams(non_ascii: bool) -> None:
    """Build the token streams the completions are cut from now, not inside the first request."""
    _stream()
    _loop_line()
    if non_ascii:
        _non_ascii_stream()


def _non_ascii_piece(offset: int, n: int) -> list[int]:
    """`n` tokens of the non-ASCII stream from `offset` (wraps around)."""
    ids, _, _ = _non_ascii_stream()
    length = len(ids) // 2
    out: list[int] = []
    offset %= length
    while n > 0:
        take = min(n, length)
        out += ids[offset : offset + take]
        n -= take
        offset = (offset + take) % length
    return out


def _clear_of_dash(position: int) -> int:
    """Tokens a completion boundary at this non-ASCII stream position moves forward so no dash is cut."""
    _, _, inside = _non_ascii_stream()
    return inside[position % len(inside)]


def _stream_piece(offset: int, n: int) -> tuple[list[int], str]:
    """`n` stream tokens from `offset` (any n; wraps around the stream)."""
    ids, text, offs, _ = _stream()
    out_ids: list[int] = []
    out_text: list[str] = []
    offset %= _STREAM_LEN
    while n > 0:
        take = min(n, _STREAM_LEN)
        out_ids += ids[offset : offset + take]
        out_text.append(text[offs[offset] : offs[offset + take]])
        n -= take
        offset = (offset + take) % _STREAM_LEN
    return out_ids, "".join(out_text)


# ---- prompt analysis and the completion plan --------------------------------------


def _find_last(ids: list[int], pattern: tuple[int, ...]) -> int:
    """Index just past the last occurrence of `pattern` in `ids`, or -1."""
    rev = ids[::-1]
    j = -1
    while True:
        try:
            j = rev.index(pattern[0], j + 1)
        except ValueError:
            return -1
        pos = len(ids) - 1 - j
        if tuple(ids[pos : pos + len(pattern)]) == pattern:
            return pos + len(pattern)


@dataclass(frozen=True)
class Plan:
    """The uncapped completion of one prompt, and where this request resumes it."""

    thinking: bool
    total: int  # tokens in the uncapped completion, final <|im_end|> included
    reasoning: int  # reasoning tokens before </think> (0 without thinking)
    reasoning_offset: int
    answer_offset: int
    resume_at: int  # output tokens the prompt already carries after the marker
    looping: bool = False  # a runaway: the same line over and over until `maximum` (a thinking model that loops)
    non_ascii: bool = False  # text from the non-ASCII stream (offsets above are positions of the ASCII one)
    calls: tuple[int, ...] = ()  # the answer is these tool-call ids (tool_calls.model_calls), not stream text


def plan_completion(
    prompt_ids: list[int],
    lengths: LengthModel,
    sampling_seed: int | None = None,
    sample: int = 0,
    draw: float | None = None,
    non_ascii: bool = False,
    tools: list[dict] | None = None,
) -> Plan:
    """The completion of `prompt_ids`; `sample` > 0 is the n-th parallel sample; `draw` in (0, 1) a request's own
    randomness (None: the prompt's fixed completion); `tools` the schemas the answer may call."""
    marker_end = _find_last(prompt_ids, tok.GENERATION_PROMPT_IDS)
    thinking = False
    if marker_end < 0:
        marker_end = len(prompt_ids)  # a raw prompt: all of it conditions, nothing resumed
    else:
        after = tuple(prompt_ids[marker_end : marker_end + len(tok.THINK_SKIPPED_IDS)])
        if after == tok.THINK_SKIPPED_IDS:
            marker_end += len(tok.THINK_SKIPPED_IDS)
        elif after[: len(tok.THINK_OPEN_IDS)] == tok.THINK_OPEN_IDS:
            marker_end += len(tok.THINK_OPEN_IDS)
            thinking = True
    digest = hashlib.blake2b(array("q", prompt_ids[:marker_end]).tobytes(), digest_size=40)
    if sampling_seed is not None:
        digest.update(struct.pack("<q", sampling_seed))
    if sample:
        digest.update(b"sample" + struct.pack("<q", sample))
    # whether it loops is its own draw (a copy of the digest), so the lengths of the other prompts stay as they were
    loop_digest = digest.copy()
    loop_digest.update(b"loop")
    looping = (int.from_bytes(loop_digest.digest()[:8], "little") + 0.5) / 2.0**64 < lengths.loop_share
    h = digest.digest()
    u = [(int.from_bytes(h[i : i + 8], "little") + 0.5) / 2.0**64 for i in (0, 8, 16, 24, 32)]
    carried = prompt_ids[marker_end:]  # output a continuation request already holds
    if looping:
        total = lengths.maximum
    elif draw is None:
        total = lengths.sample(u[0], u[1])
    else:
        total = lengths.sample_drawn(u[0], u[1], draw, above=len(carried) + (3 if thinking else 0))
    _, _, _, starts = _stream()
    reasoning = 0
    if thinking:
        total = max(total, 4)  # room for one reasoning word, </think>, \n\n, <|im_end|>
        share = lengths.reasoning_min + (lengths.reasoning_max - lengths.reasoning_min) * u[2]
        body = total - 3
        reasoning = total - 1 if looping else min(body - 1, max(1, round(share * body)))
        if draw is not None and carried and not looping:
            # a new draw must agree with the output carried: the thought closed where it did, or is still open
            closed = carried.index(tok.THINK_END_ID) if tok.THINK_END_ID in carried else None
            reasoning = closed if closed is not None else min(body - 1, max(reasoning, len(carried)))
            total = max(total, reasoning + 3)
    else:
        total = max(total, 2)
    reasoning_offset, answer_offset = starts[int(u[3] * len(starts))], starts[int(u[4] * len(starts))]
    if non_ascii and not looping:  # the thought and the answer end on whole characters (see _non_ascii_stream)
        _, at, _ = _non_ascii_stream()
        if thinking:
            reasoning += _clear_of_dash(at[reasoning_offset] + reasoning)
            total = max(total, reasoning + 3)
        answer_start = reasoning + 2 if thinking else 0
        total += _clear_of_dash(at[answer_offset] + total - 1 - answer_start)
    calls = _calls(digest.copy(), tools) if tools and not looping and not non_ascii and not carried else ()
    if calls:  # the answer is the calls: after the thought (and its </think>, \n\n), then <|im_end|>
        total = (reasoning + 2 if thinking else 0) + len(calls) + 1
    return Plan(
        calls=calls,
        thinking=thinking,
        total=total,
        reasoning=reasoning,
        reasoning_offset=reasoning_offset,
        answer_offset=answer_offset,
        resume_at=len(prompt_ids) - marker_end,
        looping=looping,
        non_ascii=non_ascii,
    )


def _calls(digest, tools: list[dict]) -> tuple[int, ...]:
    """The ids of the answer's tool calls, drawn from the prompt's hash apart from its length draws; () for text."""
    digest.update(b"tools")
    h = digest.digest()
    draws = [(int.from_bytes(h[i : i + 8], "little") + 0.5) / 2.0**64 for i in (0, 8, 16, 24)]
    text = tool_calls.model_calls(tools, draws, _WORDS)
    return tuple(tok.encode(text)) if text else ()


@functools.cache
def _loop_line() -> tuple[list[int], list[str]]:
    """The line a looping generation repeats: the stream's first sentence and a blank line (re-tokenises alike)."""
    ids, _, _, _ = _stream()
    start = ids.index(tok.VOCAB["."]) + 1
    end = ids.index(tok.VOCAB["."], start) + 1
    line = list(ids[start:end]) + [_NN_ID]
    return line, [tok.TOKEN_STR[i] for i in line]


def _loop_piece(phase: int, n: int) -> tuple[list[int], str]:
    """`n` tokens of the repeated line, from position `phase` of the repetition."""
    line, pieces = _loop_line()
    reps = (phase % len(line) + n) // len(line) + 1
    lo = phase % len(line)
    return (line * reps)[lo : lo + n], "".join((pieces * reps)[lo : lo + n])


def _segments(plan: Plan) -> list[tuple[int, int, int | tuple]]:
    """(start, stop, source) pieces of the completion: a stream offset, a special id, or the loop."""
    if plan.looping:  # reasoning (when thinking) that never closes: the line repeats to the end
        return [(0, plan.total - 1, ("loop",)), (plan.total - 1, plan.total, ("special", tok.IM_END_ID, ""))]
    reasoning_offset, answer_offset = plan.reasoning_offset, plan.answer_offset
    if plan.non_ascii:  # the same words, at their positions in the non-ASCII stream
        _, at, _ = _non_ascii_stream()
        reasoning_offset, answer_offset = at[reasoning_offset], at[answer_offset]
    answer: int | tuple = ("ids", plan.calls) if plan.calls else answer_offset
    if plan.thinking:
        r = plan.reasoning
        return [
            (0, r, reasoning_offset),
            (r, r + 1, ("special", tok.THINK_END_ID, tok.THINK_END)),
            (r + 1, r + 2, ("special", _NN_ID, "\n\n")),
            (r + 2, plan.total - 1, answer),
            (plan.total - 1, plan.total, ("special", tok.IM_END_ID, "")),
        ]
    return [
        (0, plan.total - 1, answer),
        (plan.total - 1, plan.total, ("special", tok.IM_END_ID, "")),
    ]


def completion_tokens(plan: Plan, start: int, stop: int) -> tuple[list[int], str]:
    """Tokens [start, stop) of the completion and their text (`<|im_end|>` decodes to "", past the end the answer
    stream goes on; non-ASCII: the ids decoded alone, a cut character as U+FFFD)."""
    ids: list[int] = []
    text: list[str] = []
    segments = _segments(plan)
    last_answer_start = segments[-2][0]
    answer_source = segments[-2][2]  # the answer's stream offset, unless it loops
    beyond: int | tuple = (
        ("loop",)
        if plan.looping
        else plan.answer_offset
        if plan.calls
        else cast(int, answer_source) + plan.total - 1 - last_answer_start
    )
    segments.append((plan.total, max(stop, plan.total), beyond))
    for seg_start, seg_stop, source in segments:
        lo, hi = max(start, seg_start), min(stop, seg_stop)
        if lo >= hi:
            continue
        if source == ("loop",):
            piece_ids, piece_text = _loop_piece(lo, hi - lo)
            ids += piece_ids
            text.append(piece_text)
        elif isinstance(source, tuple) and source[0] == "ids":  # a tool call: ASCII, whole characters at any cut
            piece = list(source[1][lo - seg_start : hi - seg_start])
            ids += piece
            text.append(tok.decode(piece))
        elif isinstance(source, tuple):
            ids.append(source[1])
            text.append(source[2])
        elif plan.non_ascii:
            ids += _non_ascii_piece(source + lo - seg_start, hi - lo)
        else:
            piece_ids, piece_text = _stream_piece(source + lo - seg_start, hi - lo)
            ids += piece_ids
            text.append(piece_text)
    if plan.non_ascii:
        return ids, tok.decode(ids, skip_special_tokens=True)
    return ids, "".join(text)


@dataclass(frozen=True)
class Generation:
    """What one request produces: ids, their text, and how it finished."""

    output_ids: list[int]
    text: str
    finish: dict  # SGLang's finish_reason JSON: {"type": "stop", "matched": id|str} | {"type": "length", "length": n}

    @functools.cached_property
    def reasoning_tokens(self) -> int:
        """count_reasoning_tokens of the whole output, counted once (a stream asks at every event)."""
        return count_reasoning_tokens(self.output_ids)


def generate(
    plan: Plan,
    max_new_tokens: int,
    *,
    ignore_eos: bool = False,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    no_stop_trim: bool = False,
) -> Generation:
    """Continue `plan` from its resume point for at most `max_new_tokens` tokens."""
    start = plan.resume_at
    if ignore_eos:
        end, natural_end = start + max_new_tokens, False
    else:
        natural = max(plan.total, start + 1)  # a prompt past the end gets <|im_end|> at once
        end = min(natural, start + max_new_tokens)
        natural_end = end == natural
    if natural_end and start >= plan.total:
        ids, text = [tok.IM_END_ID], ""
    else:
        ids, text = completion_tokens(plan, start, end)
    finish: dict = (
        {"type": "stop", "matched": tok.IM_END_ID} if natural_end else {"type": "length", "length": max_new_tokens}
    )
    if stop_token_ids:
        wanted = set(stop_token_ids)
        hit = next((i for i, t in enumerate(ids) if t in wanted), None)
        if hit is not None:
            ids = ids[: hit + 1]
            text = tok.decode(ids[: hit + (1 if no_stop_trim else 0)], skip_special_tokens=True)
            finish = {"type": "stop", "matched": ids[hit]}
    if stop:
        ids, text, finish = _apply_stop_strings(ids, text, finish, stop, no_stop_trim)
    return Generation(ids, text, finish)


def count_reasoning_tokens(output_ids: list[int]) -> int:
    """As SGLang's scheduler counts them: tokens up to and including the first `</think>`, else all of them."""
    try:
        return output_ids.index(tok.THINK_END_ID) + 1
    except ValueError:
        return len(output_ids)


def _apply_stop_strings(ids, text, finish, stops, no_stop_trim):
    """Cut at the earliest stop string, as the detokenizer does: ids to the match's last token, text before it."""
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return ids, text, finish
    pos, s = min(hits)
    end_char, acc = pos + len(s), 0
    end_byte = len(text[:end_char].encode())  # counted in bytes: a byte token is a part of a character
    for n, t in enumerate(ids, 1):  # noqa: B007 (n is read after the loop)
        acc += len(tok.TOKEN_BYTES[t]) if t != tok.IM_END_ID else 0
        if acc >= end_byte:
            break
    return ids[:n], text[: end_char if no_stop_trim else pos], {"type": "stop", "matched": s}
