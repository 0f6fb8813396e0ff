"""Before the first request: does every prompt plus the cap fit the servers' real context length?

SGLang 0.5.23 answers a request whose prompt + max_new_tokens exceeds the context with a 400, and
clamps silently within two tokens of it (the rule and its margin: quality/rules.py); the scheduler also
refuses prompts within ~6 tokens of the context (max_req_input_len). Offenders are found here, with the
numbers, instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_assets.fleet.client import ServerInfo
from dflash_assets.quality.rules import CONTEXT_MARGIN, context_needed, overflows


class PreflightError(RuntimeError):
    """The run cannot go ahead: nothing has been sent."""


@dataclass(frozen=True)
class Budget:
    """The token budget every server of the fleet can honour."""

    context_length: int
    max_req_input_len: int

    @classmethod
    def of(cls, infos: list[ServerInfo]) -> Budget:
        context = min(i.context_length for i in infos)
        input_limit = min((i.max_req_input_len or i.context_length) for i in infos)
        return cls(context, input_limit)

    def problem(self, prompt_tokens: int, cap: int) -> str | None:
        """Why this prompt cannot be sent with this cap, naming the numbers; None if it fits."""
        if prompt_tokens >= self.max_req_input_len:
            return (f"prompt of {prompt_tokens} tokens is at or over the server's input limit of "
                    f"{self.max_req_input_len} tokens (context length {self.context_length})")
        if overflows(prompt_tokens, cap, self.context_length):
            return (f"prompt of {prompt_tokens} tokens + max_output_tokens {cap} = {prompt_tokens + cap} "
                    f"exceeds the server context length {self.context_length} minus a safety margin of "
                    f"{CONTEXT_MARGIN} tokens")
        return None


def check_fleet(infos: list[ServerInfo], enable_thinking: bool = False) -> list[str]:
    """Refuse a fleet that serves more than one model; return notes on what else looks wrong."""
    models = sorted({i.model for i in infos})
    if len(models) > 1:
        detail = ", ".join(f"{i.url} serves {i.model!r}" for i in infos)
        raise PreflightError(f"the fleet serves {len(models)} different models, refusing to mix them: {detail}")
    notes = []
    contexts = {i.context_length for i in infos}
    if len(contexts) > 1:
        detail = ", ".join(f"{i.url}: {i.context_length}" for i in infos)
        notes.append(f"servers disagree on context length ({detail}); using the smallest, {min(contexts)}")
    unparsed = [i.url for i in infos if not i.reasoning_parser]
    if enable_thinking and unparsed:
        notes.append(f"enable_thinking is on but {', '.join(unparsed)} run without --reasoning-parser: the "
                     f"thinking will stay inside `content` (reasoning_content empty); start them with "
                     f"--reasoning-parser qwen3")
    return notes


def overflow_error(budget: Budget, cap: int, overflowing: int, total: int, largest_prompt: int) -> PreflightError:
    return PreflightError(
        f"{overflowing} of {total} prompts do not fit: the servers' context length is {budget.context_length} "
        f"tokens and max_output_tokens is {cap}, so a prompt may have at most "
        f"{budget.context_length - CONTEXT_MARGIN - cap} tokens; the largest prompt has {largest_prompt}. "
        f"Nothing was sent. Lower max_output_tokens or restart the servers with "
        f"--context-length {context_needed(largest_prompt, cap)} or more."
    )
