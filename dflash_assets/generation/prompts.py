"""Read a prompt source (JSONL or Parquet, in any of FORMATS: docs/prompts.md) one shard at a time, validating every
line. Shard k holds source lines [k*size, (k+1)*size); each line becomes a `Prompt` or a `SourceReject` with a
reason, so lines in the shard = prompts + rejects. Nothing loads the whole source into memory.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow.parquet as pq

from dflash_assets.generation.tools import (
    CALL_SPEAKERS,
    RESULT_SPEAKERS,
    answer_calls,
    read_calls,
    read_tools,
    sharegpt_calls,
)

# ShareGPT speakers (`from`) and the OpenAI role each one is; anything else is rejected, naming the speaker
SPEAKERS = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "system": "system",
}
ROLES = ("system", "user", "assistant", "tool")
# What a record's format is, from the keys it has (the first that applies); a mapping in config overrides it
FORMATS = ("openai_batch", "messages", "conversations", "sharegpt", "prompt", "mapped")
SOURCE_COLUMNS = ("id", "messages", "conversations", "prompt", "custom_id", "body", "source", "tools")


class SourceError(Exception):
    """A problem with the prompt source as a whole (missing, empty, unreadable, wrong columns)."""


@dataclass(frozen=True)
class FieldMapping:
    """Column names for a source that fits none of the known formats (its messages: {role, content} or {from, value})."""

    id_field: str | None = None
    messages_field: str | None = None

    def columns(self) -> list[str]:
        return [c for c in (self.id_field, self.messages_field) if c]


@dataclass(frozen=True)
class Prompt:
    line: int  # 1-based line (JSONL) or row (Parquet) number in the source
    prompt_id: str
    source: str
    messages: list[dict]  # the whole conversation: system?, then user/assistant alternating, from the user
    format: str = "messages"  # one of FORMATS: how the line was written
    tools: list[dict] | None = None  # the line's tool schemas (generation/tools.py), None for a tool-free line

    @property
    def messages_json(self) -> str:
        return canonical_json(self.messages)

    @property
    def tools_json(self) -> str | None:
        return canonical_json(self.tools) if self.tools else None

    @property
    def request(self) -> list[dict]:
        return last_turn_request(self.messages)


@dataclass(frozen=True)
class SourceReject:
    line: int
    reason: str
    prompt_id: str | None = None
    prompt_tokens: int | None = None  # counted: a prompt longer than the context


def canonical_json(value) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def content_id(messages: list[dict]) -> str:
    return hashlib.sha256(canonical_json(messages).encode()).hexdigest()[:16]


def last_turn_request(messages: list[dict]) -> list[dict]:
    """What `regenerate: last_turn` sends: the conversation up to its last user turn."""
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]


def carries_history(messages: list[dict]) -> bool:
    """Whether a conversation holds an assistant turn before its last user turn (kept by `regenerate: last_turn`)."""
    return any(m["role"] == "assistant" for m in last_turn_request(messages))


@dataclass(frozen=True)
class SourceTurns:
    """What `regenerate: auto` resolves by: the source's prompts, and how many carry earlier assistant turns."""

    prompts: int
    with_history: int
    complete: bool = True  # False: the scan stopped at the first prompt with history (`first_only`)


@functools.lru_cache(maxsize=8)
def _source_turns(path: str, size: int, mtime_ns: int, mapping: FieldMapping | None, first_only: bool) -> SourceTurns:
    prompts = with_history = 0
    for item in read_shard(Path(path), 0, 2**62, mapping):
        if isinstance(item, Prompt):
            prompts += 1
            if carries_history(item.messages):
                with_history += 1
                if first_only:
                    return SourceTurns(prompts, with_history, complete=False)
    return SourceTurns(prompts, with_history)


def source_turns(path: str | Path, mapping: FieldMapping | None = None, first_only: bool = False) -> SourceTurns:
    """Scan the whole source (cached per file size and mtime): its valid prompts and those carrying history.
    `first_only` stops at the first one that does (enough to resolve `auto`)."""
    path = Path(path)
    _check_file(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, mapping)
    first = _source_turns(*key, True)
    return first if first_only or first.complete else _source_turns(*key, False)


