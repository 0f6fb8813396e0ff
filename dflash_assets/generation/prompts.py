"""Read a prompt source (JSONL or Parquet) one shard at a time, validating every line.

A shard is a fixed range of source lines/rows: shard k holds lines [k*size, (k+1)*size). Each line
becomes either a `Prompt` or a `SourceReject` with a reason, so counts always add up:
lines in the shard = prompts + rejects. Nothing loads the whole source into memory.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

ROLES = {"system", "user", "assistant", "tool"}


class SourceError(Exception):
    """A problem with the prompt source as a whole (missing, empty, unreadable, wrong columns)."""


@dataclass(frozen=True)
class Prompt:
    line: int  # 1-based line (JSONL) or row (Parquet) number in the source
    prompt_id: str
    source: str
    messages: list[dict]

    @property
    def messages_json(self) -> str:
        return canonical_json(self.messages)


@dataclass(frozen=True)
class SourceReject:
    line: int
    reason: str
    prompt_id: str | None = None


def canonical_json(value) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def content_id(messages: list[dict]) -> str:
    return hashlib.sha256(canonical_json(messages).encode()).hexdigest()[:16]


def shard_key(index: int) -> str:
    return f"{index:05d}"


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


def parse_record(record, line: int, default_source: str) -> Prompt | SourceReject:
    """Turn one source record (a decoded JSON value or a Parquet row) into a Prompt or a reason."""
    if not isinstance(record, dict):
        return SourceReject(line, f"line {line}: expected a JSON object, got {type(record).__name__}")
    given_id = record.get("id")
    if given_id is not None and not isinstance(given_id, (str, int)):
        return SourceReject(line, f"line {line}: id must be a string or integer, got {type(given_id).__name__}")
    given_id = None if given_id is None else str(given_id)

    def reject(reason: str) -> SourceReject:
        return SourceReject(line, f"line {line}: {reason}", given_id)

    messages, prompt = record.get("messages"), record.get("prompt")
    if messages is None and prompt is None:
        return reject("neither 'messages' nor 'prompt' is present")
    if messages is None:
        if not isinstance(prompt, str):
            return reject(f"'prompt' must be a string, got {type(prompt).__name__}")
        messages = [{"role": "user", "content": prompt}]
    if not isinstance(messages, list):
        return reject(f"'messages' must be a list, got {type(messages).__name__}")
    if not messages:
        return reject("'messages' is empty")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return reject(f"message {i} is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return reject(f"message {i} has unknown role {role!r} (expected one of {sorted(ROLES)})")
        if not isinstance(content, str):
            return reject(f"message {i} content must be a string, got {type(content).__name__}")
        if not content.strip():
            return reject(f"message {i} content is empty")
        if "\x00" in content:
            return reject(f"message {i} content contains a NUL byte")
        clean.append({"role": role, "content": content})
    if clean[-1]["role"] != "user":
        return reject(f"the last message must be from the user, got {clean[-1]['role']!r}")
    source = record.get("source")
    source = source if isinstance(source, str) and source else default_source
    return Prompt(line, given_id or content_id(clean), source, clean)


def _parquet_file(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise SourceError(f"prompt source {path} is not a readable Parquet file: {e}") from None


def _jsonl_records(path: Path, start: int, stop: int) -> Iterator[tuple[int, object]]:
    try:
        with path.open("rb") as f:
            for line_no, raw in enumerate(itertools.islice(f, start, stop), start=start + 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield line_no, SourceReject(line_no, f"line {line_no}: invalid UTF-8 at byte {e.start}")
                    continue
                if not text.strip():
                    yield line_no, SourceReject(line_no, f"line {line_no}: blank line")
                    continue
                if "\x00" in text:
                    yield line_no, SourceReject(line_no, f"line {line_no}: contains a NUL byte")
                    continue
                try:
                    yield line_no, json.loads(text.rstrip("\r\n"))
                except json.JSONDecodeError as e:
                    yield line_no, SourceReject(line_no, f"line {line_no}: invalid JSON: {e.msg} (column {e.colno})")
    except OSError as e:
        raise SourceError(f"prompt source {path} is unreadable: {e}") from None


def _parquet_records(path: Path, start: int, stop: int) -> Iterator[tuple[int, object]]:
    pf = _parquet_file(path)
    names = set(pf.schema_arrow.names)
    if not names & {"messages", "prompt"}:
        raise SourceError(f"prompt source {path}: Parquet file has neither a 'messages' nor a 'prompt' column "
                          f"(columns: {sorted(names)})")
    columns = [c for c in ("id", "messages", "prompt", "source") if c in names]
    row = 0
    for batch in pf.iter_batches(batch_size=4096, columns=columns):
        if row + batch.num_rows <= start:
            row += batch.num_rows
            continue
        for record in batch.to_pylist():
            if start <= row < stop:
                yield row + 1, {k: v for k, v in record.items() if v is not None}
            row += 1
        if row >= stop:
            return


def read_shard(path: Path, index: int, shard_size: int) -> Iterator[Prompt | SourceReject]:
    """Prompts and rejects of shard `index`, in source order. Duplicate ids within the shard are rejected."""
    path = Path(path)
    _check_file(path)
    start, stop = index * shard_size, (index + 1) * shard_size
    records = _parquet_records(path, start, stop) if path.suffix == ".parquet" else _jsonl_records(path, start, stop)
    seen: dict[str, int] = {}
    for line, record in records:
        item = record if isinstance(record, SourceReject) else parse_record(record, line, path.stem)
        if isinstance(item, Prompt):
            if item.prompt_id in seen:
                item = SourceReject(line, f"line {line}: duplicate id {item.prompt_id!r} "
                                          f"(first seen on line {seen[item.prompt_id]})", item.prompt_id)
            else:
                seen[item.prompt_id] = line
        yield item
