"""Copies of speculators' own data code (vllm-project/speculators c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b), so the
tests judge the export by the trainer's rules, not ours:
- _append_row, _passthrough_pretokenized, _preprocess_batch's pre-tokenized branch:
  src/speculators/data_generation/preprocessing.py (what scripts/prepare_data.py does to {input_ids, loss_mask}
  rows: no render endpoint, no per-turn fan-out; each row cut at --seq-length and dropped without a supervised token);
- load_and_preprocess_dataset's order of work (one shuffle per --data file, then of their concatenation, seed 0):
  `prepare` below, the shuffle itself being HF datasets' (a seeded permutation), stood in for by `permutation`;
- train_split: ArrowDataset.__init__'s split (src/speculators/train/data.py): train.py's --train-data-ratio takes the
  first int(rows * ratio) rows of the prepared dataset for training and validates on the rest;
- DataArgs: src/speculators/train/config/schema.py's data group of train.py's flags (its dtype validator, which
  imports torch, left out), with _Group's config;
- create_train_val_loaders: src/speculators/train/dataloader.py, its ratio check and the two ArrowDatasets it makes of
  the one --data-path (the loaders, hidden-state transfer and noise left out).
Torch is not a dependency here: tensors are lists (`torch.tensor(x, dtype=torch.long)` is `list(x)`), and the
logger's warnings are left out.
"""
# ruff: noqa
# fmt: off

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


# ---- src/speculators/data_generation/preprocessing.py ---------------------------------------------------------
def _append_row(
    results: dict[str, list],
    input_ids: list[int],
    loss_mask: list[int],
    max_length: int,
    minimum_valid_tokens: int | None,
) -> Literal["kept", "unsupervised", "filtered"]:
    """Clip to the window, filter, and tensorize a row into ``results``.

    Returns "unsupervised" (no supervised tokens in-window), "filtered" (below
    ``minimum_valid_tokens``), or "kept".
    """
    input_ids = input_ids[:max_length]
    loss_mask = loss_mask[:max_length]
    num_valid_tokens = sum(loss_mask)
    if num_valid_tokens == 0:
        return "unsupervised"
    if minimum_valid_tokens is not None and num_valid_tokens < minimum_valid_tokens:
        return "filtered"
    results["input_ids"].append(list(input_ids))
    results["loss_mask"].append(list(loss_mask))
    results["seq_len"].append(len(input_ids))
    return "kept"


def _passthrough_pretokenized(
    examples: dict, max_length: int, minimum_valid_tokens: int | None = None
) -> dict[str, list]:
    """Carry speculator-format ``(input_ids, loss_mask)`` rows through.

    The producer already recorded which target-model tokens are supervised, so
    these rows only need truncation and filtering.
    """
    results: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    num_unsupervised = 0
    num_clipped = 0
    for ids, mask in zip(examples["input_ids"], examples["loss_mask"], strict=True):
        # A per-row length skew survives strict= column pairing; the collator
        # packs each key independently and would shift the mask silently.
        if len(ids) != len(mask):
            raise ValueError(
                f"Speculator-format row shape mismatch: "
                f"input_ids={len(ids)}, loss_mask={len(mask)}"
            )
        status = _append_row(results, ids, mask, max_length, minimum_valid_tokens)
        num_unsupervised += status == "unsupervised"
        # Kept-but-truncated only: a row clipped past its boundary reports as
        # unsupervised above, and would otherwise be counted twice.
        num_clipped += status == "kept" and len(ids) > max_length
    return results


def _preprocess_batch(examples: dict, render_endpoint: str | None, max_length: int,
                      minimum_valid_tokens: int | None = None) -> dict[str, list]:
    # Speculator-format rows already carry their supervision mask; pass them
    # through instead of re-rendering.
    if "input_ids" in examples and "loss_mask" in examples:
        return _passthrough_pretokenized(examples, max_length, minimum_valid_tokens)

    if render_endpoint is None:
        raise ValueError(
            "render_endpoint is required to convert natural-language "
            "conversations to speculator training rows"
        )
    raise NotImplementedError("the render path needs a vLLM /render endpoint")


