"""What a completion is generated with. Everything that changes the output is in the config hash.

The settings themselves (names, defaults, descriptions) are dflash_assets/settings.py; this module adds what a
generation config does: validate, hash, build the request body.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import Field

from dflash_assets.settings import ConfigError, DispatchSettings, GenerationSettings

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
        payload = json.dumps({"model": model, **settings}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    def sampling(self) -> dict:
        """Every sampling parameter, as both routes take them (chat body fields, /generate sampling_params)."""
        return {name: getattr(self, name) for name in SAMPLING_PARAMS}

    def chat_body(self, model: str, messages: list[dict], token_ids: bool = False) -> dict:
        extra = {"return_token_ids": True} if token_ids else {}
        return {**extra,
            "model": model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            **self.sampling(),
            "chat_template_kwargs": self.template_kwargs(),
            "separate_reasoning": True,
        }
