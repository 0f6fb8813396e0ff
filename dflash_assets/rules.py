"""The domain's rules, each written once: the SQL fragment DuckDB uses beside the Python predicate, so a row a check
flags is exactly a row preflight would have refused. No imports from the rest of the project.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np

# ---- context overflow ------------------------------------------------------------------------------------------
# SGLang 0.5.23 answers 400 when prompt + max_new_tokens > context_len (tokenizer_manager._validate_one_request),
# and its scheduler then clamps max_new_tokens to max_req_len - prompt - 1 with max_req_len = context_len - 1
# (scheduler.py, tp_worker.py): above context - 2 a request is cut short without a word. So the budget that is
# really granted is context - CONTEXT_MARGIN.
CONTEXT_MARGIN = 2

OVERFLOW_SQL = f"prompt_tokens + max_output_tokens > server_context_length - {CONTEXT_MARGIN}"


# a prompt the context cannot hold at all, rejected at the source before any cap is chosen (generation/shards.py)
PROMPT_OVER_CONTEXT_SQL = "prompt_tokens >= server_context_length"


def prompt_over_context(prompt_tokens: int, context_length: int) -> bool:
    """The prompt alone fills the context: no answer fits, whatever the cap (PROMPT_OVER_CONTEXT_SQL)."""
    return prompt_tokens >= context_length


def overflows(prompt_tokens: int, max_output_tokens: int, context_length: int) -> bool:
    """The prompt plus the cap does not fit what the server really grants."""
    return prompt_tokens + max_output_tokens > context_length - CONTEXT_MARGIN


# The largest context any model SGLang serves declares (Llama 4 Scout's max_position_embeddings); SGLang refuses a
# --context-length above the model's own (srt/configs/model_config.py _derive_context_length): a cap above fits none.
LARGEST_CONTEXT = 10_485_760


def context_needed(prompt_tokens: int, max_output_tokens: int) -> int:
    """The smallest --context-length under which this prompt and cap fit."""
    return prompt_tokens + max_output_tokens + CONTEXT_MARGIN


# ---- finish_reason ---------------------------------------------------------------------------------------------
# SGLang sends "stop", "length" (the cap cut it) or "abort" (retried, never committed). RUNAWAY_FINISH is the
# client's own: a generation it stopped because it looped (fleet/stream.py), cut short of the cap.
RUNAWAY_FINISH = "runaway"
STOPPED_EARLY_SQL = f"finish_reason = '{RUNAWAY_FINISH}'"
CUT_SQL = f"finish_reason IN ('length', '{RUNAWAY_FINISH}')"  # the model did not choose its end (planner rows)
# A config's cap is the one its user set (policy_cap under the window policy, whose rows record their own request's
# cap as max_output_tokens). A request the window sized below the cap is final: it stays cut at every cap.
CONFIG_CAP_SQL = "coalesce(policy_cap, max_output_tokens)"
WINDOW_SIZED_SQL = f"max_output_tokens < {CONFIG_CAP_SQL}"


# "tool_calls" is SGLang's "stop" renamed because its tool-call parser found calls in the output (serving_chat.py
# _process_tool_calls): the model ended on its own. A row records it as "stop", its calls in `tool_calls_json`.
TOOL_CALLS_FINISH = "tool_calls"


def row_finish(finish_reason: str) -> str:
    """The finish_reason a row records of what the server sent: a tool-call stop is a stop."""
    return "stop" if finish_reason == TOOL_CALLS_FINISH else finish_reason


def stopped_early(finish_reason: str | None) -> bool:
    """A runaway the client stopped while it ran (not cut by the cap)."""
    return finish_reason == RUNAWAY_FINISH


# ---- accounting ------------------------------------------------------------------------------------------------
def outcomes_sql(where: str = "true", completions="completions", rejects="rejects", failures="failures") -> str:
    """What happened to each prompt under each config, the first class that applies: `outcome` 1 completed, 2
    rejected, 3 failed (prompts = completed + rejected + failed + missing), over the tables named."""
    return f"""SELECT shard, config_hash, prompt_id, min(outcome) AS outcome FROM (
    SELECT shard, config_hash, prompt_id, 1 AS outcome FROM {completions}
    UNION ALL SELECT shard, config_hash, prompt_id, 2 FROM {rejects} WHERE stage <> 'source'
    UNION ALL SELECT shard, config_hash, prompt_id, 3 FROM {failures}
) WHERE {where} GROUP BY ALL"""


# ---- blank text ------------------------------------------------------------------------------------------------
# "Blank" means null or only ASCII whitespace (in SQL a regex search, which stops at once where trim() copies)
BLANK_CHARS = " \t\r\n"


def blank_sql(column: str) -> str:
    return f"({column} IS NULL OR NOT regexp_matches({column}, '[^ \\t\\r\\n]'))"


def is_blank(text: str | None) -> bool:
    return text is None or text.strip(BLANK_CHARS) == ""


# ---- percentiles -----------------------------------------------------------------------------------------------
# Nearest-rank: Pq is the value at 1-based rank ceil(q * n) of the sorted values, always an observed token count,
# never an interpolation (so when more than 10% of rows stop at a 4096 cap, P90 = P99 = 4096).
PERCENTILE_DEFINITION = "nearest-rank (DuckDB quantile_disc): Pq = value at 1-based rank ceil(q*n) of sorted values"


def percentile_sql(column: str, qs: Sequence[float | str]) -> str:
    return f"quantile_disc({column}, [{', '.join(str(q) for q in qs)}])"


def percentile(values: Sequence[int] | np.ndarray, q: float) -> int:
    return int(np.quantile(np.asarray(values), q, method="inverted_cdf"))


# ---- the latest config ----------------------------------------------------------------------------------------
# `latest` is the config most recently written (the largest created_at of its rows), never "the most rows": what
# every step takes when no config is named. Ties go to the larger cap, then the smaller hash, never to file order.
LATEST_ORDER_SQL = f"max(created_at) DESC NULLS LAST, max({CONFIG_CAP_SQL}) DESC, config_hash"


def latest_first(configs: Iterable[tuple[str, datetime | None, int]]) -> list[tuple[str, datetime | None, int]]:
    """(config_hash, last written, cap) tuples, the most recently written config first."""
    return sorted(configs, key=lambda c: (-(c[1].timestamp() if c[1] else float("-inf")), -(c[2] or 0), c[0]))


# ---- the trainer's window ----------------------------------------------------------------------------------------
# A row the cap cut is judged against the trainer's window (DESIGN.md, the trainer's window): cut inside it, the
# truncation that blocks; cut at or past it, window-complete. In SQL the window is a number or an expression.
def _window_sql(max_length: int | str) -> str:
    return f"({max_length})" if isinstance(max_length, str) else str(int(max_length))


def row_window_sql(max_length: int) -> str:
    """The window a completion row is judged by: the one its requests were sized to (cap_policy window rows
    record trainer_max_length), else the trainer's window in force (a fixed-cap row records none)."""
    return f"coalesce(trainer_max_length, {int(max_length)})"


