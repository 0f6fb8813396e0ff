"""Where each exported conversation ends: the turns of it the trainer reads, in every form.

An all_turns conversation is exported up to the turn where it ends for the trainer: whole when every turn passed;
ended at turn k when turn k was cut at or past the window, when turn k+1's history leaves the window no room for
min_loss_tokens (rules.leaves_loss_room; sent, refused or never sent), or when turn k's calls have no source results
(generation/turns.py `diverged`). Any other turn that did not pass keeps its conversation out, with the turn and why.
A last_turn conversation is its one row, judged by its own reason alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_assets.generation.shards import reason_kind
from dflash_assets.rules import leaves_loss_room

# the reasons of a row that say its prompt (its history) left the window no room for an answer
NO_ROOM = ("no_trainable_tokens", "too_few_loss_tokens")
NOT_WHOLE = "conversation_not_whole"  # a turn that passed, of a conversation a later turn keeps out
AFTER_END = "after_window_end"  # a turn that passed after its conversation's end for the trainer


@dataclass(frozen=True)
class Turn:
    """One committed turn of a conversation, as the export graded it."""

    turn: int
    reason: str | None
    window_complete: bool
    prompt_tokens: int
    completion_tokens: int
    judged_window: int
    position: tuple[int, int]  # (file_index, file_row_number): the row's identity in `graded`
    diverged: bool = False  # its conversation ends after it: no source result for its calls (or calls for results)


@dataclass(frozen=True)
class Ending:
    """Where a conversation ends for the trainer: exported through turn `through` (0: left out)."""

    through: int
    why: str  # "whole", "cut_past_window", "history_fills_window", "diverged", or why turn `turn` keeps it out
    turn: int  # the turn that decided it


def ending(
    turns: int,
    rows: dict[int, Turn],
    refused: dict[int, tuple[str, int | None]],
    failed: set[int],
    min_loss_tokens: int,
) -> Ending:
    """`rows`: turn -> its committed row (the kept copy, if any); `refused`: turn -> (its reject's reason, the
    prompt tokens it was refused with); `failed`: the turns whose retries ran out."""
    previous: Turn | None = None
    for k in range(1, turns + 1):
        row = rows.get(k)
        if row is None:
            if previous is None:
                return Ending(0, "not_generated", k)
            window = previous.judged_window
            if k in refused:
                reason, prompt_tokens = refused[k]
                if prompt_tokens is not None and not leaves_loss_room(prompt_tokens, window, min_loss_tokens):
                    return Ending(k - 1, "history_fills_window", k)
                return Ending(0, f"refused: {reason_kind(reason)}", k)
            if k in failed:
                return Ending(0, "failed", k)
            history = previous.prompt_tokens + previous.completion_tokens
            if not leaves_loss_room(history, window, min_loss_tokens):
                return Ending(k - 1, "history_fills_window", k)
            return Ending(0, "not_generated", k)
        if row.reason is not None:
            if (
                k > 1
                and row.reason in NO_ROOM
                and not leaves_loss_room(row.prompt_tokens, row.judged_window, min_loss_tokens)
            ):
                return Ending(k - 1, "history_fills_window", k)
            return Ending(0, row.reason, k)
        if row.window_complete:
            return Ending(k, "cut_past_window", k)
        if row.diverged and k < turns:
            return Ending(k, "diverged", k)
        previous = row
    return Ending(turns, "whole", turns)


@dataclass
class Selection:
    """The endings of the exported conversations, as the manifest counts them, and the rows they leave out."""

    whole: int = 0
    window_complete: dict[int, int] = field(default_factory=dict)  # ended at turn k -> conversations
    diverged: dict[int, int] = field(default_factory=dict)  # ended at turn k, its calls unanswered -> conversations
    left_out: dict[tuple[int, str], int] = field(default_factory=dict)  # (turn, why) -> conversations (turn > 1)
    reassigned: list[tuple[int, int, str]] = field(default_factory=list)  # (file_index, file_row_number, reason)

    def add(self, end: Ending, rows: dict[int, Turn]) -> None:
        if end.through == 0 and end.turn > 1:
            self.left_out[(end.turn, end.why)] = self.left_out.get((end.turn, end.why), 0) + 1
        elif end.why == "whole":
            self.whole += 1
        elif end.why == "diverged":
            self.diverged[end.through] = self.diverged.get(end.through, 0) + 1
        elif end.through:
            self.window_complete[end.through] = self.window_complete.get(end.through, 0) + 1
        for k, row in rows.items():
            if row.reason is None and k > end.through:
                self.reassigned.append((*row.position, NOT_WHOLE if end.through == 0 else AFTER_END))

    def manifest(self) -> dict[str, Any]:
        return {
            "whole": self.whole,
            "window_complete": {f"ended at turn {k}": n for k, n in sorted(self.window_complete.items())},
            "left_out": [
                {"turn": turn, "why": why, "conversations": n} for (turn, why), n in sorted(self.left_out.items())
            ],
        } | (  # agentic exports only: conversations that end where the target's calls found no source results
            {"diverged": {f"ended at turn {k}": n for k, n in sorted(self.diverged.items())}} if self.diverged else {}
        )

    @property
    def not_whole(self) -> int:
        return sum(self.left_out.values())
