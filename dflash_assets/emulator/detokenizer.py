"""The text SGLang 0.5.23 sends for a request's output ids: its incremental detokenizer, step by step. Only the
non-ASCII mode needs it: a multi-byte character cut at a step or at the start of the output.

- `schedule_batch.Req.init_incremental_detokenize`: the first step decodes the output with the last 5 prompt ids
  and keeps `decode(surr + out)[len(decode(surr)):]`, a CHARACTER offset: a continuation whose prompt ends inside
  a character loses that character on both sides.
- `detokenizer_manager._decode_batch_token_id_output`: an unfinished step whose text ends in U+FFFD sends only
  `find_printable_text` of it; a finished step sends everything (a cut at the cap ends in U+FFFD).
- Byte-level BPE decodes as `String::from_utf8_lossy` (byte_level.rs), Python's `errors="replace"`.
Steps: every SGLANG_FORCE_STREAM_INTERVAL (50) tokens when not streamed, at the emulator's chunks when streamed.
"""

from __future__ import annotations

from . import tokenizer as tok

SURROUNDING_IDS = 5  # schedule_batch.INIT_INCREMENTAL_DETOKENIZATION_OFFSET
FORCE_STREAM_INTERVAL = 50  # environ.SGLANG_FORCE_STREAM_INTERVAL's default
REPLACEMENT = "\ufffd"


def _is_chinese_char(cp: int) -> bool:
    """sglang/utils.py `_is_chinese_char`: the CJK ideograph blocks."""
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def find_printable_text(text: str) -> str:
    """sglang/utils.py `find_printable_text`: what an unfinished step may send of text that ends mid-word."""
    if text.endswith("\n"):
        return text
    if text and _is_chinese_char(ord(text[-1])):
        return text
    if len(text) > 1 and _is_chinese_char(ord(text[-2])):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


def non_streamed_steps(n: int) -> list[int]:
    """Output lengths at which a non-streamed request of n output ids reaches the detokenizer."""
    return [*range(FORCE_STREAM_INTERVAL, n, FORCE_STREAM_INTERVAL), n]


def output_strs(
    input_ids: list[int],
    output_ids: list[int],
    steps: list[int],
    finish: dict | None,
    skip_special_tokens: bool = True,
    no_stop_trim: bool = False,
) -> list[str]:
    """The text the detokenizer sends at each step (output ids known then; the last, finished with `finish`)."""
    surr_start = max(len(input_ids) - SURROUNDING_IDS, 0)
    prefix = list(input_ids[surr_start:])
    surr_offset, read_offset = 0, len(prefix)
    decoded, sent = "", 0
    sent_strs: list[str] = []

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    for i, k in enumerate(steps):
        finished = i == len(steps) - 1
        decode_ids = prefix + list(output_ids[:k])
        read_ids = decode_ids[surr_offset:]
        if finished:
            read_ids = _trim_stop(read_ids, finish, no_stop_trim)
        new_text = decode(read_ids)[len(decode(decode_ids[surr_offset:read_offset])) :]
        if not finished:
            pending = sent - len(decoded)
            if new_text and not new_text.endswith(REPLACEMENT):  # clean: commit it and move the offsets on
                decoded += new_text
                surr_offset, read_offset = read_offset, len(decode_ids)
                sent = len(decoded)
                sent_strs.append(new_text[pending:])
            else:  # incomplete UTF-8: send the printable prefix only, commit nothing, retry with more ids
                printable = find_printable_text(new_text)
                sent = len(decoded) + len(printable)
                sent_strs.append(printable[pending:])
            continue
        output = _trim_stop(decoded + new_text, finish, no_stop_trim)
        sent_strs.append(output[sent:])
    return sent_strs


def _trim_stop(output, finish: dict | None, no_stop_trim: bool):
    """DetokenizerManager.trim_matched_stop: a matched stop string cut from the text, a stop token from the ids."""
    matched = (finish or {}).get("matched")
    if matched is None:
        return output
    if isinstance(matched, str) and isinstance(output, str):
        pos = output.find(matched)
        if pos == -1:
            return output
        return output[: pos + len(matched)] if no_stop_trim else output[:pos]
    if isinstance(matched, int) and isinstance(output, list) and not no_stop_trim:
        return output[:-1]
    return output
