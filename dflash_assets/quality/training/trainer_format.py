"""The drafter trainers' data format, as facts in our own code: what a training row must look like.

`row_problem` is SpecForge's `scripts/validate_regenerated_data.py` (`validate_row`, with `validate_conversation`
and `has_think_marker` of `scripts/conversation_validation.py`, at a6b6b02) rule for rule, in its order and its own
words; `recipe_flags` its recipe's flags (`examples/data_regeneration/run_qwen_sharegpt_regeneration.sh`). The
first line that fails aborts the whole file, so the export leaves such a row out and names why.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, cast

from dflash_assets.settings import TRAINER_FORMATS

STATUS = "success"
# what the export names as the validator it keeps equal (its manifest says it, beside the flags)
VALIDATOR = "SpecForge scripts/validate_regenerated_data.py (sgl-project/SpecForge a6b6b02)"
THINK_MARKERS = ("<think>", "</think>")
# what the manifest says of an agentic export's validation (tool_row_problem)
TOOL_VALIDATION = (
    "the validator refuses tool turns (a `tool` message, an assistant turn of calls with empty content) that "
    "SpecForge's trainer reads: do not run it on this file; each assistant turn was judged by its checks, tool "
    "turns allowed where SpecForge's parser keeps them"
)

# the export's forms: SpecForge's conversations, one row per assistant turn, the OpenAI messages form, and
# {id, input_ids, loss_mask}; "auto" picks per_turn or conversations (chosen_form)
AUTO = "auto"
FORMS = tuple(f for f in TRAINER_FORMATS if f != AUTO)
# SpecForge's chat templates (specforge/data/template.py) that render earlier assistant turns without their
# reasoning: a whole conversation trains its earlier answers bare, or (qwen3.5) its last turn only.
DROPS_EARLIER_REASONING = frozenset(
    {"qwen3.5", "qwen3-thinking", "qwen3-next-thinking", "kimi-k2-thinking", "kimi-k3-thinking", "deepseek-v32"}
)

# SpecForge's templates whose assistant header ends in an open think block (a6b6b02 specforge/data/template.py):
# rendered, a turn without reasoning becomes "<think>\n\n</think>\n\n" + content, all of it under loss.
OPENS_THINK_BLOCK = frozenset({"qwen3.5", "qwen3-next-thinking", "glm-5.2"})
# A config of thinking-off rows only is rendered with its family's instruct template, whose ignore_token zeroes the
# empty think block the server put in the prompt (specforge/data/template.py, parse.py GeneralParser).
THINKING_OFF_TEMPLATE = {t: "qwen3-instruct" for t in ("qwen3.5", "qwen3-thinking", "qwen3-next-thinking")}
# the templates under which a thinking-off row's empty think block, prompt tokens in the server's ids, is trained
TRAINS_EMPTY_THINK = OPENS_THINK_BLOCK | THINKING_OFF_TEMPLATE.keys()


def trained_template(chat_template: str, modes: frozenset[bool]) -> tuple[str, str]:
    """(the chat_template the trainer renders the text forms with, why) for rows of `modes` (their enable_thinking):
    a thinking-off config's instruct counterpart (THINKING_OFF_TEMPLATE), else the one set."""
    if modes == {False} and chat_template in THINKING_OFF_TEMPLATE:
        other = THINKING_OFF_TEMPLATE[chat_template]
        return other, (
            f"every row was generated with thinking off: {other} (not {chat_template}) puts no loss on the empty think "
            "block the server put in the prompt"
        )
    return chat_template, "as set"


@dataclass(frozen=True)
class Form:
    """What a trainer must know of an export form (quality/training/writers.py has one writer per form)."""

    name: str
    rendered: bool  # the trainer renders it with its chat template (a text form); else its token ids are read as is
    column: str  # the Parquet column of what the trainer reads (text forms: the messages)
    specforge_key: str  # SpecForge's DataConfig key naming the file
    train_only_last_turn: bool = False  # each row's last assistant turn is its sample (SpecForge's flag)