def no_prompt(path: str | Path, mapping: FieldMapping | None = None) -> str | None:
    """Why a source holds no prompt at all, with its first reject, in one line; None as soon as one line is one."""
    lines, first = 0, None
    for item in read_shard(Path(path), 0, 2**62, mapping):
        if isinstance(item, Prompt):
            return None
        lines, first = lines + 1, first or item
    said = f" (the first: {first.reason})" if first else ""
    return f"prompt source {path}: none of its {lines} lines is a prompt{said}; give a JSONL or Parquet file of prompts"


def shard_key(index: int) -> str:
    return f"{index:05d}"


def check_source(path: Path) -> None:
    """A prompt source that cannot be read is refused (SourceError) before any work, naming it."""
    path = Path(path)
    _check_file(path)
    try:
        path.open("rb").close()
    except OSError as e:
        raise SourceError(f"prompt source {path} is unreadable: {e.strerror}") from None


def _check_file(path: Path) -> None:
    if not path.exists():
        raise SourceError(f"prompt source {path} does not exist")
    if not path.is_file():
        raise SourceError(f"prompt source {path} is not a file")
    if path.stat().st_size == 0:
        raise SourceError(f"prompt source {path} is empty")
    if path.suffix not in (".jsonl", ".parquet"):
        raise SourceError(f"prompt source {path}: unsupported format {path.suffix!r} (use .jsonl or .parquet)")


def count_rows(path: Path) -> int:
    """Lines of a JSONL file (a final line without newline counts) or rows of a Parquet file."""
    path = Path(path)
    _check_file(path)
    if path.suffix == ".parquet":
        return _parquet_file(path).metadata.num_rows
    n, last = 0, b"\n"
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                n += chunk.count(b"\n")
                last = chunk[-1:]
    except OSError as e:
        raise SourceError(f"prompt source {path} is unreadable: {e}") from None
    return n + (last != b"\n")


