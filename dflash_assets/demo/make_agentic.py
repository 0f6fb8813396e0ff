"""Write the bundled agentic prompt set: 40 coding-agent conversations with four tools (1 to 4 calls, some parallel)
and 5 malformed lines, in OpenAI's form and ShareGPT's. Seeded: `uv run python -m dflash_assets.demo.make_agentic`
rewrites agentic.jsonl byte for byte.
"""

import json
import random
from pathlib import Path

TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_code",
            "description": "Search the repository for a pattern.",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}, "max_results": {"type": "integer"}},
                "required": ["pattern"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite of a path.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "git_log",
            "description": "The recent commits of a path.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "count": {"type": "integer"}}},
        },
    },
]
FILES = ["src/cache.py", "src/server.py", "tests/test_cache.py", "src/router.py", "README.md", "src/queue.py"]
TASKS = [
    "The cache tests fail since yesterday. Find out why and propose a fix.",
    "Where is the request timeout set, and what is its value?",
    "Explain how the router picks a server, with the code that does it.",
    "Add a test for an empty queue and tell me whether the suite passes.",
    "Which commit changed the eviction policy, and what did it change?",
]
NAMES = (
    "evict lookup insert flush expire route pick balance retry backoff enqueue drain timeout parse render "
    "connect close commit rollback shard merge split index scan load store"
).split()
THINGS = "cache entry key node server queue worker request socket record ticket lease token batch".split()
SYSTEM = "You are a coding agent working in a Python repository. Call the tools to look before you answer."
# one of each kind of mistake the reader names (generation/tools.py, generation/prompts.py)
MALFORMED = [
    {"id": "bad-tools", "tools": {"name": "read_file"}, "messages": [{"role": "user", "content": "Read it."}]},
    {
        "id": "bad-unknown-tool",
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Deploy it."},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "deploy", "arguments": "{}"}}]},
            {"role": "tool", "content": "ok"},
        ],
    },
    {
        "id": "bad-arguments",
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Read the README."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "read_file", "arguments": "{path: README.md"}}],
            },
            {"role": "tool", "content": "# README"},
        ],
    },
    {
        "id": "bad-orphan-result",
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "Run the tests."}, {"role": "tool", "content": "3 passed"}],
    },
    {
        "id": "bad-missing-result",
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Read two files."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "a", "function": {"name": "read_file", "arguments": {"path": "a.py"}}},
                    {"id": "b", "function": {"name": "read_file", "arguments": {"path": "b.py"}}},
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "print('a')"},
            {"role": "assistant", "content": "Done."},
        ],
    },
]

DEFAULT_PATH = Path(__file__).with_name("agentic.jsonl")


def _call(rng: random.Random) -> dict:
    tool: dict = rng.choice(TOOLS)["function"]
    name = tool["name"]
    arguments = {"pattern": rng.choice(["timeout", "evict", "def route", "TODO"])} if name == "search_code" else {}
    if name != "search_code":
        arguments["path"] = rng.choice(FILES)
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _result(tool: str, rng: random.Random) -> str:
    """What a tool printed: a few lines of code, test results or commits, made of the names above."""
    lines = []
    for _ in range(rng.randint(3, 6)):
        name, thing, n = rng.choice(NAMES), rng.choice(THINGS), rng.randint(1, 400)
        lines.append(
            {
                "run_tests": f"test_{name}_{thing} {'PASSED' if rng.random() < 0.7 else 'FAILED'} ({n} ms)",
                "git_log": f"{rng.getrandbits(28):07x} {name.capitalize()} the {thing} on {rng.choice(NAMES)}",
                "search_code": f"{rng.choice(FILES)}:{n}: def {name}_{thing}(self, {rng.choice(THINGS)}):",
            }.get(tool, f"{n:4d}    {thing} = self.{name}({rng.choice(THINGS)}, {rng.choice(NAMES)}={n % 17})")
        )
    return "\n".join(lines)


def conversation(i: int, rng: random.Random) -> dict:
    """One agent conversation: a task, 1 to 4 tool calls in 1 to 3 steps (a step may call two tools at once), each
    answered by its result, an answer, and sometimes a follow-up question and its answer."""
    ticket = f"Ticket {4100 + i}: the {rng.choice(THINGS)} {rng.choice(NAMES)} path misbehaves in {rng.choice(FILES)}."
    messages: list[dict] = [{"role": "user", "content": f"{rng.choice(TASKS)} {ticket}"}]
    calls_left, n = rng.randint(1, 4), 0
    while calls_left:
        k = 2 if calls_left >= 2 and rng.random() < 0.3 else 1
        calls = [_call(rng) | {"id": f"call_{i}_{n + j}"} for j in range(k)]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        for call in calls:
            result = _result(call["function"]["name"], rng)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        n, calls_left = n + k, calls_left - k
    messages.append({"role": "assistant", "content": "(the source model's answer)"})
    if rng.random() < 0.3:
        messages += [{"role": "user", "content": "Thanks. Is there anything else to check?"}]
    return {
        "id": f"agent-{i:04d}",
        "source": "agent",
        "tools": TOOLS,
        "messages": [{"role": "system", "content": SYSTEM}] + messages,
    }


def sharegpt(record: dict) -> dict:
    """The same conversation in ShareGPT's tool speakers (function_call, observation), its tools a JSON string."""
    speakers = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}
    turns = []
    for m in record["messages"]:
        if m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in m["tool_calls"]
            ]
            turns.append({"from": "function_call", "value": json.dumps(calls if len(calls) > 1 else calls[0])})
        else:
            turns.append({"from": speakers[m["role"]], "value": m["content"]})
    return {
        "id": record["id"],
        "source": record["source"],
        "tools": json.dumps(record["tools"]),
        "conversations": turns,
    }


def lines(n: int, seed: int = 20261206) -> list[str]:
    """n conversations (one in four in ShareGPT form) with the malformed lines spread among them."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        record = conversation(i, rng)
        out.append(json.dumps(sharegpt(record) if i % 4 == 3 else record, ensure_ascii=False))
    for j, bad in enumerate(MALFORMED):
        out.insert(3 + j * (n // len(MALFORMED)), json.dumps(bad))
    return out


def main(path: Path = DEFAULT_PATH, n: int = 40) -> None:
    path.write_text("\n".join(lines(n)) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
