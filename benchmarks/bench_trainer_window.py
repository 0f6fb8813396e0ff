"""Decoded tokens per trained token: fixed caps against the window policy, on the emulated fleet (issue 20).

The same prompts (the demo's generator, made unique per prompt) on two emulator servers with one seed and
per-prompt sampling, so a prompt's completion is one draw whatever the cap; every config in a fresh data dir,
through the project's own engine and export:

- fixed caps 4,096, 8,192, 16,384 and 32,768, each read by trainers with windows L = 2,048 and 4,096;
- the window policy at L = 2,048 and L = 4,096 (cap 32,768, the default overshoot).

"Trained" is what the pre-tokenized export gives the trainer: the loss-mask ones of every exported sample (the
rows the export writes, cut at the window), and whether the blocking truncation check passes for that window
(when it fails the gate writes nothing). The floor is every prompt's first L tokens: the 32,768-cap run's export
at L (runaways are left out of every export). GPU-hours are for 913,786 prompts on 7 GPUs at 25,000
tok/s in all.

    uv run python benchmarks/bench_trainer_window.py [--prompts 2000] [--seed 5]
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from dflash_assets.emulator.process import start_emulator
from dflash_assets.fleet.fleet import on_fleet
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality import export_training_set, run_checks
from dflash_assets.settings import DispatchSettings, GenerationSettings, QualitySettings, TrainerSettings

FLEET_PROMPTS, FLEET_TOK_S, FLEET_GPUS = 913_786, 25_000, 7
CAPS, WINDOWS = (4096, 8192, 16384, 32768), (2048, 4096)
SETTINGS = DispatchSettings(store_token_ids=True, load_sample_s=0)


def write_prompts(path: Path, n: int) -> None:
    """n unique prompts in the demo set's style (its templates and topics), seeded."""
    from dflash_assets.demo.make_prompts import CHAT, CODE, MATH, TOPICS

    rng = random.Random(20261201)
    with path.open("w") as f:
        for i in range(n):
            source, templates = rng.choice([("math", MATH), ("code", CODE), ("chat", CHAT)])
            text = rng.choice(templates).format(n=rng.randint(2, 90), t=rng.choice(TOPICS))
            f.write(json.dumps({"id": f"b{i:05d}", "source": source, "prompt": f"{text} (case {i})"}) + "\n")


def trained(data: Path, out: Path, window: int) -> tuple[int, bool]:
    """(trained tokens of the pre-tokenized export at this window, whether the blocking truncation check passes)."""
    export = export_training_set(data, out, max_length=window, form="pretokenized")
    tokens = sum(sum(json.loads(line)["loss_mask"]) for line in export.jsonl_path.open())
    (check,) = run_checks(
        data, names=["truncation_rate"], thresholds=QualitySettings(trainer=TrainerSettings(max_length=window))
    )
    return tokens, check.passed


def run(urls: list[str], src: Path, root: Path, n: int, config: GenerationSettings) -> tuple[Path, int, float]:
    data = root / f"{config.cap_policy}-{config.max_output_tokens}-{config.trainer_max_length}" / "data"
    on_fleet(urls, lambda f: build_prompt_shard(src, 0, "00000", n, data, f, {"enable_thinking": True}))
    t0 = time.monotonic()
    shard = on_fleet(urls, lambda f: generate_shard(data, "00000", f, config, SETTINGS, log=lambda m: None))
    assert shard.prompts == shard.completed + shard.rejected + shard.failed, "accounting"
    return data, shard.output_tokens, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    # a context that holds prompt + 32,768 (the 32,768 cap is SpecForge's profile)
    emulator = [
        "--reasoning-parser",
        "qwen3",
        "--decode-tokens-per-s",
        "0",
        "--random-seed",
        str(args.seed),
        "--native-context-length",
        "40960",
        "--sampling",
        "per-prompt",
    ]
    rows = []  # (label, window, decoded, trained, gate)
    with tempfile.TemporaryDirectory() as tmp, start_emulator(emulator) as a, start_emulator(emulator) as b:
        root, urls = Path(tmp), [a.url, b.url]
        src = root / "prompts.jsonl"
        write_prompts(src, args.prompts)
        for cap in CAPS:
            data, decoded, secs = run(
                urls, src, root, args.prompts, GenerationSettings(max_output_tokens=cap, cap_policy="fixed")
            )
            print(f"  generated cap {cap:,}: {decoded:,} tokens ({secs:.0f}s)", file=sys.stderr)
            for window in WINDOWS:
                rows.append((f"fixed cap {cap:,}", window, decoded, *trained(data, root / f"x{cap}-{window}", window)))
        for window in WINDOWS:
            config = GenerationSettings(max_output_tokens=32768, trainer_max_length=window)
            data, decoded, secs = run(urls, src, root, args.prompts, config)
            print(f"  generated window {window:,}: {decoded:,} tokens ({secs:.0f}s)", file=sys.stderr)
            rows.append((f"window policy L={window:,}", window, decoded, *trained(data, root / f"w{window}", window)))
    floor = {w: t for label, w, _, t, _ in rows if label == f"fixed cap {CAPS[-1]:,}"}
    print(
        f"{args.prompts:,} prompts, emulator seed {args.seed}; GPU-hours: {FLEET_PROMPTS:,} prompts on "
        f"{FLEET_GPUS} GPUs at {FLEET_TOK_S:,} tok/s\n"
    )
    print("| config | window L | decoded | trained | decoded / trained | coverage of the floor | gate | GPU-hours |")
    print("|---|---|---|---|---|---|---|---|")
    goals = []
    for label, window, decoded, tokens, gate in sorted(rows, key=lambda r: (r[1], r[0].startswith("window"))):
        ratio = f"{decoded / tokens:.3f}x" if tokens else "∞"
        hours = decoded / args.prompts * FLEET_PROMPTS / FLEET_TOK_S / 3600 * FLEET_GPUS
        print(
            f"| {label} | {window:,} | {decoded:,} | {tokens:,} | {ratio} | {tokens / floor[window]:.2%} | "
            f"{'passes' if gate else 'FAILS: nothing exported'} | {hours:,.1f} |"
        )
        if label.startswith("window"):
            goals.append((label, decoded / tokens <= 1.02, tokens / floor[window] >= 0.995))
    print(
        "\n| floor (every prompt's first L tokens) | " + " | ".join(f"L={w:,}: {t:,}" for w, t in floor.items()) + " |"
    )
    ok = all(a and b for _, a, b in goals)
    for label, ratio_ok, cover_ok in goals:
        print(
            f"goal, {label}: decoded per trained <= 1.02 {'met' if ratio_ok else 'NOT met'}; trained >= 99.5% of "
            f"the floor {'met' if cover_ok else 'NOT met'}"
        )
    print("goals met" if ok else "goals NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
