"""The stand-in model's tokenizer and Qwen3.5-style chat template.

A word-level vocabulary with byte fallback, so `decode(encode(s)) == s`; special tokens split out before
pre-tokenisation, as Hugging Face does with added tokens. Built in code: nothing is downloaded.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import cast

from . import tool_calls

IM_START, IM_END, THINK, THINK_END, ENDOFTEXT = (
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|endoftext|>",
)
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK, THINK_END)
# dropped by skip_special_tokens; <think> and </think> are plain added tokens in Qwen, kept in decoded text
_SKIPPED_SPECIALS = (ENDOFTEXT, IM_START, IM_END)

# the common English words of the vocabulary, in their order (a data file beside this module)
_COMMON_WORDS = (Path(__file__).parent / "common_words.txt").read_text().split()

_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl pr sh st th tr".split()  # noqa: SIM905
_VOWELS = "a e i o u ai ea io ou".split()  # noqa: SIM905
_CODAS = ["", "", "n", "r", "s", "l", "m", "nd", "st", "th"]


def _syllable_words(count: int) -> list[str]:
    """`count` distinct pseudo-words from a fixed LCG: deterministic, no data."""
    words: list[str] = []
    seen = set(_COMMON_WORDS)
    state = 0x2545F491
    while len(words) < count:
        parts = []
        for _ in range(1 + ((state >> 7) % 10 < 7)):  # 30% one syllable, 70% two
            state = (state * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
            parts.append(
                _ONSETS[(state >> 33) % len(_ONSETS)]
                + _VOWELS[(state >> 41) % len(_VOWELS)]
                + _CODAS[(state >> 49) % len(_CODAS)]
            )
        word = "".join(parts)
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


_COMMON = tuple(dict.fromkeys(_COMMON_WORDS))
N_COMMON_WORDS = len(_COMMON)
WORDS: tuple[str, ...] = _COMMON + tuple(_syllable_words(3600))
_PUNCT = [".", ",", "?", "!", ":", ";", "'", '"', "(", ")", "-", "...", "*", "#", "`", "/"]
_SPACES = ["\n", "\n\n", " ", "  ", "\t", "\n\n\n"]
_DIGITS = [str(d) for d in range(10)]


def _regular_tokens() -> list[str]:
    toks: list[str] = []
    for w in WORDS:
        cap = w[:1].upper() + w[1:]
        toks += [" " + w, w, " " + cap, cap]
    toks += _PUNCT + [" " + p for p in _PUNCT] + _DIGITS + [" " + d for d in _DIGITS] + _SPACES
    return list(dict.fromkeys(toks))


# ids: 0..255 the byte tokens, then the regular vocabulary, then specials (at the top, as in Qwen)
_REGULAR = _regular_tokens()
VOCAB: dict[str, int] = {t: 256 + i for i, t in enumerate(_REGULAR)}
SPECIAL_IDS: dict[str, int] = {t: 256 + len(_REGULAR) + i for i, t in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = 256 + len(_REGULAR) + len(SPECIAL_TOKENS)
IM_START_ID, IM_END_ID = SPECIAL_IDS[IM_START], SPECIAL_IDS[IM_END]
THINK_ID, THINK_END_ID, ENDOFTEXT_ID = SPECIAL_IDS[THINK], SPECIAL_IDS[THINK_END], SPECIAL_IDS[ENDOFTEXT]
SKIPPED_SPECIAL_IDS = frozenset(SPECIAL_IDS[t] for t in _SKIPPED_SPECIALS)

# Token id -> its UTF-8 bytes (byte tokens are single raw bytes).
TOKEN_BYTES: list[bytes] = (
    [bytes([b]) for b in range(256)] + [t.encode() for t in _REGULAR] + [t.encode() for t in SPECIAL_TOKENS]
)
# Token id -> str, for tokens that are whole strings (not lone bytes >= 0x80).
TOKEN_STR: list[str] = [b.decode("latin-1") if i < 256 else b.decode() for i, b in enumerate(TOKEN_BYTES)]

_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
# GPT-2-like pre-tokeniser: words with a leading space, digits, punctuation runs, whitespace
_PRETOKEN = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
_vocab_get = VOCAB.get


def _encode_plain(segment: str, out: list[int]) -> None:
    pieces = _PRETOKEN.findall(segment)
    ids = list(map(_vocab_get, pieces))
    if None not in ids:
        out += cast(list[int], ids)  # no None in it
        return
    for piece, tid in zip(pieces, ids):
        if tid is None:
            out += piece.encode("utf-8", "surrogatepass")  # byte ids are the bytes
        else:
            out.append(tid)


@functools.lru_cache(maxsize=256)  # /v1/tokenize then chat render the same prompt
def _encode_cached(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for i, seg in enumerate(_SPECIAL_SPLIT.split(text)):
        if i % 2:
            out.append(SPECIAL_IDS[seg])
        elif seg:
            _encode_plain(seg, out)
    return tuple(out)


def encode(text: str) -> list[int]:
    """Token ids of `text` (no BOS: Qwen adds none)."""
    return list(_encode_cached(text))


_ID_STR = [str(i) for i in range(VOCAB_SIZE)]


def ids_csv(ids: list[int]) -> str:
    """Comma-joined ids for hand-written JSON, of ids this model generated (joined from cached strings)."""
    return ",".join(map(_ID_STR.__getitem__, ids))


def decode(ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    if skip_special_tokens:
        ids = [i for i in ids if i not in SKIPPED_SPECIAL_IDS]
    n = len(TOKEN_BYTES)
    raw = b"".join([TOKEN_BYTES[i] if 0 <= i < n else b"" for i in ids])
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:  # arbitrary byte ids need not form valid UTF-8
        return raw.decode("utf-8", "replace")


# ---- chat template (Qwen3.5 style) -------------------------------------------------

GENERATION_PROMPT = f"{IM_START}assistant\n"
THINK_OPEN = f"{THINK}\n"
THINK_SKIPPED = f"{THINK}\n\n{THINK_END}\n\n"
# The same markers as token ids, for the model to find them in a prompt.
GENERATION_PROMPT_IDS = tuple(encode(GENERATION_PROMPT))
THINK_OPEN_IDS = tuple(encode(THINK_OPEN))
THINK_SKIPPED_IDS = tuple(encode(THINK_SKIPPED))


def message_text(content) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def _split_reasoning(message: dict) -> tuple[str, str]:
    """(reasoning, content) of an assistant message: `reasoning_content`, else split at `</think>` (Qwen3)."""
    content = message_text(message.get("content"))
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning, content
    if THINK_END in content:
        before, after = content.split(THINK_END)[0], content.split(THINK_END)[-1]
        return before.rstrip("\n").split(THINK)[-1].lstrip("\n"), after.lstrip("\n")
    return "", content


def _last_query(messages: Sequence[dict]) -> int:
    """The index of the last user turn that is not a tool response (Qwen3's `ns.last_query_index`)."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        text = m.get("content")
        if m.get("role") == "user" and isinstance(text, str):
            if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
                return i
    return len(messages) - 1


# Qwen2.5's template's default system turn: what the `qwen3.5-default-system` variant puts first
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def apply_chat_template(
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    variant: str = "qwen3.5",
    tools: Sequence[dict] | None = None,
) -> str:
    """Render messages as Qwen3's chat template does (`tokenizer_config.json`), with Qwen3.5's generation prompt:
    an assistant turn after the last user turn keeps its reasoning in a think block, an earlier one its content
    only; the header pre-opens `<think>\\n` when thinking, an empty think block when not. The
    `qwen3.5-default-system` variant puts DEFAULT_SYSTEM first when there is no system turn. With `tools`, the
    system turn holds them, tool_calls follow an assistant's content, and tool results are `<tool_response>` blocks."""
    if variant == "qwen3.5-default-system" and (not messages or messages[0].get("role") != "system"):
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    last_query = _last_query(messages)
    parts = []
    if tools:
        system = message_text(messages[0].get("content")) if messages and messages[0].get("role") == "system" else None
        parts.append(f"{IM_START}system\n{tool_calls.tools_block(list(tools), system)}{IM_END}\n")
    for i, m in enumerate(messages):
        role = m.get("role", "")
        if role == "system" and i == 0 and tools:
            continue
        if role == "tool":
            first, last = (
                i == 0 or messages[i - 1].get("role") != "tool",
                i + 1 == len(messages) or messages[i + 1].get("role") != "tool",
            )
            response = f"\n<tool_response>\n{message_text(m.get('content'))}\n</tool_response>"
            parts.append((f"{IM_START}user" if first else "") + response + (f"{IM_END}\n" if last else ""))
            continue
        if role != "assistant":
            parts.append(f"{IM_START}{role}\n{message_text(m.get('content'))}{IM_END}\n")
            continue
        reasoning, content = _split_reasoning(m)
        if i > last_query and (i == len(messages) - 1 or reasoning):
            body = f"{THINK}\n{reasoning.strip(chr(10))}\n{THINK_END}\n\n{content.lstrip(chr(10))}"
        else:
            body = content
        body += tool_calls.rendered_calls(content, m.get("tool_calls") or [])
        parts.append(f"{IM_START}assistant\n{body}{IM_END}\n")
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT + (THINK_OPEN if enable_thinking else THINK_SKIPPED))
    return "".join(parts)
