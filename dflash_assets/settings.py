"""Every setting once: one typed model per group, with its default and its description.

The Dagster run config (`defs/run_config.py`, `CompletionsConfig`), the `fleet` resource (`defs/resources.py`)
and the `dflash` flags (`cli.py`) are derived from these models, so a default is written here and nowhere else
(tests/test_settings.py builds all three and compares them). No Dagster import: the plain libraries and the CLI
use these models directly.

- GenerationSettings: what a completion is (every row records them; they are hashed into config_hash).
- DispatchSettings: how hard to drive the fleet (never hashed).
- ServerFlags / LaunchSettings: the `sglang serve` of `launch` mode and `dflash fleet up`.
- ProbeSettings: the length probe's sample and cap (the `length_probe` asset and `dflash probe`).
- TrainerSettings: the drafter trainer's window (max_length) and the export form it reads.
- FleetSettings: how the pipeline reaches its servers (`emulated`, `attach`, `launch`).
- DEPLOYMENT: the environment variables a deployment sets, with their defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

DEMO_PROMPTS = Path(__file__).resolve().parent / "demo" / "prompts.jsonl"
FLEET_MODES = ("emulated", "attach", "launch")


class ConfigError(ValueError):
    """Bad settings, found before any work starts."""


class Settings(BaseModel):
    # frozen: a settings object is a value (hashable, safe to share between shards and tasks)
    model_config = ConfigDict(frozen=True)

    @classmethod
    def taken_from(cls, source: object):
        """This group's fields, read off an object that carries them (a Dagster config, parsed CLI flags); a field
        the object does not carry keeps its default."""
        return cls(**{name: getattr(source, name) for name in cls.model_fields if hasattr(source, name)})


TRAINER_FORMATS = ("conversations", "messages", "pretokenized")  # TrainerSettings.format
CAP_POLICIES = ("fixed", "window")  # GenerationSettings.cap_policy
WINDOW_FIELDS = ("cap_policy", "trainer_max_length", "overshoot")  # GenerationSettings: how the window sizes requests


class TrainerSettings(Settings):
    """The drafter trainer that reads the export: how much of each sample it reads, and in which form.

    SpecForge tokenizes the rendered sample with truncation=True, max_length=data.max_length (2048 or 4096 in its
    qwen3.6-27b DFlash recipes, 4096 for the online ones); speculators slices to --seq-length (default 8192).
    Whatever lies past the window is never trained on (docs/trainer-window.md)."""

    max_length: int = Field(
        4096, description="The trainer's window in tokens, counted as the trainer counts it: the rendered sample, "
                          "prompt plus assistant (SpecForge data.max_length; speculators --seq-length).")
    format: str = Field(
        "conversations", description="The export form: 'conversations' (SpecForge's {id, status, conversations}), "
                                     "'messages' (OpenAI's {id, messages}) or 'pretokenized' ({id, input_ids, "
                                     "loss_mask} from the server's own token ids, read as is by SpecForge's online "
                                     "trainer and speculators).")

    def validate(self) -> None:  # noqa: D102
        problems = []
        if self.max_length < 1:
            problems.append(f"trainer max_length must be a positive integer, got {self.max_length}")
        if self.format not in TRAINER_FORMATS:
            problems.append(f"trainer format must be one of {', '.join(TRAINER_FORMATS)}, got {self.format!r}")
        if problems:
            raise ConfigError("; ".join(problems))

    def named(self) -> str:
        """The window as every report names it, with how to change it."""
        return (f"the trainer's window max_length {self.max_length:,} (trainer.max_length; change it with "
                f"--trainer-max-length or the quality resource's trainer.max_length)")


class GenerationSettings(Settings):
    """The settings that decide what a completion is; rows record all of them."""

    max_output_tokens: int = Field(4096, description="The cap: max_completion_tokens of every request.")
    temperature: float = Field(0.6, description="Sampling temperature (>= 0).")
    top_p: float = Field(0.95, description="Nucleus sampling, in (0, 1].")
    top_k: int = Field(20, description="Top-k sampling; -1 turns it off.")
    # sent explicitly too: left out, the chat route takes them from the model's generation_config.json
    # (protocol.py to_sampling_params) while /generate uses SamplingParams' defaults, and a continued row
    # would be sampled unlike its parent
    min_p: float = Field(0.0, description="Min-p sampling, in [0, 1].")
    repetition_penalty: float = Field(1.0, description="Repetition penalty, in (0, 2] (1 = off).")
    presence_penalty: float = Field(0.0, description="Presence penalty, in [-2, 2].")
    frequency_penalty: float = Field(0.0, description="Frequency penalty, in [-2, 2].")
    enable_thinking: bool = Field(True, description="chat_template_kwargs.enable_thinking (Qwen3 thinking traces).")
    regenerate: str = Field(
        "last_turn", description="Which assistant turns are generated: 'last_turn' (the final one, or a new answer "
                                 "to a final user turn) or 'all_turns' (every one, in order, each conditioned on "
                                 "the regenerated ones before it).")
    cap_policy: str = Field(
        "fixed", description="'fixed': every request asks max_output_tokens; 'window': each request asks "
                             "min(max_output_tokens, trainer_max_length - prompt_tokens + overshoot), the tokens "
                             "the trainer's window reads, and a prompt that fills the window is rejected.")
    trainer_max_length: int = Field(
        TrainerSettings().max_length, description="cap_policy window: the trainer's window the requests are sized "
                                                  "to (TrainerSettings.max_length).")
    overshoot: int = Field(
        16, description="cap_policy window: tokens asked past the window, so that after the trainer re-renders "
                        "and re-tokenizes the sample its window still ends inside generated text (never on a "
                        "closing tag the model did not write).")


class DispatchSettings(Settings):
    """How hard to drive the fleet. None of this changes a completion, so none of it is hashed."""

    max_in_flight_per_server: int = Field(
        0, description="Requests in flight per server; 0 = the server's own max_running_requests + waiting_margin.")
    waiting_margin: int = Field(
        2, description="Requests queued at each server beyond its running slots, so its slots never idle.")
    max_attempts: int = Field(4, description="Attempts per request on retryable errors (5xx, timeouts).")
    backoff_base_s: float = Field(0.5, description="First retry delay; doubles each attempt (with jitter).")
    backoff_max_s: float = Field(30.0, description="The longest retry delay.")
    eject_after: int = Field(3, description="Consecutive retryable failures before a server is ejected and probed.")
    commit_rows: int = Field(512, description="Commit a Parquet part every this many rows ...")
    commit_seconds: float = Field(10.0, description="... or every this many seconds.")
    progress_seconds: float = Field(30.0, description="A progress line in the run log every this many seconds.")
    store_token_ids: bool = Field(
        False, description="Record prompt_token_ids and output_ids (return_token_ids): exact ids for training, "
                           "and what continuing truncated rows at a larger cap needs.")
    load_sample_s: float = Field(
        5.0, description="Poll each server's /v1/loads this often for the fleet tuning report (0: off).")
    no_server_timeout_s: float = Field(
        120.0, description="Stop the run when no server has been healthy for this long (committed rows stay).")
    same_server_max_imbalance: float = Field(
        0.25, description="all_turns: a conversation's next turn goes to the server of its previous turn (whose "
                          "prefix cache holds the history) unless that server's share of busy slots exceeds the "
                          "least-loaded server's by more than this (negative: always the least-loaded server).")

    stream: bool = Field(
        True, description="Stream every generation request (SSE) and watch it while it runs: a stall is noticed "
                          "in stall_timeout_s, a loop stopped when it starts (docs/streaming.md). Off: one blocking "
                          "POST per request, watched by request_timeout_s only.")
    stall_timeout_s: float = Field(
        60.0, description="stream: a request whose stream sends no token for this long is closed (SGLang aborts "
                          "it) and retried on another server.")
    first_token_timeout_s: float = Field(
        900.0, description="stream: the same, before the first token (a request queued behind a busy server's "
                           "running ones waits longer than a decode step).")
    runaway_check_tokens: int = Field(
        256, description="stream: apply the runaway rules to the streamed text every this many tokens; a loop is "
                         "stopped and committed with finish_reason 'runaway' (0: off, runaways decode to the cap).")

    def validate(self) -> None:  # noqa: D102  (pydantic v2 has no instance validate: ours checks the values)
        if self.stall_timeout_s <= 0 or self.first_token_timeout_s <= 0:
            raise ConfigError(f"stall_timeout_s and first_token_timeout_s must be > 0, got {self.stall_timeout_s} "
                              f"and {self.first_token_timeout_s}")
        if self.runaway_check_tokens < 0:
            raise ConfigError(f"runaway_check_tokens must be >= 0 (0: off), got {self.runaway_check_tokens}")
        if self.max_in_flight_per_server < 0:
            raise ConfigError(f"max_in_flight_per_server must be >= 0, got {self.max_in_flight_per_server}")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.commit_rows < 1 or self.commit_seconds <= 0:
            raise ConfigError("commit_rows must be >= 1 and commit_seconds > 0")


PROBE_MODES = ("prompts", "cut_rows")  # ProbeSettings.mode


class ProbeSettings(Settings):
    """The length probe: which prompts (a seeded random sample) and at which cap. Its sampling settings are the
    GenerationSettings, which must match the run the plan is for."""

    max_output_tokens: int = Field(
        0, description="The probe's cap; 0 = the largest the fleet's context allows for the sampled prompts.")
    size: int = Field(0, description="Prompts in the probe; 0 = the larger of min_prompts and share of all prompts.")
    share: float = Field(0.01, description="Share of the prompts to sample when size is 0.")
    min_prompts: int = Field(500, description="At least this many prompts when size is 0.")
    seed: int = Field(0, description="Seed of the random sample: the same prompts and seed give the same sample.")
    mode: str = Field("prompts", description="What the probe samples: 'prompts' (random prompts generated at the "
                                             "probe's cap) or 'cut_rows' (the run's honest cut rows, continued to "
                                             "it: every row informs the tail; needs a run at a smaller cap).")

    def validate(self) -> None:  # noqa: D102
        problems = []
        if self.mode not in PROBE_MODES:
            problems.append(f"mode must be one of {', '.join(PROBE_MODES)}, got {self.mode!r}")
        if self.max_output_tokens < 0:
            problems.append(f"max_output_tokens must be >= 0 (0: the largest the context allows), got "
                            f"{self.max_output_tokens}")
        if self.size < 0:
            problems.append(f"size must be >= 0 (0: from share and min_prompts), got {self.size}")
        if not 0 < self.share <= 1:
            problems.append(f"share must be in (0, 1], got {self.share}")
        if self.min_prompts < 1:
            problems.append(f"min_prompts must be >= 1, got {self.min_prompts}")
        if problems:
            raise ConfigError("; ".join(problems))


class ServerFlags(Settings):
    """The typed `sglang serve` flags of one server. None means "SGLang decides" and emits no flag."""

    served_model_name: Optional[str] = Field(None, description="The model name the server answers to.")
    host: str = Field("127.0.0.1", description="Where the server listens (loopback unless told otherwise).")
    tp_size: int = Field(1, description="Tensor-parallel GPUs per server.")
    context_length: Optional[int] = Field(None, description="--context-length (default: the model's).")
    max_running_requests: Optional[int] = Field(None, description="--max-running-requests.")
    max_mamba_cache_size: Optional[int] = Field(None, description="--max-mamba-cache-size (hybrid models).")
    mem_fraction_static: Optional[float] = Field(None, description="--mem-fraction-static, in (0, 1).")
    chunked_prefill_size: Optional[int] = Field(None, description="--chunked-prefill-size.")
    cuda_graph_max_bs_decode: Optional[int] = Field(None, description="--cuda-graph-max-bs-decode.")
    reasoning_parser: Optional[str] = Field("qwen3", description="--reasoning-parser: thinking goes to "
                                                                 "reasoning_content.")
    enable_metrics: bool = Field(True, description="--enable-metrics: Prometheus /metrics.")
    max_queued_requests: Optional[int] = Field(None, description="--max-queued-requests.")
    # SGLang's default is 1 (an event per token): parsing those costs the client 0.56-0.93 cores at the story's
    # 24,500 tok/s, over its 0.5-core budget; at 4 it is 0.15-0.16 (benchmarks/bench_streaming.py cpu, docs/streaming.md)
    stream_interval: Optional[int] = Field(4, description="--stream-interval: tokens per streamed event (SGLang's "
                                                           "default 1 costs the client too much CPU to parse).")


class LaunchSettings(ServerFlags):
    """`launch` mode and `dflash fleet up`: one `sglang serve` per GPU (or per tp_size GPUs), detached."""

    model_path: str = Field("", description="The model every server loads (a local directory or a HF repo id).")
    gpus: str = Field("0", description="Comma-separated GPU ids.")
    base_port: int = Field(30000, description="The server on GPU g listens on base_port + g.")
    command: str = Field("sglang", description="'sglang' (sglang serve), 'launch_server' (python -m "
                                               "sglang.launch_server), 'emulator', or a full command line.")
    extra_args: str = Field("", description="More sglang serve flags, quoted as one string.")
    health_timeout_s: float = Field(1200.0, description="Seconds to wait for a new server's /health.")


class FleetSettings(Settings):
    """How the pipeline reaches its servers. The API key is not here: it comes from DFLASH_API_KEY only."""

    mode: str = Field("emulated", description="'emulated', 'attach' or 'launch'.")
    urls: str = Field("", description="attach: comma-separated base URLs (or one router / gateway URL).")
    num_servers: int = Field(2, description="emulated: how many emulator servers.")
    emulator_args: str = Field("--reasoning-parser qwen3", description="emulated: emulator flags, e.g. add "
                                                                       "'--decode-tokens-per-s 4000'.")
    health_timeout_s: float = Field(120.0, description="Seconds to wait for every server's /health at connect.")
    request_timeout_s: float = Field(3600.0, description="Seconds one request may take (a long generation).")


@dataclass(frozen=True)
class EnvSetting:
    """A deployment setting: the environment variable that sets it and the default when it is unset."""

    name: str
    default: str

    def value(self) -> str:
        return os.environ.get(self.name, self.default)


class Deployment:
    """The environment variables of a deployment (docs/settings.md). Resources read them as Dagster EnvVars at
    run launch; the two that shape the definitions themselves (a schedule's cron, a backfill's runs) are read
    when the code location loads, because Dagster fixes them there (see defs/partitions.py)."""

    DATA_DIR = EnvSetting("DFLASH_DATA_DIR", "data")
    LOCAL_DIR = EnvSetting("DFLASH_LOCAL_DIR", "data")
    PROMPTS = EnvSetting("DFLASH_PROMPTS", str(DEMO_PROMPTS))
    SHARD_SIZE = EnvSetting("DFLASH_SHARD_SIZE", "100")
    SHARDS_PER_RUN = EnvSetting("DFLASH_SHARDS_PER_RUN", "8")
    CHECKS_CRON = EnvSetting("DFLASH_CHECKS_CRON", "0 * * * *")
    FLEET_MODE = EnvSetting("DFLASH_FLEET_MODE", FleetSettings().mode)
    FLEET_URLS = EnvSetting("DFLASH_FLEET_URLS", FleetSettings().urls)
    NUM_SERVERS = EnvSetting("DFLASH_NUM_SERVERS", str(FleetSettings().num_servers))
    EMULATOR_ARGS = EnvSetting("DFLASH_EMULATOR_ARGS", FleetSettings().emulator_args)
    MODEL_PATH = EnvSetting("DFLASH_MODEL_PATH", LaunchSettings().model_path)
    GPUS = EnvSetting("DFLASH_GPUS", LaunchSettings().gpus)
    BASE_PORT = EnvSetting("DFLASH_BASE_PORT", str(LaunchSettings().base_port))
    SGLANG_COMMAND = EnvSetting("DFLASH_SGLANG_COMMAND", LaunchSettings().command)
    API_KEY = EnvSetting("DFLASH_API_KEY", "")
