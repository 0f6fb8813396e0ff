"""Checks on the text: empty answers, leaked think markers, and how the reasoning parser split truncated rows (the
flags are computed once in tables.py, the row predicates defined in rates.ROW_PREDICATES). When the cap cuts the
thinking, everything lands in reasoning_content and content is "" (truncated thinking).
"""

import duckdb

from dflash_assets.quality.checks.rates import group_counts, rate_finding
from dflash_assets.quality.outcome import Finding
from dflash_assets.settings import QualitySettings


def empty_content(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Rows with empty content, except truncated thinking (reported by truncated_thinking and truncation_rate):
    an answer that finished and said nothing is a parser or server defect."""
    return rate_finding(
        "empty_content",
        "have empty content (truncated thinking not counted)",
        group_counts(con, "empty_content"),
        quality.empty_content_rate_max,
        why="A finished completion with no answer: check the reasoning parser split and the server logs.",
    )


def think_markers(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Rows whose content or reasoning_content holds `<think>` or `</think>` (any case, the trainer's rule): the
    reasoning was not split off (no --reasoning-parser, or separate_reasoning off), so the drafter would learn
    the raw markers; the trainer's validator refuses them and the export excludes them."""
    return rate_finding(
        "think_marker",
        "leak `<think>` or `</think>` (any case) into content or reasoning_content",
        group_counts(con, "think_marker"),
        quality.think_markers_rate_max,
        why="Start the servers with --reasoning-parser (qwen3) and keep separate_reasoning on.",
    )


def reasoning_misrouted(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Among enable_thinking rows: finish 'length' with no reasoning_content but non-empty content, i.e. the
    truncated thinking was routed into content (a known parser failure on truncation)."""
    groups = group_counts(con, "misrouted", rows="thinking")
    if not groups:
        return Finding(True, "Not applicable: no rows with enable_thinking in scope.", {"rows": 0})
    return rate_finding(
        "misrouted",
        "finished 'length' with empty reasoning_content and non-empty content (thinking routed into content)",
        groups,
        quality.reasoning_misrouted_rate_max,
        why="The content of these rows is unfinished thinking, not an answer: the export drops them (not 'stop').",
        noun="thinking rows",
    )


def truncated_thinking(con: duckdb.DuckDBPyConnection, quality: QualitySettings) -> Finding:
    """Share of rows cut by the cap inside the thinking: finish 'length', reasoning present, content empty."""
    return rate_finding(
        "truncated_thinking",
        "were cut inside the thinking (finish 'length', reasoning present, content empty): `</think>` never came",
        group_counts(con, "truncated_thinking"),
        quality.truncated_thinking_rate_max,
        why="These prompts think longer than the cap allows: raise max_output_tokens for them.",
    )