def shard_keys(path: Path, shard_size: int) -> list[str]:
    if shard_size <= 0:
        raise SourceError(f"shard size must be a positive integer, got {shard_size}")
    rows = count_rows(path)
    return [shard_key(i) for i in range(-(-rows // shard_size))]


def unwritable(text: str) -> str | None:
    """Why a decoded string cannot be written back as UTF-8, or None: JSON may escape a lone UTF-16 surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate {text[e.start]!r} at character {e.start} (not valid Unicode)"
    return None


def _text(value, what: str) -> tuple[str, str | None]:
    """(the string, None) or ("", why it is not a usable non-empty string)."""
    if not isinstance(value, str):
        return "", f"{what} must be a string, got {type(value).__name__}"
    if not value.strip():
        return "", f"{what} is empty"
    if "\x00" in value:
        return "", f"{what} contains a NUL byte"
    if bad := unwritable(value):
        return "", f"{what} holds {bad}"
    return value, None


def _record_format(record: dict, mapping: FieldMapping | None) -> tuple[str | None, object]:
    """(format, the raw messages or prompt) of one record, by the keys it has; (None, None) when none fits."""
    if mapping and mapping.messages_field:
        return "mapped", record.get(mapping.messages_field)
    if "custom_id" in record and "body" in record:
        body = record["body"]
        return "openai_batch", body.get("messages") if isinstance(body, dict) else body
    for key in ("messages", "conversations", "prompt"):
        if key in record:
            return key, record[key]
    return None, None


def _turns(raw, field_name: str, tools: list[dict] | None = None) -> tuple[list[dict], str | None, str | None]:
    """(messages as {role, content} (and tool_calls, tool_call_id), "role" or "from" keys, None) or ([], _, why)."""
    if not isinstance(raw, list):
        return [], "", f"{field_name!r} must be a list, got {type(raw).__name__}"
    if not raw:
        return [], "", f"{field_name!r} is empty"
    clean: list[dict] = []
    style: str | None = None
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            return [], "", f"message {i} is not an object"
        m = {k: v for k, v in m.items() if v is not None}  # a Parquet struct holds every key, unused ones null
        keys = "from" if "from" in m or "value" in m else "role"
        if "from" in m and "role" in m:
            return [], "", f"message {i} has both 'role' and 'from'"
        if style is None:
            style = keys
        elif keys != style:
            return (
                [],
                "",
                (f"message {i} uses {_style(keys)} but message 0 uses {_style(style)}: mixed keys in one conversation"),
            )
        made = sum(len(c.get("tool_calls", ())) for c in clean)  # the conversation's calls so far: their ids
        message, why = _message(i, m, keys, tools, made)
        if why:
            return [], "", why
        clean.append(message)
    return clean, style, _shape_problem(clean)


def _message(i: int, m: dict, keys: str, tools: list[dict] | None, made: int) -> tuple[dict, str | None]:
    """(message i as {role, content} (and tool_calls, tool_call_id), None) or ({}, why it is not one)."""
    role: Any
    content: Any
    calls = m.get("tool_calls")
    if keys == "from":
        speaker = m.get("from")
        if speaker in CALL_SPEAKERS:
            role, content, calls = "assistant", "", sharegpt_calls(m.get("value"))
        elif speaker in RESULT_SPEAKERS:
            role, content = "tool", m.get("value")
        elif speaker in SPEAKERS:
            role, content = SPEAKERS[speaker], m.get("value")
        else:
            speakers = sorted([*SPEAKERS, *CALL_SPEAKERS, *RESULT_SPEAKERS])
            return {}, f"message {i} has unknown speaker {speaker!r} (expected one of {speakers})"
    else:
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return {}, f"message {i} has unknown role {role!r} (expected one of {list(ROLES)})"
    if role == "assistant" and calls is not None:  # a turn of tool calls: its content may be null
        tool_calls, why = read_calls(calls, f"message {i}", tools, made)
        text = content if isinstance(content, str) and not _text(content, "")[1] else ""
        return {"role": role, "content": text, "tool_calls": tool_calls}, why
    if role == "tool":  # a tool result: any string, an empty one too
        if not isinstance(content, str):
            return {}, f"message {i} content must be a string, got {type(content).__name__}"
        if bad := unwritable(content):
            return {}, f"message {i} content holds {bad}"
        given = m.get("tool_call_id")
        return {"role": role, "content": content, **({"tool_call_id": given} if isinstance(given, str) else {})}, None
    content, why = _text(content, f"message {i} content")
    return {"role": role, "content": content}, why


def _style(keys: str) -> str:
    return "'from'/'value'" if keys == "from" else "'role'/'content'"


def _shape_problem(messages: list[dict]) -> str | None:
    """Optional system turns, then user and assistant alternating from the user (the trainers' rule), tool results
    after an assistant turn of calls."""
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    if first is None:
        return "the conversation has only system messages, no user turn"
    if messages[first]["role"] in ("assistant", "tool"):
        return f"the conversation starts with the {messages[first]['role']} (message {first})"
    for i in range(first + 1, len(messages)):
        role, before = messages[i]["role"], messages[i - 1]["role"]
        if role == "system":
            return f"message {i} is a system message after the conversation started"
        if problem := _tool_turn_problem(messages, i):
            return problem
        if role == before and role != "tool":
            return f"alternation broken: message {i} is from the {role} again (message {i - 1} was too)"
    return None


def _tool_turn_problem(messages: list[dict], i: int) -> str | None:
    """Why message i breaks a tool turn (calls answered by their results, in order, then the assistant), or None."""
    role, before = messages[i]["role"], messages[i - 1]
    if before["role"] == "assistant" and before.get("tool_calls") and role != "tool":
        return f"message {i - 1} calls tools but message {i} is from the {role}, not a tool result"
    if role != "tool" or before["role"] == "tool":
        return None
    if not before.get("tool_calls"):
        return f"message {i} is a tool result, but message {i - 1} calls no tool"
    end = i
    while end < len(messages) and messages[end]["role"] == "tool":
        end += 1
    where = f"message {i}" if end - i == 1 else f"messages {i}-{end - 1}"
    if problem := answer_calls(before["tool_calls"], messages[i:end], where):
        return problem
    if end - i != len(before["tool_calls"]):
        return f"{where}: {end - i} tool result(s) for {len(before['tool_calls'])} tool call(s)"
    if end < len(messages) and messages[end]["role"] != "assistant":
        return f"message {end} is from the {messages[end]['role']} after tool results, not the assistant"
    return None


def parse_record(record, line: int, default_source: str, mapping: FieldMapping | None = None) -> Prompt | SourceReject:
    """Turn one source record (a decoded JSON value or a Parquet row) into a Prompt or a reason naming its line."""
    if not isinstance(record, dict):
        return SourceReject(line, f"line {line}: expected a JSON object, got {type(record).__name__}")
    fmt, raw = _record_format(record, mapping)
    id_key = mapping.id_field if mapping and mapping.id_field else "custom_id" if fmt == "openai_batch" else "id"
    given_id = record.get(id_key)
    if given_id is not None:
        if isinstance(given_id, bool) or not isinstance(given_id, (str, int)):
            return SourceReject(
                line, f"line {line}: {id_key} must be a string or integer, got {type(given_id).__name__}"
            )
        given_id = str(given_id)
        if not given_id.strip() or (bad := unwritable(given_id)):
            fault = "is empty" if not given_id.strip() else f"holds {bad}"
            return SourceReject(line, f"line {line}: {id_key} {fault}")

    def reject(reason: str) -> SourceReject:
        return SourceReject(line, f"line {line}: {reason}", given_id)

    if fmt is None:
        return reject("none of 'messages', 'conversations', 'prompt' or 'custom_id' + 'body' is present")
    name = {"openai_batch": "body.messages", "mapped": (mapping.messages_field or "") if mapping else ""}.get(fmt, fmt)
    if raw is None:
        return reject(f"{name!r} is missing or null")
    tools, why = read_tools(record.get("tools"))
    if why:
        return reject(why)
    style: str | None
    if fmt == "prompt":
        text, why = _text(raw, "'prompt'")
        if why:
            return reject(why)
        messages, style = [{"role": "user", "content": text}], "role"
    else:
        messages, style, why = _turns(raw, name, tools)
        if why:
            return reject(why)
        if fmt == "conversations" and style == "from":
            fmt = "sharegpt"
    source = record.get("source")
    source = source if isinstance(source, str) and source and not unwritable(source) else default_source
    return Prompt(line, given_id or content_id(messages), source, messages, fmt, tools)


def _parquet_file(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise SourceError(f"prompt source {path} is not a readable Parquet file: {e}") from None


LINE_STEP = 1024  # a JSONL source's line index holds the byte offset of every this many lines


@functools.lru_cache(maxsize=4)
def _line_index(path: Path, size: int, mtime_ns: int) -> array:
    """Byte offsets of lines 0, LINE_STEP, 2 * LINE_STEP, ... of a JSONL source, read once while it is unchanged: a
    shard's lines are read from near their own, not from the file's start (each shard skipping all before it made a
    backfill of a million lines quadratic)."""
    offsets, pos = array("q"), 0
    with path.open("rb") as f:
        for i, raw in enumerate(f):
            if i % LINE_STEP == 0:
                offsets.append(pos)
            pos += len(raw)
    return offsets


def _jsonl_lines(f: BinaryIO, path: Path, start: int, stop: int) -> Iterator[bytes]:
    """Lines `start` to `stop` (0-based, `stop` left out) of the JSONL source `path`, open as `f`."""
    st = path.stat()
    index = _line_index(path, st.st_size, st.st_mtime_ns)
    k = min(start // LINE_STEP, len(index) - 1)
    f.seek(index[k])
    return itertools.islice(f, start - k * LINE_STEP, stop - k * LINE_STEP)


def _jsonl_records(path: Path, start: int, stop: int) -> Iterator[tuple[int, object]]:
    try:
        with path.open("rb") as f:
            for line_no, raw in enumerate(_jsonl_lines(f, path, start, stop), start=start + 1):
                yield line_no, _decode_line(raw, line_no)
    except OSError as e:
        raise SourceError(f"prompt source {path} is unreadable: {e}") from None


def _decode_line(raw: bytes, line_no: int) -> object:
    """One JSONL line as a JSON value, or a SourceReject naming why it is not one (never an exception)."""
    try:
        text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a file's first line may open with a BOM
    except UnicodeDecodeError as e:
        return SourceReject(line_no, f"line {line_no}: invalid UTF-8 at byte {e.start}")
    if not text.strip():
        return SourceReject(line_no, f"line {line_no}: blank line")
    if "\x00" in text:
        return SourceReject(line_no, f"line {line_no}: contains a NUL byte")
    try:
        return json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        return SourceReject(line_no, f"line {line_no}: invalid JSON: {e.msg} (column {e.colno})")
    except ValueError as e:  # valid JSON Python will not decode: an integer of more than 4300 digits
        return SourceReject(line_no, f"line {line_no}: undecodable JSON: {str(e).split(';')[0]}")
    except RecursionError:  # valid JSON nested deeper than the interpreter's recursion limit
        return SourceReject(line_no, f"line {line_no}: undecodable JSON: nested too deeply")


def _parquet_records(path: Path, start: int, stop: int, mapping: FieldMapping | None) -> Iterator[tuple[int, object]]:
    pf = _parquet_file(path)
    names = set(pf.schema_arrow.names)
    wanted = list(dict.fromkeys([*SOURCE_COLUMNS, *(mapping.columns() if mapping else [])]))
    if mapping and (missing := [c for c in mapping.columns() if c not in names]):
        raise SourceError(
            f"prompt source {path}: the mapped column(s) {missing} are not in the Parquet file "
            f"(columns: {sorted(names)})"
        )
    if not (mapping and mapping.messages_field) and not names & {"messages", "conversations", "prompt", "body"}:
        raise SourceError(
            f"prompt source {path}: Parquet file has none of the columns 'messages', 'conversations', "
            f"'prompt' or 'body' (columns: {sorted(names)}); name the messages column with "
            f"messages_field"
        )
    for line, record in _parquet_rows(pf, start, stop, [c for c in wanted if c in names]):
        yield line, {k: v for k, v in record.items() if v is not None}


def _parquet_rows(
    pf: pq.ParquetFile, start: int, stop: int, columns: list[str] | None = None
) -> Iterator[tuple[int, dict]]:
    """(1-based row number, record) of rows [start, stop) of a Parquet file, a batch at a time."""
    row = 0
    for batch in pf.iter_batches(batch_size=4096, columns=columns):
        if row + batch.num_rows <= start:
            row += batch.num_rows
            continue
        for record in batch.to_pylist():
            if start <= row < stop:
                yield row + 1, record
            row += 1
        if row >= stop:
            return


def read_shard(
    path: Path, index: int, shard_size: int, mapping: FieldMapping | None = None, unique_ids: bool = True
) -> Iterator[Prompt | SourceReject]:
    """Prompts and rejects of shard `index`, in source order. Duplicate ids within the shard are rejected (not with
    `unique_ids` False: a pass over a whole source would hold every id)."""
    path = Path(path)
    _check_file(path)
    start, stop = index * shard_size, (index + 1) * shard_size
    records = (
        _parquet_records(path, start, stop, mapping) if path.suffix == ".parquet" else _jsonl_records(path, start, stop)
    )
    seen: dict[str, int] = {}
    for line, record in records:
        item = record if isinstance(record, SourceReject) else parse_record(record, line, path.stem, mapping)
        if isinstance(item, Prompt) and unique_ids:
            if item.prompt_id in seen:
                item = SourceReject(
                    line,
                    f"line {line}: duplicate id {item.prompt_id!r} (first seen on line {seen[item.prompt_id]})",
                    item.prompt_id,
                )
            else:
                seen[item.prompt_id] = line
        yield item


def shard_fingerprint(path: Path, index: int, shard_size: int, lines: int | None = None) -> tuple[int, str]:
    """(lines, fingerprint) of shard `index`: a hash of its raw lines (or of its first `lines`), what a prompt shard
    records of its source (store/source.py)."""
    path = Path(path)
    _check_file(path)
    start = index * shard_size
    stop = start + (shard_size if lines is None else min(lines, shard_size))
    digest, n = hashlib.sha256(), 0
    if path.suffix == ".parquet":
        for _, record in _parquet_rows(_parquet_file(path), start, stop):
            digest.update(json.dumps(record, sort_keys=True, default=str).encode() + b"\n")
            n += 1
    else:
        with path.open("rb") as f:
            for raw in _jsonl_lines(f, path, start, stop):
                digest.update(raw.rstrip(b"\r\n") + b"\n")  # a final line without its newline is the same line
                n += 1
    return n, digest.hexdigest()[:16]


def format_counts(items: list[Prompt | SourceReject]) -> dict[str, int]:
    """How many prompts of each format a shard held (the detected format, shown in prompt_shards metadata)."""
    counts = Counter(item.format for item in items if isinstance(item, Prompt))
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
