"""The tool calls of agentic rows (generation/tools.py), per config: how many turns called tools, and the calls to a
tool that is not in the prompt's schemas or whose arguments are not a JSON object, as the server's parser reported
them. SGLang's parser drops a call to an undefined function unless SGLANG_FORWARD_UNKNOWN_TOOLS is set, and its
arguments are the JSON it parsed: either kind here means a server that parses otherwise, and the drafter would learn
calls the trainer's template renders as the model never wrote them."""

import json

import duckdb

from dflash_assets.generation.tools import call_problem
from dflash_assets.quality.outcome import Finding, config_label, num
from dflash_assets.settings import QualitySettings

PROBLEMS = ("unknown_tool", "arguments_not_json")


def tool_calls(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Agentic rows, per config: the turns that called tools, and calls to a tool not in the prompt's schemas or
    with arguments that are not a JSON object (any is a failure)."""
    del quality
    rows = con.execute(
        "SELECT c.config_hash, c.config_cap, c.tool_calls_json, p.tools_json FROM completions c "
        "LEFT JOIN prompts p USING (shard, prompt_id) WHERE c.tool_calls_json IS NOT NULL ORDER BY ALL"
    ).fetchall()
    if not rows:
        return Finding(True, "Not applicable: no row called a tool.", {"tool_call_turns": 0})
    configs: dict[tuple, dict[str, int]] = {}
    for config, cap, calls_json, tools_json in rows:
        figures = configs.setdefault((config, cap), dict.fromkeys(("tool_call_turns", "calls", *PROBLEMS), 0))
        tools = json.loads(tools_json) if tools_json else None
        figures["tool_call_turns"] += 1
        for call in json.loads(calls_json):
            figures["calls"] += 1
            if problem := call_problem(call, tools):
                figures[problem] += 1
    total = {k: sum(f[k] for f in configs.values()) for k in ("tool_call_turns", "calls", *PROBLEMS)}
    lines = [
        f"- {config_label(h, cap)}: {num(f['tool_call_turns'])} turns called {num(f['calls'])} tools; "
        f"{num(f['unknown_tool'])} calls to a tool not in the schemas, {num(f['arguments_not_json'])} with "
        f"arguments that are not a JSON object"
        for (h, cap), f in configs.items()
    ]
    bad = total["unknown_tool"] + total["arguments_not_json"]
    head = (
        f"{num(bad)} of {num(total['calls'])} tool calls are malformed." if bad else "Every tool call is well formed."
    )
    metadata: dict[str, int | float | str] = {**total, "configs": len(configs)}
    return Finding(not bad, "\n".join([head, *lines]), metadata)
