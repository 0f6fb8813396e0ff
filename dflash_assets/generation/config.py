"""What a completion is generated with. Everything that changes the output is in the config hash.

The settings themselves (names, defaults, descriptions) are dflash_assets/settings.py; this module adds what a
generation config does: validate, hash, build the request body.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import Field

from dflash_assets.rules import fills_window, window_cap
from dflash_assets.settings import CAP_POLICIES, ConfigError, DispatchSettings, GenerationSettings

__all__ = ["ConfigError", "DispatchSettings", "GenerationConfig"]


REGENERATE = ("last_turn", "all_turns")
SAMPLING_PARAMS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")  # recorded per row, under these names


class GenerationConfig(GenerationSettings):
    """The settings that decide what a completion is; rows record all of them."""

    chat_template_kwargs: dict = Field(default_factory=dict)  # extra kwargs beside enable_thinking

    def validate(self) -> None:
        problems = []
        if not isinstance(self.max_output_tokens, int) or self.max_output_tokens <= 0:
            problems.append(f"max_output_tokens must be a positive integer, got {self.max_output_tokens!r}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k == 0 or self.top_k < -1:
            problems.append(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not 0 < self.repetition_penalty <= 2:
            problems.append(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                problems.append(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if self.regenerate not in REGENERATE:
            problems.append(f"regenerate must be one of {', '.join(REGENERATE)}, got {self.regenerate!r}")
        if self.cap_policy not in CAP_POLICIES:
            problems.append(f"cap_policy must be one of {', '.join(CAP_POLICIES)}, got {self.cap_policy!r}")
        if self.trainer_max_length < 1:
            problems.append(f"trainer_max_length must be a positive integer, got {self.trainer_max_length!r}")
        if self.overshoot < 0:
            problems.append(f"overshoot must be >= 0, got {self.overshoot!r}")
        if "enable_thinking" in self.chat_template_kwargs:
            problems.append("set enable_thinking with its own setting, not inside chat_template_kwargs")
        if problems:
            raise ConfigError("invalid generation config: " + "; ".join(problems))

    def template_kwargs(self) -> dict:
        """The chat_template_kwargs sent with every request (and with /v1/tokenize)."""
        return {**self.chat_template_kwargs, "enable_thinking": self.enable_thinking}

    def config_hash(self, model: str) -> str:
        """12 hex chars over the model and every setting that changes the output (not concurrency)."""
        settings = self.model_dump()
        if settings["regenerate"] == "last_turn":  # the behaviour before the setting existed: the same hashes
            del settings["regenerate"]
        if settings["cap_policy"] == "fixed":  # the window does not change a fixed-cap request: the same hashes
            for name in ("cap_policy", "trainer_max_length", "overshoot"):
                del settings[name]
        payload = json.dumps({"model": model, **settings}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    @property
    def windowed(self) -> bool:
        return self.cap_policy == "window"

    @property
    def window(self) -> int | None:
        """The trainer's window the requests are sized to; None under a fixed cap."""
        return self.trainer_max_length if self.windowed else None

    def request_cap(self, prompt_tokens: int) -> int:
        """max_output_tokens of one request: the cap, or under the window policy the window's rest (rules.py)."""
        if not self.windowed:
            return self.max_output_tokens
        return window_cap(self.max_output_tokens, self.trainer_max_length, prompt_tokens, self.overshoot)

    def window_problem(self, prompt_tokens: int) -> str | None:
        """Why the window policy refuses this prompt (it fills the trainer's window), or None."""
        if self.windowed and fills_window(prompt_tokens, self.trainer_max_length):
            return (f"prompt of {prompt_tokens} tokens fills the trainer's window max_length "
                    f"{self.trainer_max_length}: the trainer would read no answer (cap_policy window)")
        return None

    def sampling(self) -> dict:
        """Every sampling parameter, as both routes take them (chat body fields, /generate sampling_params)."""
        return {name: getattr(self, name) for name in SAMPLING_PARAMS}

    def chat_body(self, model: str, messages: list[dict], token_ids: bool = False, cap: int | None = None) -> dict:
        """The chat request; `cap` is this request's own max_output_tokens (request_cap), default the cap."""
        extra = {"return_token_ids": True} if token_ids else {}
        return {**extra,
            "model": model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens if cap is None else cap,
            **self.sampling(),
            "chat_template_kwargs": self.template_kwargs(),
            "separate_reasoning": True,
        }
