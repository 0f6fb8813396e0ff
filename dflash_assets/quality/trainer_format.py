"""The drafter trainers' data format, as facts in our own code: what a training row must look like.

SpecForge's `scripts/validate_regenerated_data.py` (with `scripts/conversation_validation.py`; read at
sgl-project/SpecForge a6b6b02, August 2026), run with `--expect-reasoning --strict-think-markers`, accepts a
JSONL line when:
- `id` is a non-empty string and `status` is "success";
- `conversations` is a non-empty list of objects, each with non-empty string `content`;
- optional system turns come first, then user and assistant alternate from the user, and the last is the
  assistant's (any other role is refused);
- every assistant turn's `reasoning_content` is a string or null, and with --expect-reasoning a non-empty one;
- with --strict-think-markers no assistant `content` or `reasoning_content` holds `<think>` or `</think>`
  (case-insensitive).
"""

from __future__ import annotations

import re
from typing import Any

from dflash_assets.settings import TRAINER_FORMATS

STATUS = "success"
THINK_MARKERS = ("<think>", "</think>")

# the export's forms: SpecForge's conversations, the OpenAI messages form, and {id, input_ids, loss_mask}
FORMS = TRAINER_FORMATS


def has_think_marker(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in THINK_MARKERS)


def think_marker_sql(*columns: str) -> str:
    """has_think_marker over text columns as one DuckDB boolean (a null column holds no marker): the flag the
    think_marker check and the export's exclusion read, so they refuse exactly what --strict-think-markers does.
    A case-insensitive RE2 search, not lower() + contains(): 7x faster on long reasoning, and DuckDB's lower()
    maps U+0130 to "i" where Python's gives "i" + a combining dot (tests/quality/test_trainer_format.py compares them).
    Only the letters are case-insensitive, so each marker starts with a literal "<" that RE2 can skip to: twice
    as fast as a pattern that is case-insensitive throughout."""
    pattern = "|".join(re.sub("[A-Za-z]+", lambda w: f"(?i:{w[0]})", re.escape(m)) for m in THINK_MARKERS)
    return " OR ".join(f"coalesce(regexp_matches({c}, '{pattern}'), false)" for c in columns)


def conversation_problem(messages: Any) -> str | None:
    """Why `messages` is not a trainable conversation (system*, then user/assistant alternating), or None."""
    if not isinstance(messages, list) or not messages:
        return "conversations must be a non-empty list"
    expected, saw_user = "user", False
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i} must be an object"
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, str) or not content.strip():
            return f"message {i} content must be a non-empty string"
        if role == "system" and not saw_user:
            continue
        if role not in ("user", "assistant"):
            return f"message {i} has unsupported role {role!r}"
        if role != expected:
            return f"message {i} expected role {expected!r}, got {role!r}"
        saw_user, expected = True, "assistant" if role == "user" else "user"
    if not saw_user:
        return "conversation has no user message"
    if messages[-1].get("role") != "assistant":
        return "conversation must end with an assistant message"
    return None


def row_problem(row: dict, *, expect_reasoning: bool = True, strict_think_markers: bool = True) -> str | None:
    """Why one exported JSONL row (conversations form) would be refused by the trainer's validator, or None."""
    if not isinstance(row.get("id"), str) or not row["id"].strip():
        return "id must be a non-empty string"
    if row.get("status") != STATUS:
        return f"status must be {STATUS!r}"
    messages = row.get("conversations")
    if problem := conversation_problem(messages):
        return problem
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return f"assistant message {i} reasoning_content must be a string or null"
        if expect_reasoning and (not isinstance(reasoning, str) or not reasoning.strip()):
            return f"assistant message {i} has empty reasoning_content"
        if strict_think_markers and (
            has_think_marker(m["content"]) or (isinstance(reasoning, str) and has_think_marker(reasoning))
        ):
            return f"assistant message {i} contains a thinking marker"
    return None
