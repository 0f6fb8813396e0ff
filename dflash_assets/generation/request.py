"""What a generation run asks: its typed config (GenerationRun), the per-request decisions over its settings (a
request's cap, whether the window refuses it, the prompt's mode), what every row records of them, and the chat body
SGLang's route takes."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_assets.rules import fills_window, leaves_loss_room, stores_token_ids, window_cap
from dflash_assets.rules import thinks as drawn_thinking
from dflash_assets.settings import DispatchSettings, GenerationSettings, QualitySettings, RunawaySettings


@dataclass(frozen=True)
class GenerationRun:
    """A generation run's config, typed, as the `completions` asset, `dflash generate` and a script hand it to the
    engine: what a completion is, how hard to drive the fleet, what preflight does with a misfit ('reject' or
    'fail') and the loop rules a streamed request is watched by (None: the defaults)."""

    generation: GenerationSettings
    dispatch: DispatchSettings = DispatchSettings()
    preflight_policy: str = "reject"
    runaway: RunawaySettings | None = None

    def __post_init__(self) -> None:
        if self.preflight_policy not in ("reject", "fail"):
            raise ValueError(f"preflight_policy must be 'reject' or 'fail', got {self.preflight_policy!r}")

    @classmethod
    def of(
        cls, config: object, quality: QualitySettings, preflight_policy: str = "reject", history: bool | None = None
    ) -> GenerationRun:
        """A completions config's run, sized to the quality settings' trainer window, watched by their runaway rules,
        its token ids stored as rules.stores_token_ids says. `history`: whether the source carries earlier assistant
        turns, what regenerate auto resolves by (None: left to the engine)."""
        generation = GenerationSettings.of(config, quality.trainer)
        generation = generation if history is None else generation.resolved(history)
        dispatch = DispatchSettings.taken_from(config)
        token_ids = stores_token_ids(dispatch.store_token_ids, generation.cap_policy, quality.trainer.format)
        dispatch = dispatch.model_copy(update={"store_token_ids": token_ids})
        return GenerationRun(generation, dispatch, preflight_policy, quality.runaway)


def request_cap(generation: GenerationSettings, prompt_tokens: int) -> int:
    """The request's cap (a row's max_output_tokens): the config's cap, or under the window policy the window's rest
    (rules.window_cap)."""
    if not generation.windowed:
        return generation.max_output_tokens
    return window_cap(generation.max_output_tokens, generation.trainer_max_length, prompt_tokens, generation.overshoot)


def window_problem(generation: GenerationSettings, prompt_tokens: int) -> str | None:
    """Why the window policy refuses this prompt (it fills the trainer's window, or leaves it no room to train), or
    None."""
    window, least = generation.trainer_max_length, generation.min_loss_tokens
    if not generation.windowed:
        return None
    if fills_window(prompt_tokens, window):
        return (
            f"prompt of {prompt_tokens} tokens fills the trainer's window max_length "
            f"{window}: the trainer would read no answer (cap_policy window)"
        )
    if not leaves_loss_room(prompt_tokens, window, least):
        return (
            f"prompt of {prompt_tokens} tokens leaves the trainer's window max_length {window} "
            f"room for fewer than min_loss_tokens {least} supervised tokens: the trainer would "
            f"drop the sample (cap_policy window)"
        )
    return None


def thinks(generation: GenerationSettings, prompt_id: str | None) -> bool:
    """Whether this prompt is generated with thinking on: enable_thinking, or its seeded draw under a mix."""
    if generation.thinking_share is None or prompt_id is None:
        return generation.enable_thinking
    return drawn_thinking(prompt_id, generation.thinking_share, generation.mode_seed)


def template_kwargs(generation: GenerationSettings, prompt_id: str | None = None) -> dict:
    """The chat_template_kwargs sent with a prompt's requests (and with /v1/tokenize): its mode under a mix."""
    return {**generation.chat_template_kwargs, "enable_thinking": thinks(generation, prompt_id)}


def window_columns(generation: GenerationSettings) -> dict:
    """What a row records of the window policy: the config's cap and the window (null under a fixed cap)."""
    windowed = generation.windowed
    return {
        "policy_cap": generation.max_output_tokens if windowed else None,
        "trainer_max_length": generation.trainer_max_length if windowed else None,
    }


def config_columns(generation: GenerationSettings) -> dict:
    """What every row of a config records of it besides its own request: the sampling, the window policy and the mix
    of modes (null for one mode): a config is read off its rows (store/configs.py)."""
    mixed = generation.thinking_share is not None
    return {
        **generation.sampling(),
        **window_columns(generation),
        "thinking_share": generation.thinking_share,
        "mode_seed": generation.mode_seed if mixed else None,
    }


def chat_body(
    generation: GenerationSettings,
    model: str,
    messages: list[dict],
    token_ids: bool = False,
    request_cap: int | None = None,
    prompt_id: str | None = None,
    tools: list[dict] | None = None,
) -> dict:
    """The chat request; `request_cap` is this request's own, default the config's; `prompt_id` draws the
    prompt's mode under a mix (thinks); `tools` the conversation's tool schemas, which the model may call as it
    chooses (tool_choice "auto"; they are never executed)."""
    extra: dict = {"return_token_ids": True} if token_ids else {}
    if tools:
        extra |= {"tools": tools, "tool_choice": "auto"}
    return {
        **extra,
        "model": model,
        "messages": messages,
        "max_completion_tokens": generation.max_output_tokens if request_cap is None else request_cap,
        **generation.sampling(),
        "chat_template_kwargs": template_kwargs(generation, prompt_id),
        "separate_reasoning": True,
    }
