"""The cost of finding repeats in a prompt source (generation/dedupe.py), per million prompts, and the share of
planted repeats it finds.

    uv run python benchmarks/bench_repeats.py                     # 200,000 prompts
    uv run python benchmarks/bench_repeats.py --prompts 1000000

A JSONL source of `--prompts` lines: prompts of 10 to 400 words (lognormal, median 60) from a 20,000-word
vocabulary, with 5% exact repeats (the same conversation, another id) and 5% near ones (one word of 80 or more
replaced, case and punctuation changed, or a word added: word-shingle Jaccard similarity 0.92 or more) of earlier
lines. It times `source_repeats` as a shard's build
calls it the first time (reading and parsing the whole source, then both kinds of repeats), in CPU seconds of this
process, and its peak RSS; then counts the planted repeats found and the other lines taken for repeats.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path

from dflash_assets.generation.dedupe import source_repeats
from dflash_assets.settings import RepeatSettings


def write_source(path: Path, n: int, seed: int = 1) -> dict[int, str]:
    """The source, and its planted repeats {line: kind}."""
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(20_000)]
    texts: list[str] = []
    planted: dict[int, str] = {}
    with path.open("w") as f:
        for i in range(n):
            line, roll = i + 1, rng.random()
            if texts and roll < 0.05:
                text, planted[line] = rng.choice(texts), "exact"
            elif texts and roll < 0.10:
                words = rng.choice(texts).split()
                if len(words) >= 80 and rng.random() < 0.5:
                    words[rng.randrange(len(words))] = "changed"
                    text = " ".join(words)
                elif rng.random() < 0.5:
                    text = " ".join(words).upper() + "?!"
                else:
                    text = " ".join(words) + " please"
                planted[line] = "near"
            else:
                size = max(10, min(400, int(rng.lognormvariate(4.1, 0.7))))
                text = " ".join(rng.choice(vocabulary) for _ in range(size))
                texts.append(text)
            f.write(json.dumps({"id": f"b{i:07d}", "prompt": text}) + "\n")
    return planted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "prompts.jsonl"
        planted = write_source(source, args.prompts)
        cpu, wall = time.process_time(), time.perf_counter()
        found = source_repeats(source, Path(tmp) / "data", None, RepeatSettings())
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    per_million = 1_000_000 / args.prompts
    exact = {line for line, kind in planted.items() if kind == "exact"}
    near = set(planted) - exact
    print(f"prompts {args.prompts:,}, planted repeats {len(planted):,} ({len(exact):,} exact, {len(near):,} near)")
    print(
        f"found: {len(set(found) & exact):,} of the exact, {len(set(found) & near):,} of the near; "
        f"other lines taken for repeats: {len(set(found) - set(planted)):,}"
    )
    print(
        f"cost: {cpu:.1f} CPU-s ({wall:.1f} s wall), {cpu * per_million:.0f} CPU-s per million prompts; "
        f"peak RSS {rss_mb:.0f} MB"
    )


if __name__ == "__main__":
    main()
