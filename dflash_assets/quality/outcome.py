"""What a check returns, the knobs it is judged by, and how its figures are written for people."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from dflash_assets.quality.runaway import RunawayRules
from dflash_assets.settings import TrainerSettings

Severity = Literal["ERROR", "WARN"]
MetadataValue = int | float | str


@dataclass(frozen=True)
class Finding:
    """What one check function found: the verdict, a Markdown summary naming what is wrong, and its figures."""

    passed: bool
    summary_md: str
    metadata: dict[str, MetadataValue]


@dataclass(frozen=True)
class CheckOutcome:
    """A finding stamped with the check's name and severity: the shape Dagster's AssetCheckResult wants."""

    name: str
    passed: bool
    severity: Severity
    summary_md: str
    metadata: dict[str, MetadataValue]
    blocking: bool = False


@dataclass(frozen=True)
class Thresholds:
    """Every limit the checks judge by. Rates are shares of rows in [0, 1]; a check passes when rate <= limit.

    Defects that mean the pipeline itself is wrong (duplicates, leaked think markers, empty answers, rows made
    with a budget that did not fit the context) default to zero tolerance: the export drops such rows anyway,
    so a non-zero count says "a stage is broken", not "the data is a bit noisy".
    """

    # share of rows cut inside the trainer's window (rules.py), per shard and per config: the blocking truncation
    truncation_rate_max: float = 0.05
    cap_saturation_percentile: float = 0.99  # fails when this percentile of completion_tokens reaches the cap
    cap_mismatch_rate_max: float = 0.0  # rows where "at the cap" and finish_reason 'length' disagree
    silent_clamp_rate_max: float = 0.0  # rows that finished 'length' below their own max_output_tokens
    context_overflow_rate_max: float = 0.0  # completion rows generated with prompt + cap > context
    overflow_reject_rate_max: float = 0.01  # prompts of a config rejected because prompt + cap > context
    missing_rate_max: float = 0.0  # accounting: prompts with no completion, reject or failure row
    duplicate_rate_max: float = 0.0  # extra rows on (prompt_id, config_hash)
    empty_content_rate_max: float = 0.0
    think_marker_rate_max: float = 0.0
    reasoning_misrouted_rate_max: float = 0.0  # among enable_thinking rows
    truncated_thinking_rate_max: float = 0.01
    trainer: TrainerSettings = TrainerSettings()  # the drafter trainer's window (max_length) and export form
    past_window_rate_max: float = 0.02  # share of decoded tokens past the window (WARN): GPU time no step trains on
    max_length_overflow_rate_max: float = 0.05
    runaway_rate_max: float = 0.0  # rows cut while looping (WARN): any is worth a look at the sampling settings
    runaway: RunawayRules = RunawayRules()  # what counts as a loop
    severity: Mapping[str, Severity] = field(default_factory=dict)  # check name -> severity override


def pct(rate: float) -> str:
    """A share as a percentage with two decimals: 0.18312 -> '18.31%'."""
    return f"{rate * 100:.2f}%"


def num(n: int) -> str:
    """A count with thousands separators: 1000 -> '1,000'."""
    return f"{n:,}"


def plural(n: int, noun: str) -> str:
    """'1 row', '1,000 rows': a count with its noun, plural unless one."""
    return f"{num(n)} {noun}" if n == 1 else f"{num(n)} {noun}s"


def share(part: int, whole: int) -> float:
    """part / whole, 0.0 for an empty whole (an empty scope has nothing wrong in it)."""
    return part / whole if whole else 0.0


def config_label(config_hash: str | None, max_output_tokens: int | None) -> str:
    return f"config `{config_hash}` (max_output_tokens {max_output_tokens})"


def verdict(rate: float, limit: float) -> str:
    return f"over the {pct(limit)} threshold" if rate > limit else f"within the {pct(limit)} threshold"


def bullets(lines: list[str], limit: int = 10) -> str:
    """A Markdown list of the first `limit` lines, saying how many more were left out."""
    shown = [f"- {line}" for line in lines[:limit]]
    if len(lines) > limit:
        shown.append(f"- ... and {num(len(lines) - limit)} more")
    return "\n".join(shown)
