"""Agentic conversations: tool schemas, assistant tool calls and tool results, read, checked and spliced.

The shapes read are OpenAI's (`tools`, an assistant's `tool_calls`, `tool` messages) and ShareGPT's tool speakers
(CALL_SPEAKERS, RESULT_SPEAKERS); docs/prompts.md. A call is kept as SGLang's parser returns one (serving_chat.py,
function_call/base_format_detector.py): its arguments the text `json.dumps(arguments, ensure_ascii=False)`, so the
source's calls and the target's compare. Tools are never executed: after a regenerated call the source's own result
is spliced, positionally (its tool_call_id the target's), as speculators' regeneration does.
"""

from __future__ import annotations

import json
from typing import Any

CALL_SPEAKERS = ("function_call",)  # ShareGPT speakers of an assistant turn of tool calls
RESULT_SPEAKERS = ("observation", "tool", "function")  # ShareGPT speakers of a tool result


def read_tools(raw: Any) -> tuple[list[dict] | None, str | None]:
    """(the line's tool schemas, None), (None, None) when it has none, or (None, why they are malformed)."""
    if raw is None:
        return None, None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            return None, f"'tools' is not valid JSON: {e.msg} (column {e.colno})"
    if not isinstance(raw, list):
        return None, f"'tools' must be a list, got {type(raw).__name__}"
    tools, names = [], set()
    for i, tool in enumerate(raw):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"].strip():
            return None, f"tool {i} has no function name"
        name = function["name"]
        if name in names:
            return None, f"tool {i} repeats the name {name!r}"
        if not isinstance(function.get("parameters", {}), dict):
            return None, f"tool {i} ({name}): 'parameters' must be a JSON object"
        names.add(name)
        tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return (tools or None), None


def tool_names(tools: list[dict] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or ()}


def _arguments(value: Any) -> dict | None:
    """A call's arguments as a JSON object, from the object or its text; None when they are not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def read_calls(raw: Any, where: str, tools: list[dict] | None, first: int) -> tuple[list[dict], str | None]:
    """(the calls of one assistant turn, None) or ([], why they are malformed); `first` numbers the ids given to
    calls without one (call_<n>, n counting the conversation's calls)."""
    if not isinstance(raw, list) or not raw:
        return [], f"{where} tool_calls must be a non-empty list"
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"].strip():
            return [], f"{where} tool call {j} has no function name"
        name = function["name"]
        if tools is not None and name not in tool_names(tools):
            return [], f"{where} calls {name!r}, a tool not in the line's tools ({sorted(tool_names(tools))})"
        arguments = _arguments(function.get("arguments", function.get("parameters", {})))
        if arguments is None:
            return [], f"{where} tool call {j} ({name}): arguments are not a JSON object"
        call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"call_{first + j}"
        arguments_text = json.dumps(arguments, ensure_ascii=False)
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments_text}})
    return calls, None


def sharegpt_calls(value: Any) -> Any:
    """A ShareGPT function_call's value (JSON text of one call or a list of them) as OpenAI tool_calls, unchecked."""
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, list) else [parsed]


def answer_calls(calls: list[dict], results: list[dict], where: str) -> str | None:
    """Give each result of a run of tool messages its call's id (in order where it names none); why not, or None."""
    if len(results) > len(calls):
        return f"{where}: {len(results)} tool result(s) for {len(calls)} tool call(s)"
    ids = [c["id"] for c in calls]
    for k, result in enumerate(results):
        given = result.get("tool_call_id")
        if given is None:
            result["tool_call_id"] = ids[k]
        elif given not in ids:
            return f"{where}: tool_call_id {given!r} answers none of the calls before it ({ids})"
    return None


def clean_calls(calls: list[dict]) -> list[dict]:
    """A server's tool_calls (a response's, or assembled from a stream's deltas) as a row records them."""
    return [
        {"id": c.get("id"), "type": "function", "function": {k: c["function"].get(k) for k in ("name", "arguments")}}
        for c in calls
    ]


def answer_message(content: str, tool_calls_json: str | None) -> dict:
    """A regenerated assistant turn as the next turn's history holds it: its content, and its calls if it made any."""
    message: dict = {"role": "assistant", "content": content}
    if tool_calls_json:
        message["tool_calls"] = json.loads(tool_calls_json)
    return message


def calls_of(message: dict | str | None) -> list[dict]:
    return message.get("tool_calls") or [] if isinstance(message, dict) else []


def results_in(group: list[dict]) -> int:
    """The tool results a group of messages before an assistant turn holds (0: it is a user turn)."""
    return sum(m["role"] == "tool" for m in group)


def spliced(group: list[dict], previous: dict | str | None) -> list[dict]:
    """The group after a regenerated turn: each source tool result answers the target's call of its position."""
    calls = calls_of(previous)
    if not calls or not results_in(group):
        return list(group)
    out, k = [], 0
    for m in group:
        if m["role"] == "tool" and k < len(calls):
            m = {**m, "tool_call_id": calls[k]["id"]}
            k += 1
        out.append(m)
    return out


def call_key(call: dict) -> tuple[Any, Any]:
    function = call.get("function") or {}
    return function.get("name"), _arguments(function.get("arguments"))


def calls_differ(target: list[dict], source: list[dict]) -> bool | None:
    """Whether the target's calls (name and arguments, in order) differ from the source's turn's; None when neither
    turn calls a tool. Where they differ, the results spliced after the target's calls answer the source's."""
    if not target and not source:
        return None
    return [call_key(c) for c in target] != [call_key(c) for c in source]


def call_problem(call: dict, tools: list[dict] | None) -> str | None:
    """What the checks say of a regenerated call: a tool not in the schema, or arguments that are not JSON."""
    name, arguments = call_key(call)
    if tools is not None and name not in tool_names(tools):
        return "unknown_tool"
    return "arguments_not_json" if arguments is None else None
