"""Verbatim copies of SpecForge's own code (sgl-project/SpecForge a6b6b0230009d15ec2a97a57384e6f53f0f96946), so
the tests judge the export by the trainer's rules, not ours:
- has_consecutive_supervised_tokens: specforge/data/loss_mask.py (the DFlash data path's sample filter);
- validate_conversation (as validate_basic_conversation): scripts/conversation_validation.py;
- validate_conversation, visible_history_message, expand_row: scripts/expand_reasoning_conversations.py;
- expand_file: that script's main() loop, writing lines to a list instead of a file.
"""
# ruff: noqa
# fmt: off

import json
from collections.abc import Sequence
from typing import Any, Dict, List, Optional


def has_consecutive_supervised_tokens(loss_mask: Any) -> bool:
    """Return whether one sample contains adjacent supervised tokens."""

    values = loss_mask.tolist() if hasattr(loss_mask, "tolist") else list(loss_mask)
    if values and isinstance(values[0], Sequence):
        if len(values) != 1:
            raise ValueError("expected one loss-mask row")
        values = list(values[0])
    return any(
        bool(current) and bool(following)
        for current, following in zip(values, values[1:])
    )


def validate_basic_conversation(
    messages: Any,
    *,
    error_style: str = "validation",
) -> str | None:
    if not isinstance(messages, list) or not messages:
        if error_style == "regeneration":
            return "Missing or empty conversations list"
        return "conversations must be a non-empty list"

    expected_role = "user"
    saw_user = False
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            if error_style == "regeneration":
                return f"Invalid message at position {index}: expected object"
            return f"message {index} must be an object"
        role = message.get("role")
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            if error_style == "regeneration":
                return (
                    f"Invalid message content at position {index}: "
                    "expected non-empty string"
                )
            return f"message {index} content must be a non-empty string"

        if role == "system" and not saw_user:
            continue
        if role not in {"user", "assistant"}:
            if error_style == "regeneration":
                return f"Invalid message role: {role}"
            return f"message {index} has unsupported role {role!r}"
        if role != expected_role:
            if error_style == "regeneration":
                if not saw_user and role == "assistant":
                    return "Data starts with an assistant message"
                return (
                    f"Invalid conversation role order at position {index}: "
                    f"expected {expected_role}, got {role}"
                )
            return f"message {index} expected role {expected_role!r}, got {role!r}"

        saw_user = True
        expected_role = "assistant" if role == "user" else "user"

    if not saw_user:
        if error_style == "regeneration":
            return "Data does not contain a user message"
        return "conversation has no user message"
    return None


def validate_conversation(messages: Any) -> Optional[str]:
    if isinstance(messages, list):
        expected_role = "user"
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                break
            role = message.get("role")
            if role == "system":
                continue
            if role == "assistant":
                return (
                    f"Invalid conversation role order at position {index}: "
                    f"expected {expected_role}, got {role}"
                )
            break

    invalid_reason = validate_basic_conversation(
        messages,
        error_style="regeneration",
    )
    if invalid_reason is not None:
        return invalid_reason

    saw_assistant = False
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue

        reasoning = message.get("reasoning_content")
        if not isinstance(reasoning, str) or not reasoning.strip():
            return (
                f"Invalid assistant reasoning_content at position {index}: "
                "expected non-empty string"
            )
        saw_assistant = True

    if not saw_assistant:
        return "Data does not contain an assistant message"
    if messages[-1].get("role") != "assistant":
        return "Conversation ends with a user message"
    return None


def visible_history_message(message: Dict[str, Any]) -> Dict[str, Any]:
    visible = dict(message)
    if visible.get("role") == "assistant":
        visible.pop("reasoning_content", None)
    return visible


def expand_row(row: Any, source_row_index: int) -> List[Dict[str, Any]]:
    if not isinstance(row, dict):
        raise ValueError("Expected a JSON object")
    if row.get("status") != "success":
        raise ValueError("status must be 'success'")
    source_id = row.get("id")
    if not isinstance(source_id, str) or not source_id.strip():
        raise ValueError("id must be a non-empty string")
    messages = row.get("conversations")
    invalid_reason = validate_conversation(messages)
    if invalid_reason is not None:
        raise ValueError(invalid_reason)

    history: List[Dict[str, Any]] = []
    events: List[Dict[str, Any]] = []
    assistant_turn_index = 0

    for message in messages:
        role = message["role"]
        if role != "assistant":
            history.append(dict(message))
            continue

        event_messages = [dict(item) for item in history]
        event_messages.append(dict(message))
        event = {
            "id": f"{source_id}#turn{assistant_turn_index}",
            "source_id": source_id,
            "source_row_index": source_row_index,
            "assistant_turn_index": assistant_turn_index,
            "conversations": event_messages,
        }
        if "status" in row:
            event["status"] = row["status"]
        events.append(event)

        history.append(visible_history_message(message))
        assistant_turn_index += 1

    return events


def expand_file(path) -> tuple[list[str], int]:
    """(the output lines, the skipped rows) of the script's main() on a JSONL file."""
    lines, skipped = [], 0
    with open(path, "r", encoding="utf-8") as handle:
        for source_row_index, line in enumerate(handle):
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                events = expand_row(row, source_row_index)
            except ValueError:
                skipped += 1
                continue
            lines += [json.dumps(event, ensure_ascii=False) for event in events]
    return lines, skipped
