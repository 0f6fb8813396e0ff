"""Decoded tokens per trained token of the export, for each regenerate mode and export form (issue 43).

The demo's prompts (dflash_assets/demo/prompts.jsonl) on two emulator servers (`--reasoning-parser qwen3
--random-seed 5`, instant decode), under the window policy at L (default 2048, cap 16384), once with regenerate
last_turn and once with all_turns, through the project's own engine and export. "Trained" is what the trainer
supervises inside the window of the exported samples, under the trainer settings written beside them (SpecForge,
chat_template qwen3.5, which keeps reasoning only after the last user turn):
- pretokenized: the loss-mask ones;
- per_turn (train_only_last_turn): each event's own turn, min(completion, L - prompt) of its row;
- conversations: the last assistant turn of each row (earlier turns are rendered without their reasoning and, under
  qwen3.5, not trained), min(completion, L - prompt) of that turn's row.
Decoded is every completion token of the config.

    uv run python benchmarks/bench_export_trained.py [--window 2048]
"""

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import duckdb

from dflash_assets.emulator.process import start_emulator
from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.engine import generate_shard
from dflash_assets.generation.shards import build_prompt_shard
from dflash_assets.quality import export_training_set
from dflash_assets.rules import trained_tokens
from dflash_assets.settings import DEMO_PROMPTS, DispatchSettings, GenerationSettings

ARGS = ["--reasoning-parser", "qwen3", "--decode-tokens-per-s", "0", "--random-seed", "5"]
FORMS = ("conversations", "per_turn", "pretokenized")


def generate(data: Path, urls: list[str], regenerate: str, window: int) -> None:
    async def go():
        async with connected(urls) as fleet:
            await build_prompt_shard(DEMO_PROMPTS, 0, "00000", 1000, data, fleet, {"enable_thinking": True})
            settings = GenerationSettings(max_output_tokens=16384, trainer_max_length=window, regenerate=regenerate)
            await generate_shard(data, "00000", fleet, settings, DispatchSettings(load_sample_s=0), log=lambda m: None)

    asyncio.run(go())


def trained(data: Path, out: Path, form: str, window: int) -> tuple[int, int]:
    """(trained tokens, samples) of the export in `form`."""
    rows = {
        (pid, turn): (p, c)
        for pid, turn, p, c in duckdb.sql(
            f"select prompt_id, turn, prompt_tokens, completion_tokens from "
            f"read_parquet('{data}/completions/**/*.parquet', union_by_name = true)"
        ).fetchall()
    }
    export = export_training_set(data, out, max_length=window, form=form)
    total = samples = 0
    for line in map(json.loads, export.jsonl_path.open()):
        samples += 1
        if form == "pretokenized":
            total += sum(line["loss_mask"])
            continue
        pid = line["id"].split("@")[0]
        if (pid, None) in rows:  # last_turn: the one regenerated answer
            turn = None
        elif form == "per_turn":
            turn = line["assistant_turn_index"] + 1
        else:
            turn = sum(m["role"] == "assistant" for m in line["conversations"])
        total += trained_tokens(*rows[(pid, turn)], window)
    return total, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=2048)
    args = parser.parse_args()
    print(f"demo prompts, window policy at L = {args.window:,}: decoded tokens per trained token")
    print(f"  {'regenerate':<11} {'form':<14} {'samples':>8} {'decoded':>10} {'trained':>10} {'decoded/trained':>16}")
    with tempfile.TemporaryDirectory(prefix="bench_export_trained_") as tmp:
        with start_emulator(ARGS) as a, start_emulator(ARGS) as b:
            for regenerate in ("last_turn", "all_turns"):
                data = Path(tmp) / regenerate / "data"
                data.mkdir(parents=True)
                generate(data, [a.url, b.url], regenerate, args.window)
                ((decoded,),) = duckdb.sql(
                    f"select sum(completion_tokens) from read_parquet('{data}/completions/**/*.parquet')"
                ).fetchall()
                for form in FORMS:
                    tokens, samples = trained(data, Path(tmp) / regenerate / form, form, args.window)
                    print(
                        f"  {regenerate:<11} {form:<14} {samples:>8,} {decoded:>10,} {tokens:>10,} "
                        f"{decoded / tokens:>16.3f}"
                    )


if __name__ == "__main__":
    main()
