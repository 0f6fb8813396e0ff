"""Before the first request: does every prompt plus the cap fit what the servers will really grant?

SGLang 0.5.23 answers 400 above the context, clamps max_new_tokens silently within two tokens of it (rules.py), and
far below it when the KV pool is smaller than the context (max_req_len from /server_info `max_req_input_len`); it
refuses prompts of max_req_input_len tokens or more. Offenders are found here, with the numbers, instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_assets.fleet.client import ServerInfo
from dflash_assets.rules import CONTEXT_MARGIN, context_needed, overflows


class PreflightError(RuntimeError):
    """The run cannot go ahead: nothing has been sent. `context_length_needed`: the servers' context length that
    would fit every prompt at the cap, when restarting them with it is the fix."""

    def __init__(self, message: str, context_length_needed: int | None = None) -> None:
        super().__init__(message)
        self.context_length_needed = context_length_needed


def cap_refusal(context_length: int, request_cap: int, where: str, largest_prompt: int = 1) -> str | None:
    """Why a request cap leaves no prompt any room in a context (one sentence with the fix), or None: then no prompt
    can fit, whatever the prompts are, and the cap is refused before anything runs (cli/flags.py) or is sent. The
    context to ask for holds the largest prompt when it is known."""
    if context_length - CONTEXT_MARGIN - request_cap >= 1:
        return None
    return (
        f"max_output_tokens {request_cap:,} leaves no room for a prompt in the servers' context length "
        f"{context_length:,} ({where}; {CONTEXT_MARGIN} tokens kept free): lower --max-output-tokens below "
        f"{context_length - CONTEXT_MARGIN:,}, or give the servers --context-length "
        f"{context_needed(largest_prompt, request_cap):,} or more"
    )


@dataclass(frozen=True)
class Budget:
    """The token budget every server of the fleet can honour."""

    context_length: int  # /v1/models max_model_len
    max_req_input_len: int  # /server_info
    max_req_len: int | None = None  # /server_info max_req_input_len + 5: min(context, KV pool) - 1
    kv_pool: int | None = None  # /server_info max_total_num_tokens of the server with the smallest max_req_len
    margin = CONTEXT_MARGIN  # dflash_assets/rules.py: SGLang's silent clamp within two tokens of the context

    @classmethod
    def of(cls, infos: list[ServerInfo]) -> Budget:
        context = min(i.context_length for i in infos)
        input_limit = min((i.max_req_input_len or i.context_length) for i in infos)
        tightest = min(infos, key=lambda i: i.max_req_len)
        return cls(context, input_limit, tightest.max_req_len, tightest.max_total_num_tokens)

    @property
    def kv_bound(self) -> bool:
        """The KV pool, not the context, limits a request: SGLang would clamp below the context silently."""
        return self.max_req_len is not None and self.max_req_len - 1 < self.context_length - CONTEXT_MARGIN

    @property
    def total_limit(self) -> int:
        """The largest prompt + max_output_tokens the servers grant in full."""
        if self.kv_bound and self.max_req_len is not None:
            return self.max_req_len - 1
        return self.context_length - CONTEXT_MARGIN

    def problem(self, prompt_tokens: int, request_cap: int) -> str | None:
        """Why this prompt cannot be sent with this request cap, naming the numbers; None if it fits."""
        if prompt_tokens >= self.max_req_input_len:
            return (
                f"prompt of {prompt_tokens} tokens is at or over the server's input limit of "
                f"{self.max_req_input_len} tokens (context length {self.context_length})"
            )
        if self.kv_bound:
            if prompt_tokens + request_cap <= self.total_limit:
                return None
            return (
                f"prompt of {prompt_tokens} tokens + max_output_tokens {request_cap} = {prompt_tokens + request_cap} "
                f"exceeds the {self.total_limit} tokens the server grants a request: its KV pool holds "
                f"{self.kv_pool} tokens, fewer than its context length {self.context_length}, and SGLang "
                f"would cut the output below the request_cap silently"
            )
        if not overflows(prompt_tokens, request_cap, self.context_length):
            return None
        return (
            f"prompt of {prompt_tokens} tokens + max_output_tokens {request_cap} = {prompt_tokens + request_cap} "
            f"exceeds the server context length {self.context_length} minus a safety margin of "
            f"{CONTEXT_MARGIN} tokens"
        )


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
    small_pool = [i for i in infos if i.max_total_num_tokens is not None and i.max_total_num_tokens < i.context_length]
    if small_pool:
        detail = ", ".join(f"{i.url}: {i.max_total_num_tokens} < {i.context_length}" for i in small_pool)
        limit = min(i.max_req_len for i in infos) - 1
        notes.append(
            f"KV pool smaller than the context length ({detail}): SGLang clamps a request's output to "
            f"the pool silently; preflight holds prompt + max_output_tokens to {limit}"
        )
    thinking = [i.url for i in infos if i.always_thinks]
    if thinking and not enable_thinking:
        notes.append(
            f"enable_thinking is off but the chat template of {', '.join(thinking)} opens <think> "
            f"whatever it is told (SGLang then forces reasoning): those rows will reason anyway"
        )
    unparsed = [i.url for i in infos if not i.reasoning_parser]
    if enable_thinking and unparsed:
        notes.append(
            f"enable_thinking is on but {', '.join(unparsed)} run without --reasoning-parser: the "
            f"thinking will stay inside `content` (reasoning_content empty); start them with "
            f"--reasoning-parser qwen3"
        )
    return notes


def tool_parser_error(infos: list[ServerInfo]) -> PreflightError | None:
    """An agentic source needs every server to parse tool calls: without --tool-call-parser a call stays text in
    `content` and the conversation's tool results could not be spliced after it."""
    missing = [i.url for i in infos if not i.tool_call_parser]
    if not missing:
        return None
    return PreflightError(
        f"the prompts carry tool schemas but {', '.join(missing)} run without --tool-call-parser: their tool calls "
        f"would stay text in `content`. Nothing was sent. Start the servers with --tool-call-parser (qwen25 for "
        f"Qwen models) and run again."
    )


def overflow_error(
    budget: Budget, config_cap: int, overflowing: int, total: int, largest_prompt: int
) -> PreflightError:
    if budget.kv_bound:
        return PreflightError(
            f"{overflowing} of {total} prompts do not fit: the servers grant a request at most "
            f"{budget.total_limit} tokens (prompt + output) because their KV pool holds {budget.kv_pool} tokens, "
            f"fewer than the context length {budget.context_length}; max_output_tokens is {config_cap}, so a prompt may "
            f"have at most {budget.total_limit - config_cap} tokens; the largest prompt has {largest_prompt}. Nothing was "
            f"sent. Lower max_output_tokens or give the servers a KV pool of at least "
            f"{context_needed(largest_prompt, config_cap)} tokens (a higher --mem-fraction-static, or "
            f"--max-total-tokens unset)."
        )
    needed = context_needed(largest_prompt, config_cap)
    if no_room := cap_refusal(budget.context_length, config_cap, "read from the servers", largest_prompt):
        return PreflightError(
            f"{overflowing} of {total} prompts do not fit: {no_room}. Nothing was sent.", context_length_needed=needed
        )
    return PreflightError(
        f"{overflowing} of {total} prompts do not fit: the servers' context length is {budget.context_length} "
        f"tokens and max_output_tokens is {config_cap}, so a prompt may have at most "
        f"{budget.context_length - CONTEXT_MARGIN - config_cap} tokens; the largest prompt has {largest_prompt}. "
        f"Nothing was sent. Lower max_output_tokens or restart the servers with "
        f"--context-length {needed} or more.",
        context_length_needed=needed,
    )
