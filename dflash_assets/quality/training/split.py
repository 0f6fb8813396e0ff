"""The held-out split: the exported conversations a drafter is measured on rather than trained on.

A prompt is held out when a seeded hash of its prompt id falls below the share (rules.drawn): nothing else decides
it, so every row of a prompt lands on one side, and a re-export, another form or another machine draws the same
split. The held-out file sits beside the train file (HELD_OUT_JSONL, HELD_OUT_PARQUET), in the same form.
"""

from __future__ import annotations

from typing import Any

from dflash_assets.rules import drawn

HELD_OUT_JSONL, HELD_OUT_PARQUET = "held_out_set.jsonl", "held_out_set.parquet"
HELD_OUT_FILES = (HELD_OUT_JSONL, HELD_OUT_PARQUET)
TRAIN, HELD_OUT = "train", "held_out"


def held_out(prompt_id: str, share: float, seed: int) -> bool:
    """Whether the prompt's conversations go to the held-out file: the first 8 bytes of sha256("<seed>:<prompt_id>")
    (the quotas' draw key), read as a number, below share * 2**64."""
    return drawn(share, seed, prompt_id)


def split_manifest(share: float, seed: int, counts: dict[str, tuple[int, int]], jsonl: str, parquet: str) -> dict:
    """The manifest's `split`: the rule, and each side's files and counts (lines, conversations); `held_out` is None
    when the share is 0 (no held-out file is written)."""

    def side(files: tuple[str, str], lines: int, conversations: int) -> dict[str, Any]:
        return {"jsonl": files[0], "parquet": files[1], "rows": lines, "conversations": conversations}

    return {
        "held_out_share": share,
        "seed": seed,
        "rule": "held out when int(sha256('<seed>:<prompt_id>')[:8]) < share * 2**64: whole prompts on one side",
        TRAIN: side((jsonl, parquet), *counts[TRAIN]),
        HELD_OUT: side(HELD_OUT_FILES, *counts[HELD_OUT]) if share > 0 else None,
    }


def split_words(manifest: dict[str, Any]) -> str:
    """The split for the terminal: both files and their rows, or that none is held out."""
    split = manifest.get("split")
    if not split:
        return ""
    if split[HELD_OUT] is None:
        return "; nothing held out (held_out_share 0)"
    held = split[HELD_OUT]
    return (
        f"; train: {split[TRAIN]['rows']} rows in {split[TRAIN]['jsonl']}, held out: {held['rows']} rows "
        f"({held['conversations']} conversations, share {split['held_out_share']}, seed {split['seed']}) in "
        f"{held['jsonl']}"
    )