# ---- load_and_preprocess_dataset's order of work ----------------------------------------------------------------
def permutation(n: int, seed: int) -> list[int]:
    """Stands in for HF datasets' Dataset.shuffle(seed): a seeded permutation of the rows."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def prepare(files: list[list[dict]], seq_length: int, seed: int = 0) -> list[dict]:
    """prepare_data.py's --data files (each a list of JSONL rows) as load_and_preprocess_dataset makes them one
    dataset: each file shuffled, preprocessed, then their concatenation shuffled again."""
    processed = []
    for rows in files:
        rows = [rows[i] for i in permutation(len(rows), seed)]
        examples = {k: [r[k] for r in rows] for k in rows[0]} if rows else {}
        out = _preprocess_batch(examples, None, seq_length)
        processed += [dict(zip(out, values)) for values in zip(*out.values())]
    return [processed[i] for i in permutation(len(processed), seed)]


# ---- src/speculators/train/data.py: ArrowDataset.__init__ ------------------------------------------------------
def train_split(data: list, train_ratio: float, split: Literal["train", "val"] = "train") -> list:
    if not 0.0 < train_ratio <= 1.0:
        raise ValueError(f"train_ratio must be in (0.0, 1.0], got {train_ratio}")
    if split == "val" and train_ratio == 1.0:
        raise ValueError("train_ratio=1.0 leaves no validation split")

    # Both splits derive their boundary from this one expression,
    # so they are exactly complementary.
    split_idx = int(len(data) * train_ratio)
    start, stop = (
        (0, split_idx) if split == "train" else (split_idx, len(data))
    )
    if start >= stop:
        raise ValueError(
            f"{split} split is empty (dataset has {len(data)} rows, "
            f"train_ratio={train_ratio} gives split_idx={split_idx})"
        )
    return data[start:stop]


# ---- src/speculators/train/config/schema.py ---------------------------------------------------------------------
class _Group(BaseModel):
    """Base for a config group: mutable (post-resolution) and lenient on extras."""

    model_config = ConfigDict(extra="ignore", validate_assignment=False)


_CLI_CHOICES = {"cli_choices": "hidden_states_backends"}


class DataArgs(_Group):
    data_path: str = Field(
        default="./output",
        description="Root data directory with the preprocessed dataset, vocab "
        "mappings (d2t.npy, t2d.npy), token frequencies (token_freq.pt), and hidden "
        "states.",
    )
    hidden_states_backend: str = Field(
        default="file",
        description="Hidden states transfer backend. Each backend may add its own CLI "
        "arguments. Default: 'file'.",
        json_schema_extra=_CLI_CHOICES,
    )
    total_seq_len: int = Field(
        default=8192, description="Maximum training sequence length, in tokens."
    )
    train_data_ratio: float = Field(
        default=0.9,
        description="Fraction of the dataset used for training; the remainder is held "
        "out for validation.",
    )
    noise_std: float = Field(
        default=0.05, description="Standard deviation for noise augmentation."
    )
    hidden_states_dtype: str = Field(
        default="bfloat16",
        description="Data type for dataloader hidden states and autocast compute. "
        "Model master weights are always kept in fp32. Options: float32, bfloat16 "
        "(recommended). float16 is not supported (requires gradient scaling).",
    )
    num_workers: int = Field(default=12, description="Number of dataloader workers.")
    prefetch_factor: int = Field(default=4, description="Dataloader prefetch factor.")
    max_anchors: int = Field(
        default=512,
        description="Maximum anchor positions for DFlash, DSpark, and P-EAGLE training "
        "(default: 512).",
    )


# ---- src/speculators/train/dataloader.py ------------------------------------------------------------------------
def create_train_val_loaders(*, data_path: list, train_data_ratio: float = 0.9) -> tuple[list, list]:
    if not (0.0 < train_data_ratio < 1.0):
        raise ValueError(f"train_data_ratio must be in (0, 1), got {train_data_ratio}")

    train_dataset = train_split(data_path, train_data_ratio, split="train")
    val_dataset = train_split(data_path, train_data_ratio, split="val")
    return train_dataset, val_dataset