def cut_inside_window_sql(max_length: int | str) -> str:
    return f"(finish_reason = 'length' AND prompt_tokens + completion_tokens < {_window_sql(max_length)})"


def window_complete_sql(max_length: int | str) -> str:
    """Cut at or past the window with some of its answer inside it (runaways included: the caller leaves them out
    where they must stay out; a prompt that fills the window has no answer inside it: fills_window)."""
    window = _window_sql(max_length)
    return f"(finish_reason = 'length' AND prompt_tokens + completion_tokens >= {window} AND prompt_tokens < {window})"


def cut_inside_window(finish_reason: str | None, prompt_tokens: int, completion_tokens: int, max_length: int) -> bool:
    return finish_reason == "length" and prompt_tokens + completion_tokens < max_length


def window_complete(finish_reason: str | None, prompt_tokens: int, completion_tokens: int, max_length: int) -> bool:
    return finish_reason == "length" and prompt_tokens + completion_tokens >= max_length > prompt_tokens


# Trained tokens: the generated tokens of a row that fall inside the window, min(completion, max_length - prompt)
# (never negative). Decoded per trained token is the figure the pipeline is measured by (the floor is 1.00).
def trained_tokens_sql(max_length: int | str) -> str:
    return f"greatest(0, least(completion_tokens, {_window_sql(max_length)} - prompt_tokens))"


def trained_tokens(prompt_tokens: int, completion_tokens: int, max_length: int) -> int:
    return max(0, min(completion_tokens, max_length - prompt_tokens))


def fills_window(prompt_tokens: int, max_length: int) -> bool:
    """The prompt alone fills the window: the trainer would read no answer (a reject under the window policy, a
    sample with no trainable token under a fixed cap, which the export leaves out: no_trainable_tokens)."""
    return prompt_tokens >= max_length


def fills_window_sql(max_length: int | str, prompt_tokens: str = "prompt_tokens") -> str:
    return f"({prompt_tokens} >= {_window_sql(max_length)})"


