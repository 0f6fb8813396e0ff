"""What a completion is generated with. Everything that changes the output is in the config hash."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


class ConfigError(ValueError):
    """Bad settings, found before any work starts."""


@dataclass(frozen=True)
class GenerationConfig:
    """The settings that decide what a completion is; rows record all of them."""

    max_output_tokens: int = 4096  # the cap: max_completion_tokens sent to the server
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    enable_thinking: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)  # extra kwargs beside enable_thinking

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
        if "enable_thinking" in self.chat_template_kwargs:
            problems.append("set enable_thinking with its own setting, not inside chat_template_kwargs")
        if problems:
            raise ConfigError("invalid generation config: " + "; ".join(problems))

    def template_kwargs(self) -> dict:
        """The chat_template_kwargs sent with every request (and with /v1/tokenize)."""
        return {**self.chat_template_kwargs, "enable_thinking": self.enable_thinking}

    def config_hash(self, model: str) -> str:
        """12 hex chars over the model and every setting that changes the output (not concurrency)."""
        payload = json.dumps({"model": model, **asdict(self)}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    def chat_body(self, model: str, messages: list[dict], token_ids: bool = False) -> dict:
        extra = {"return_token_ids": True} if token_ids else {}
        return {**extra,
            "model": model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "chat_template_kwargs": self.template_kwargs(),
            "separate_reasoning": True,
        }


@dataclass(frozen=True)
class DispatchSettings:
    """How hard to drive the fleet. None of this changes a completion, so none of it is hashed."""

    max_in_flight_per_server: int = 0  # 0: the server's own effective max_running_requests + waiting_margin
    waiting_margin: int = 2  # requests queued at each server beyond its running slots, so slots never idle
    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    request_timeout_s: float = 3600.0
    commit_rows: int = 512
    commit_seconds: float = 10.0
    progress_seconds: float = 30.0
    load_sample_s: float = 5.0  # poll each server's /v1/loads this often for the tuning report (0: off)
    store_token_ids: bool = False  # record prompt_token_ids and output_ids (needed to continue truncated rows)
    eject_after: int = 3  # consecutive retryable failures before a server is ejected and probed
    no_server_timeout_s: float = 120.0  # circuit breaker: stop when no server has been healthy this long

    def validate(self) -> None:
        if self.max_in_flight_per_server < 0:
            raise ConfigError(f"max_in_flight_per_server must be >= 0, got {self.max_in_flight_per_server}")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.commit_rows < 1 or self.commit_seconds <= 0:
            raise ConfigError("commit_rows must be >= 1 and commit_seconds > 0")
