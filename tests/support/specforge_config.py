"""Copies of SpecForge's own config and validator code (sgl-project/SpecForge
a6b6b0230009d15ec2a97a57384e6f53f0f96946), so the tests judge the trainer's file, command and validation by its code:
- DataConfig and StrictConfigModel: specforge/config/schema.py (the `data:` block, only its own keys);
- eval_problem: the evaluation checks of Config's after-validator (schema.py, lines 740-755), with `mode` "offline"
  when data.hidden_states_path is set, else "online" (as its mode resolution does for the data source);
- apply_overrides: schema.py's, over the data block and training.eval_interval alone (the rest of Config is the
  user's recipe);
- iter_jsonl, validate_row, validate_dataset and parse_args' flags: scripts/validate_regenerated_data.py, with
  validate_conversation and has_think_marker of scripts/conversation_validation.py (tests/support/specforge.py).
"""
# ruff: noqa
# fmt: off

import argparse
import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tests.support.specforge import validate_basic_conversation as validate_conversation


# ---- specforge/config/schema.py ---------------------------------------------------------------------------------
class StrictConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(StrictConfigModel):
    #: online mode — raw conversation JSON/JSONL.
    train_data_path: str = ""
    #: online mode — already-tokenized JSONL records.
    prompts_path: str = ""
    #: offline mode — directory of precomputed hidden-state .ckpt files.
    hidden_states_path: str = ""
    #: Reserved migration field. Online evaluation is unsupported; keep empty.
    eval_data_path: str = ""
    #: offline evaluation — directory of precomputed hidden-state .ckpt files.
    eval_hidden_states_path: str = ""
    max_length: int = Field(default=2048, gt=0)
    chat_template: str = "llama3"
    is_preformatted: bool = False
    train_only_last_turn: bool = False
    build_dataset_num_proc: int = Field(default=8, gt=0)
    dataloader_num_workers: Optional[int] = Field(default=None, ge=0)
    cache_dir: str = "./cache"
    cache_key: Optional[str] = None
    max_prompts: Optional[int] = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _exactly_one_source(self):
        sources = [
            bool(self.train_data_path),
            bool(self.prompts_path),
            bool(self.hidden_states_path),
        ]
        if sum(sources) != 1:
            raise ValueError(
                "set exactly one of data.train_data_path (raw online data), "
                "data.prompts_path (pre-tokenized online data), or "
                "data.hidden_states_path (offline features)"
            )
        return self


class Config(StrictConfigModel):
    data: DataConfig
    training: Dict[str, Any] = {"eval_interval": 0}

    @model_validator(mode="after")
    def _eval(self):
        mode = "offline" if self.data.hidden_states_path else "online"
        if self.data.eval_data_path:
            raise ValueError(
                "data.eval_data_path is unsupported; online evaluation is not "
                "supported by the server-only capture path"
            )
        has_eval_source = bool(self.data.eval_hidden_states_path)
        has_eval_interval = int(self.training.get("eval_interval", 0)) > 0
        if has_eval_source != has_eval_interval:
            raise ValueError(
                "an eval data source and training.eval_interval must be "
                "configured together"
            )
        if self.data.eval_hidden_states_path and mode != "offline":
            raise ValueError(
                "data.eval_hidden_states_path requires an offline training data source"
            )
        return self


def apply_overrides(config: Config, overrides: List[str]) -> Config:
    """Apply dotted ``section.field=value`` overrides, re-validating the result."""
    raw = config.model_dump()
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form path=value")
        path, value = item.split("=", 1)
        node = raw
        keys = path.split(".")
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                raise ValueError(f"override path {path!r} does not exist")
            node = node[key]
        if keys[-1] not in node:
            raise ValueError(f"override path {path!r} does not exist")
        node[keys[-1]] = value  # pydantic coerces scalars on re-validation
    return Config.model_validate(raw)


# ---- scripts/conversation_validation.py, scripts/validate_regenerated_data.py ---------------------------------
def has_think_marker(content: str) -> bool:
    lowered = content.lower()
    return "<think>" in lowered or "</think>" in lowered


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Validate regenerated ShareGPT JSONL before training."
    )
    parser.add_argument("--data-path", required=True, type=Path)
    reasoning_group = parser.add_mutually_exclusive_group()
    reasoning_group.add_argument(
        "--expect-non-reasoning",
        action="store_true",
        help="Reject non-empty assistant reasoning_content.",
    )
    reasoning_group.add_argument(
        "--expect-reasoning",
        action="store_true",
        help="Require non-empty assistant reasoning_content.",
    )
    parser.add_argument(
        "--strict-think-markers",
        action="store_true",
        help="Reject <think> and </think> in assistant content or reasoning_content.",
    )
    return parser.parse_args(argv)


def iter_jsonl(path: Path) -> Iterable[tuple[int, Dict[str, Any]]]:
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {line_number}: invalid JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ValueError(f"line {line_number}: expected a JSON object")
            yield line_number, row


def validate_row(
    row: Dict[str, Any],
    *,
    expect_non_reasoning: bool,
    expect_reasoning: bool = False,
    strict_think_markers: bool,
) -> int:
    """Validate one generated training row and return its assistant count."""
    row_id = row.get("id")
    if not isinstance(row_id, str) or not row_id.strip():
        raise ValueError("id must be a non-empty string")
    if row.get("status") != "success":
        raise ValueError("status must be 'success'")

    messages = row.get("conversations")
    conversation_error = validate_conversation(messages)
    if conversation_error is not None:
        raise ValueError(conversation_error)

    assistant_count = 0
    for index, message in enumerate(messages):
        role = message.get("role")
        if role != "assistant":
            continue

        content = message["content"]
        assistant_count += 1
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(
                f"assistant message {index} reasoning_content must be a string or null"
            )
        if expect_non_reasoning and reasoning and reasoning.strip():
            raise ValueError(
                f"assistant message {index} has non-empty reasoning_content"
            )
        if expect_reasoning and (
            not isinstance(reasoning, str) or not reasoning.strip()
        ):
            raise ValueError(f"assistant message {index} has empty reasoning_content")
        if strict_think_markers and has_think_marker(content):
            raise ValueError(f"assistant message {index} contains a thinking marker")
        if (
            strict_think_markers
            and isinstance(reasoning, str)
            and has_think_marker(reasoning)
        ):
            raise ValueError(
                f"assistant message {index} reasoning_content contains a thinking marker"
            )

    if assistant_count == 0:
        raise ValueError("conversation has no assistant message")
    if messages[-1].get("role") != "assistant":
        raise ValueError("conversation must end with an assistant message")
    return assistant_count


def validate_dataset(
    path: Path,
    *,
    expect_non_reasoning: bool = False,
    expect_reasoning: bool = False,
    strict_think_markers: bool = False,
) -> int:
    """The rows of a file that passes (validate_dataset's summary.rows); raises ValueError at the first bad line."""
    if expect_non_reasoning and expect_reasoning:
        raise ValueError(
            "expect_non_reasoning and expect_reasoning are mutually exclusive"
        )
    rows = 0
    for line_number, row in iter_jsonl(path):
        try:
            validate_row(
                row,
                expect_non_reasoning=expect_non_reasoning,
                expect_reasoning=expect_reasoning,
                strict_think_markers=strict_think_markers,
            )
        except ValueError as exc:
            raise ValueError(f"line {line_number}: {exc}") from exc
        rows += 1
    if rows == 0:
        raise ValueError(f"{path} contains no data rows")
    return rows
