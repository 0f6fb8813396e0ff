"""Tool calls as SGLang 0.5.23 serves them for a Qwen model: the template's tools block and call format, the `qwen25`
parser (function_call/qwen25_detector.py), and the calls the stand-in model makes.

serving_chat._process_tool_calls gives `message.tool_calls` (`call_<24 hex>`, arguments `json.dumps(...,
ensure_ascii=False)`), the text before the first call as content, and `tool_calls` for `stop`; a call to a function
not in `tools` is dropped (base_format_detector.parse_base_json).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

PARSERS = ("qwen25", "qwen", "hermes")  # the parsers whose format the emulator speaks: Qwen's <tool_call> blocks
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
# the share of answers with tools that call them, and of those the share with two calls at once
CALL_SHARE, PARALLEL_SHARE = 0.5, 0.25


def tools_block(tools: list[dict], system: str | None) -> str:
    """The system turn's text under tools: the system prompt, then the schemas one JSON a line."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return (f"{system}\n\n" if system is not None else "") + TOOLS_HEADER + lines + TOOLS_FOOTER


def call_text(name: str, arguments: Any) -> str:
    """One call as the template renders it (and the model writes it): arguments text as given, else as JSON."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{CALL_OPEN}{{"name": "{name}", "arguments": {args}}}{CALL_CLOSE}'


def rendered_calls(content: str, calls: list[dict]) -> str:
    """The calls of an assistant turn after its content, as Qwen3's template joins them."""
    out = ""
    for k, call in enumerate(calls):
        function = call.get("function", call)
        out += ("\n" if k or content else "") + call_text(function["name"], function.get("arguments", {}))
    return out


def parse(text: str, tools: list[dict]) -> tuple[str, list[dict]]:
    """(content, tool_calls) of an answer: Qwen25Detector.detect_and_parse, then serving_chat's ToolCall list."""
    at = text.find(CALL_OPEN)
    if at == -1:
        return text, []
    names = {t.get("function", {}).get("name") for t in tools}
    calls: list[dict] = []
    for body in _CALL.findall(text):
        try:
            parsed = json.loads(body.strip())
        except json.JSONDecodeError:
            continue
        for act in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(act, dict) or act.get("name") not in names:
                continue  # an undefined function is skipped
            arguments = json.dumps(act.get("parameters") or act.get("arguments", {}), ensure_ascii=False)
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "index": len(calls),
                    "type": "function",
                    "function": {"name": act["name"], "arguments": arguments},
                }
            )
    return text[:at].strip(), calls


def _value(schema: Any, word: str, n: int) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return n if kind in ("integer", "number") else (n % 2 == 0) if kind == "boolean" else word


def model_calls(tools: list[dict], draws: list[float], words: list[str]) -> str | None:
    """The calls the stand-in model answers with (one, or two at once), drawn by `draws` in [0, 1); None for text."""
    if not tools or draws[0] >= CALL_SHARE:
        return None
    count = 2 if draws[1] < PARALLEL_SHARE else 1
    texts = []
    for k in range(count):
        function = tools[int(draws[2 + k] * len(tools)) % len(tools)]["function"]
        properties = (function.get("parameters") or {}).get("properties") or {}
        arguments = {
            p: _value(s, words[(k + j) % len(words)], k + j + 1) for j, (p, s) in enumerate(properties.items())
        }
        texts.append(call_text(function["name"], arguments))
    return "\n".join(texts)


def tool_dump(tool: dict) -> dict:
    """A request's tool as serving_chat hands it to the template (protocol.Tool.model_dump()): the keys sent, in
    order, then the rest as null (`strict`, `defer_loading` dropped), and the Tool's own `defer_loading`."""
    function = dict(tool.get("function") or {})
    for key in ("description", "name", "parameters"):
        function.setdefault(key, None)
    function.pop("strict", None) if function.get("strict") is None else None
    function.pop("defer_loading", None) if function.get("defer_loading") is None else None
    return {"type": tool.get("type", "function"), "function": function, "defer_loading": tool.get("defer_loading")}


def tools_error(tools: Any) -> str | None:
    """Why a request's `tools` is not a list of protocol.Tool (the 422's message), or None."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        return "Input should be a valid list of tools, each with a function name"
    return None
