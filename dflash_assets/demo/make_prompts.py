"""Write the bundled demo prompt set: 400 lines (4 shards of 100) from three sources, 7 of them broken, one in
eight a multi-turn ShareGPT conversation. Seeded: `uv run python -m dflash_assets.demo.make_prompts` rewrites
prompts.jsonl byte for byte.
"""

import json
import random
from pathlib import Path

TOPICS = [
    "binary search",
    "the Fibonacci sequence",
    "a trie",
    "Dijkstra's algorithm",
    "gradient descent",
    "the birthday paradox",
    "a Bloom filter",
    "quicksort",
    "RAID 5",
    "TCP slow start",
    "the Monty Hall problem",
    "Bayes' theorem",
    "a ring buffer",
    "consistent hashing",
    "the CAP theorem",
    "Huffman coding",
]
MATH = [
    "Prove that the sum of the first {n} odd numbers is a perfect square.",
    "How many ways can {n} people sit at a round table? Explain.",
    "Find all integer solutions of x^2 - {n}y^2 = 1 with y < 100.",
    "What is the probability that {n} dice sum to an even number?",
]
CODE = [
    "Write a Python function implementing {t}, with tests.",
    "Explain the time complexity of {t} and give a Rust implementation.",
    "Review this design: a service that uses {t} to shard {n} million keys.",
]
CHAT = [
    "Explain {t} to a twelve-year-old.",
    "Write a short story in which {t} saves the day.",
    "Summarise the history of {t} in {n} bullet points.",
]
BROKEN = [
    '{"messages": [{"role": "user", "content": "unterminated',
    '["a JSON array, not an object"]',
    '{"id": "no-prompt", "text": "neither messages nor prompt"}',
    '{"messages": []}',
    '{"messages": [{"role": "wizard", "content": "unknown role"}]}',
    '{"messages": [{"role": "user", "content": ""}]}',
    '{"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]}',
]


def multi_turn(text: str, i: int) -> list[dict]:
    """2 or 3 user turns in ShareGPT form; every other one ends with an assistant turn (last_turn regenerates it,
    all_turns regenerates every one)."""
    follow_ups = ["Can you give a concrete example?", "What is the most common mistake here?"]
    turns = [{"from": "human", "value": text}]
    for k, question in enumerate(follow_ups[: 1 + i % 2]):
        turns += [
            {"from": "gpt", "value": f"(an earlier answer, {len(text) % 7 + k + 1} paragraphs)"},
            {"from": "human", "value": question},
        ]
    if i % 16 == 7:
        turns.append({"from": "gpt", "value": "(the answer a weaker model gave)"})
    return turns


DEFAULT_PATH = Path(__file__).with_name("prompts.jsonl")


def main(path: Path = DEFAULT_PATH, n: int = 393) -> None:
    rng = random.Random(20261130)
    lines = []
    for i in range(n):
        source, templates = [("math", MATH), ("code", CODE), ("chat", CHAT)][i % 3]
        text = rng.choice(templates).format(n=rng.randint(3, 40), t=rng.choice(TOPICS))
        if rng.random() < 0.2:  # some long prompts: pasted context
            text += "\n\nContext:\n" + " ".join(rng.choice(TOPICS) for _ in range(rng.randint(50, 400)))
        record: dict[str, object] = {"id": f"demo-{i:04d}", "source": source}
        if rng.random() < 0.5:
            record["prompt"] = text
        else:
            record["messages"] = [
                {"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": text},
            ]
        if i % 8 == 7:  # a multi-turn ShareGPT conversation (no extra draws: the other lines stay as they were)
            record.pop("prompt", None), record.pop("messages", None)
            record["conversations"] = multi_turn(text, i)
        lines.append(json.dumps(record, ensure_ascii=False))
    for j, bad in enumerate(BROKEN):  # spread over the shards, so every shard shows its rejects
        lines.insert(37 + j * 53, bad)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