FORM = {
    f.name: f
    for f in (
        Form("conversations", rendered=True, column="conversations", specforge_key="train_data_path"),
        Form(
            "per_turn",
            rendered=True,
            column="conversations",
            specforge_key="train_data_path",
            train_only_last_turn=True,
        ),
        Form("messages", rendered=True, column="messages", specforge_key="train_data_path"),
        Form("pretokenized", rendered=False, column="input_ids", specforge_key="prompts_path"),
    )
}
assert tuple(FORM) == FORMS, "every trainer format has its form"


def chosen_form(
    form: str, all_turns: bool, chat_template: str, trainer: str = "specforge", modes: frozenset[bool] = frozenset()
) -> tuple[str, str]:
    """(the form exported, why) for `trainer`, the rows' `modes` (their enable_thinking) and the template the trainer
    renders them with. `auto`: speculators' is pretokenized; SpecForge's is pretokenized where thinking-off rows meet a
    template that trains their empty think block (TRAINS_EMPTY_THINK), per_turn for all_turns conversations under a
    template that drops earlier reasoning, else conversations. A text form set explicitly where the template would
    train forced tokens is refused (ValueError)."""
    forced = False in modes and chat_template in TRAINS_EMPTY_THINK and trainer == "specforge"
    if form != AUTO:
        if forced and FORM[form].rendered and form != "messages":
            raise ValueError(
                f"export form {form} renders rows generated with thinking off with chat_template {chat_template}, "
                "which puts their empty think block inside the assistant turn: such a row would be trained on "
                "`</think>` and the blank line, which the server put in its prompt; export it pretokenized "
                "(trainer.format pretokenized or auto)"
            )
        return form, "as set"
    if trainer == "speculators":
        return "pretokenized", "auto: speculators' prepare_data passes {input_ids, loss_mask} through as exported"
    if forced:
        return "pretokenized", (
            f"auto: thinking-off rows, whose `</think>` and blank line chat_template {chat_template} would train: the "
            "server's own ids, loss on generated tokens only"
        )
    if all_turns and chat_template in DROPS_EARLIER_REASONING:
        return "per_turn", (
            f"auto: regenerate all_turns under chat_template {chat_template}, which drops earlier turns' reasoning: "
            "a row per assistant turn (train_only_last_turn), so every decoded turn is trained"
        )
    return "conversations", "auto: " + (
        f"chat_template {chat_template} keeps every turn's reasoning" if all_turns else "one generated turn per row"
    )


@functools.lru_cache(maxsize=64)  # the validator's flag sets read the same messages: lowered once
def has_think_marker(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in THINK_MARKERS)


def think_marker_sql(*columns: str) -> str:
    """has_think_marker over text columns as one DuckDB boolean (a null column holds no marker). An RE2 search with
    only the letters case-insensitive, not lower() + contains(): faster on long reasoning, and DuckDB's lower() maps
    U+0130 unlike Python's."""
    pattern = "|".join(re.sub("[A-Za-z]+", lambda w: f"(?i:{w[0]})", re.escape(m)) for m in THINK_MARKERS)
    return " OR ".join(f"coalesce(regexp_matches({c}, '{pattern}'), false)" for c in columns)


def recipe_flags(enable_thinking: bool) -> dict[str, bool]:
    """The validator flags of SpecForge's own recipe for a config, as row_problem's keywords."""
    return {
        "expect_reasoning": enable_thinking,
        "expect_non_reasoning": not enable_thinking,
        "strict_think_markers": True,
    }


def flags_text(enable_thinking: bool) -> str:
    """The same flags as they are typed: `--expect-reasoning --strict-think-markers`."""
    return " ".join("--" + k.replace("_", "-") for k, on in recipe_flags(enable_thinking).items() if on)


