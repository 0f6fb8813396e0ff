"""The drafter trainers' data format, as facts in our own code: what a training row must look like.

SpecForge's `scripts/validate_regenerated_data.py` (`validate_row`, with `validate_conversation` and
`has_think_marker` of `scripts/conversation_validation.py`; read at sgl-project/SpecForge
a6b6b0230009d15ec2a97a57384e6f53f0f96946, 8 August 2026), rule for rule and in its order, with its own words. Its
recipe (`examples/data_regeneration/run_qwen_sharegpt_regeneration.sh`) runs it with `--expect-reasoning
--strict-think-markers` for a thinking model (qwen3.6-27b) and `--expect-non-reasoning --strict-think-markers`
without thinking (qwen3-8b): `recipe_flags`. A JSONL line is accepted when:
- it is a JSON object; `id` is a non-empty string and `status` is "success";
- `conversations` is a non-empty list of objects, each with a non-empty string `content`; system turns may come
  before the first user turn; then user and assistant alternate from the user (any other role is refused);
- every assistant turn's `reasoning_content` is a string or null; with --expect-non-reasoning an empty one, with
  --expect-reasoning a non-empty one;
- with --strict-think-markers no assistant `content` nor `reasoning_content` holds `<think>` or `</think>`
  (case-insensitive);
- there is an assistant turn, and the last message is the assistant's.
The first line that fails aborts the whole file, so the export leaves such a row out and names why (export.py).
"""

from __future__ import annotations

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
# SpecForge's chat templates (a6b6b02 specforge/data/template.py) with parser_type "thinking" render a conversation
# with the model's own template: Qwen3's keeps reasoning only after the last user turn, and SpecForge puts loss on
# each assistant span, so a whole conversation trains its earlier answers without their reasoning (qwen3-thinking)
# or, under qwen3.5 (whose assistant header ends "<think>\n"), its last turn only
# (test_expanded_event_qwen35_masks_only_current_generation).
DROPS_EARLIER_REASONING = frozenset(
    {"qwen3.5", "qwen3-thinking", "qwen3-next-thinking", "kimi-k2-thinking", "kimi-k3-thinking", "deepseek-v32"}
)

# SpecForge's templates whose assistant header ends in an open think block (a6b6b02 specforge/data/template.py):
# rendered, a turn without reasoning becomes "<think>\n\n</think>\n\n" + content, all of it under loss.
OPENS_THINK_BLOCK = frozenset({"qwen3.5", "qwen3-next-thinking", "glm-5.2"})
# A config of thinking-off rows only is rendered with its family's instruct template instead: header
# "<|im_start|>assistant\n" and ignore_token ["<think>\n\n</think>\n\n"], which zeroes the empty think block the
# server put in the prompt (a6b6b02 specforge/data/template.py, parse.py GeneralParser: tests/support/
# specforge_preprocessing.py runs it on exports). A thinking-on row keeps the thinking template: under the instruct
# header the `<think>\n` the generation prompt pre-opens would be trained.
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
    """(the form exported, why) for `trainer` (TrainerSettings.name), the rows' `modes` (their enable_thinking) and
    the template the trainer renders them with (trained_template). `auto`: speculators' is pretokenized (the one
    form its prepare_data reads as is, settings.TRAINER_READS); SpecForge's is pretokenized where thinking-off rows
    meet a template that trains their empty think block (a mix of modes: one template renders the whole file, and a thinking-off
    row's `</think>` and blank line, prompt tokens in the server's ids, would be trained), per_turn for regenerated
    multi-turn conversations (all_turns) under a template that drops earlier reasoning, so that every decoded turn is
    trained, else conversations. A text form set explicitly where the template would train forced tokens is refused
    (ValueError), never written."""
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


def has_think_marker(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in THINK_MARKERS)


def think_marker_sql(*columns: str) -> str:
    """has_think_marker over text columns as one DuckDB boolean (a null column holds no marker): the flag the
    think_marker check and the export's exclusion read, so they refuse exactly what --strict-think-markers does.
    A case-insensitive RE2 search, not lower() + contains(): 7x faster on long reasoning, and DuckDB's lower()
    maps U+0130 to "i" where Python's gives "i" + a combining dot (tests/quality/training/test_trainer_format.py compares them).
    Only the letters are case-insensitive, so each marker starts with a literal "<" that RE2 can skip to: twice
    as fast as a pattern that is case-insensitive throughout."""
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
    """row_problem for an agentic row. SpecForge's validator (a6b6b02) refuses a `tool` message and an assistant turn
    whose content is empty (tests/support/specforge.py), though its trainer reads both (build_eagle3_dataset's
    `tools`, parse.py's tool_calls and tool_call_id): every assistant turn is judged by the validator's own checks,
    in the order SpecForge's parser keeps (a tool result after the assistant's calls, then the assistant)."""
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