# ---- what the trainer keeps ------------------------------------------------------------------------------------
# SpecForge's DFlash data path drops a sample without two adjacent supervised tokens (specforge/data/loss_mask.py
# has_consecutive_supervised_tokens). An exported sample's supervised tokens are one run, so the trainer keeps it iff
# trained_tokens >= min_loss_tokens; before a request only the prompt is known (leaves_loss_room).
def trainable_sql(max_length: int | str, min_loss_tokens: int | str) -> str:
    return f"({trained_tokens_sql(max_length)} >= {_window_sql(min_loss_tokens)})"


def leaves_loss_room(prompt_tokens: int, max_length: int, min_loss_tokens: int) -> bool:
    """The prompt leaves the window room for min_loss_tokens supervised tokens: what preflight asks of a request."""
    return max_length - prompt_tokens >= min_loss_tokens


def window_cap(cap: int, max_length: int, prompt_tokens: int, overshoot: int) -> int:
    """The window policy's request: no more than the cap, no more than the window's rest plus the overshoot (which
    keeps the window's end inside generated text after the trainer re-tokenizes the sample)."""
    return max(1, min(cap, max_length - prompt_tokens + overshoot))


def stores_token_ids(store_token_ids: bool, cap_policy: str, trainer_format: str | None = None) -> bool:
    """Token ids are stored whenever asked, and by default under the window policy or the pre-tokenized export,
    which is built from them (and continuing window-complete rows to a larger window needs them)."""
    return store_token_ids or cap_policy == "window" or trainer_format == "pretokenized"


# ---- the figures of one config's answer --------------------------------------------------------------------------
# What every view says of a config is counted by these definitions and no other, each with its unit (a turn row or
# a conversation), in SQL over the quality tables (quality/tables.py).
CUT_AT_CAP_SQL = "(finish_reason = 'length')"  # the cap ended the row (a runaway stopped while streaming did not)


@dataclass(frozen=True)
class Figure:
    """One figure of a config's answer: its name as shown, its unit, what it counts, and the SQL that counts it."""

    name: str
    unit: str  # "turn rows" or "conversations"
    definition: str
    # a boolean over a row of the quality tables' `completions` (turn rows), or over a conversation's rows, grouped by
    # (shard, prompt_id) (conversations)
    sql: str


FIGURES = (
    Figure(
        "cut at the cap",
        "turn rows",
        "finish_reason = 'length': the cap, not the model, ended the answer (runaways that hit the cap included)",
        CUT_AT_CAP_SQL,
    ),
    Figure(
        "cut inside the window",
        "turn rows",
        "cut at the cap with prompt + completion < the window (max_length): the trainer reads an end the model did "
        "not choose; the blocking share (check truncation_rate)",
        "cut_inside_window",
    ),
    Figure(
        "window-complete",
        "turn rows",
        "cut at the cap at or past the window, with some answer inside it, not a runaway: the trainer reads it as "
        "it reads the complete answer, so the export keeps it",
        "window_complete",
    ),
    Figure(
        "runaway",
        "turn rows",
        f"cut while repeating itself: finish_reason '{RUNAWAY_FINISH}' (stopped early) or cut at the cap with a "
        "looping tail; no cap ends it",
        "runaway",
    ),
    Figure(
        "filling the window",
        "turn rows",
        "prompt_tokens >= the window: the trainer reads no answer at all, the export leaves it out "
        "(no_trainable_tokens)",
        fills_window_sql("judged_window"),
    ),
    Figure(
        "shortened",
        "conversations",
        "a conversation (regenerate all_turns) with no row of its last assistant turn: a turn cut at or past the "
        "window or a history that fills it ends it for the trainer (kept up to that turn), and calls without source "
        "results, a turn refused or failed end it too (left out: not whole)",
        "bool_or(turns IS NOT NULL) AND NOT coalesce(bool_or(turn >= turns), false)",
    ),
)
FIGURE = {f.name: f for f in FIGURES}


def draw_key(seed: int | str, prompt_id: str) -> bytes:
    """A prompt's seeded draw: sha256("<seed>:<prompt_id>"), the same on every machine. The quotas draw in its order
    (generation/quotas.py), the held-out split and the mode of a mix below a share of it (`drawn`)."""
    return hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()


def drawn(share: float, seed: int | str, prompt_id: str) -> bool:
    """Whether a prompt falls in a seeded share: the first 8 bytes of its draw key, read as a number, below
    share * 2**64."""
    return share > 0 and int.from_bytes(draw_key(seed, prompt_id)[:8], "big") < share * 2**64


def thinks(prompt_id: str, thinking_share: float, seed: int) -> bool:
    """A seeded mix of modes: whether this prompt is generated with enable_thinking on; its draw is keyed
    "thinking:<seed>", apart from the quotas' and the held-out split's, so the three are not correlated."""
    return drawn(thinking_share, f"thinking:{seed}", prompt_id)