def conversation_problem(messages: Any) -> str | None:
    """Why `messages` is not a conversation the validator takes (validate_conversation), or None."""
    if not isinstance(messages, list) or not messages:
        return "conversations must be a non-empty list"
    expected, saw_user = "user", False
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i} must be an object"
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, str) or not content.strip():
            return f"message {i} content must be a non-empty string"
        if role == "system" and not saw_user:
            continue
        if role not in ("user", "assistant"):
            return f"message {i} has unsupported role {role!r}"
        if role != expected:
            return f"message {i} expected role {expected!r}, got {role!r}"
        saw_user, expected = True, "assistant" if role == "user" else "user"
    if not saw_user:
        return "conversation has no user message"
    return None


def row_problem(
    line: Any,
    *,
    expect_reasoning: bool = True,
    expect_non_reasoning: bool = False,
    strict_think_markers: bool = True,
) -> str | None:
    """Why one JSONL line (conversations form) would stop SpecForge's validator (validate_row), or None. The
    defaults are the qwen3.6-27b recipe's flags; recipe_flags(enable_thinking) gives either recipe's."""
    if expect_reasoning and expect_non_reasoning:
        raise ValueError("expect_non_reasoning and expect_reasoning are mutually exclusive")
    if not isinstance(line, dict):
        return "expected a JSON object"
    if not isinstance(line.get("id"), str) or not line["id"].strip():
        return "id must be a non-empty string"
    if line.get("status") != STATUS:
        return f"status must be {STATUS!r}"
    messages = line.get("conversations")
    if problem := conversation_problem(messages):
        return problem
    return _assistants_problem(cast(list, messages), expect_reasoning, expect_non_reasoning, strict_think_markers)


def _assistants_problem(
    messages: list, expect_reasoning: bool, expect_non_reasoning: bool, strict_think_markers: bool
) -> str | None:
    """What the validator says of a conversation's assistant messages (validate_row's per-turn checks), or None."""
    assistants = 0
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        assistants += 1
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return f"assistant message {i} reasoning_content must be a string or null"
        if expect_non_reasoning and reasoning and reasoning.strip():
            return f"assistant message {i} has non-empty reasoning_content"
        if expect_reasoning and (not isinstance(reasoning, str) or not reasoning.strip()):
            return f"assistant message {i} has empty reasoning_content"
        if strict_think_markers and has_think_marker(m["content"]):
            return f"assistant message {i} contains a thinking marker"
        if strict_think_markers and isinstance(reasoning, str) and has_think_marker(reasoning):
            return f"assistant message {i} reasoning_content contains a thinking marker"
    if not assistants:
        return "conversation has no assistant message"
    if messages[-1].get("role") != "assistant":
        return "conversation must end with an assistant message"
    return None


def tool_row_problem(
    row: Any,
    *,
    expect_reasoning: bool = True,
    expect_non_reasoning: bool = False,
    strict_think_markers: bool = True,
) -> str | None:
    """row_problem for an agentic row: SpecForge's validator refuses the tool turns its trainer reads (parse.py's
    tool_calls and tool_call_id), so each assistant turn is judged by the validator's own checks, in the order
    SpecForge's parser keeps (a tool result after the assistant's calls, then the assistant)."""
    messages = row.get("conversations") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        return "conversations must be a non-empty list"
    before = "system"
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        calls = role == "assistant" and bool(m.get("tool_calls"))
        if not isinstance(content, str) or not (content.strip() or calls or role == "tool"):
            return f"message {i} content must be a non-empty string"
        allowed = {"system": ("system", "user"), "user": ("assistant",), "tool": ("tool", "assistant")}
        expected = ("tool",) if before == "calls" else ("user",) if before == "assistant" else allowed[before]
        if role not in expected:
            return f"message {i} expected role {' or '.join(map(repr, expected))}, got {role!r}"
        before = "calls" if calls else role
    return _assistants_problem(messages, expect_reasoning, expect_non_reasoning, strict_think_markers)
