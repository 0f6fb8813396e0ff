"""Every setting once: one typed model per group, with its default and its description.

The Dagster configs and resources (`<Group>Config`, `<Thing>Resource`) and the `dflash` flags are derived from these
models and read back with `XSettings.taken_from(...)`, so a default is written here and nowhere else. No Dagster
import.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from dflash_assets.rules import LARGEST_CONTEXT

DEMO_PROMPTS = Path(__file__).resolve().parent / "demo" / "prompts.jsonl"

# a choice field's type, and the CLI's argparse choices (get_args(CapPolicy))
CapPolicy = Literal["fixed", "window"]  # GenerationSettings.cap_policy
Regenerate = Literal["auto", "last_turn", "all_turns"]  # GenerationSettings.regenerate
TrainerFormat = Literal["auto", "conversations", "per_turn", "messages", "pretokenized"]  # TrainerSettings.format
TrainerName = Literal["specforge", "speculators"]  # TrainerSettings.name
ProbeMode = Literal["prompts", "cut_rows"]  # ProbeSettings.mode
FleetMode = Literal["emulated", "attach", "launch"]  # FleetSettings.mode
# a check renamed to what it measures -> its new name; severity overrides may still name the old one
RENAMED_CHECKS = {"window_complete": "decoded_past_window"}
Severity = Literal["ERROR", "WARN"]  # a check's severity (Dagster's AssetCheckSeverity names)
TRAINER_FORMATS = get_args(TrainerFormat)
# The export forms each trainer's own data code reads as exported (tests/quality/training/test_trainer_routes.py);
# `messages` is no trainer's form: an export in it names no trainer.
TRAINER_READS = {"specforge": ("conversations", "per_turn", "pretokenized"), "speculators": ("pretokenized",)}
CAP_POLICIES = get_args(CapPolicy)
REGENERATE = get_args(Regenerate)
PROBE_MODES = get_args(ProbeMode)
SEVERITIES = get_args(Severity)


class SettingsError(ValueError):
    """Bad settings, found before any work starts."""


def _number(bound: Any) -> str:
    return str(int(bound)) if isinstance(bound, float) and bound.is_integer() else str(bound)


def _rule(field: Any) -> str:
    """What a field's constraints ask, in words: 'a positive integer', '>= 0', 'in (0, 1]'."""
    low = high = None
    for c in field.metadata:
        if isinstance(c, annotated_types.Gt | annotated_types.Ge):
            low = ("(", c.gt) if isinstance(c, annotated_types.Gt) else ("[", c.ge)
        elif isinstance(c, annotated_types.Lt | annotated_types.Le):
            high = (")", c.lt) if isinstance(c, annotated_types.Lt) else ("]", c.le)
    hint = f" ({field.json_schema_extra['zero']})" if isinstance(field.json_schema_extra, dict) else ""
    if low and high:
        return f"in {low[0]}{_number(low[1])}, {_number(high[1])}{high[0]}{hint}"
    if low == ("(", 0) and field.annotation is int:
        return "a positive integer" + hint
    if low:
        return f"{'>' if low[0] == '(' else '>='} {_number(low[1])}{hint}"
    if high:
        return f"{'<' if high[0] == ')' else '<='} {_number(high[1])}{hint}"
    return ""


def problems_of(model: type[BaseModel], error: ValidationError) -> str:
    """pydantic's ValidationError as one line of our own: each bad field named by its path, with what it must be
    and what it got ("top_p must be in (0, 1], got 1.5"); a model's own rule (a validator) in its own words."""
    out = []
    for e in error.errors():
        if e["type"] == "value_error":  # a validator's ValueError: its message is the sentence
            out.append(str(e["ctx"]["error"]))
            continue
        owner: Any = model
        for part in e["loc"][:-1]:  # a nested group: the field's own model says what it must be
            annotation = owner.model_fields[part].annotation if part in getattr(owner, "model_fields", {}) else None
            owner = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        leaf = e["loc"][-1] if e["loc"] else ""
        field = owner.model_fields.get(leaf) if owner is not None and hasattr(owner, "model_fields") else None
        name = " ".join(str(p) for p in e["loc"])
        subject = getattr(model, "subject", "")
        if field is not None and get_origin(field.annotation) is Literal:
            rule = "one of " + ", ".join(get_args(field.annotation))
        elif field is not None and e["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            rule = _rule(field)
        else:
            rule = e["msg"][0].lower() + e["msg"][1:]
            out.append(f"{subject}{name}: {rule}, got {e.get('input')!r}")
            continue
        out.append(f"{subject}{name} must be {rule}, got {e.get('input')!r}")
    return getattr(model, "heading", "") + "; ".join(out)


class Settings(BaseModel):
    """A group of settings, checked when it is built: a bad value raises SettingsError, naming it (problems_of)."""

    # frozen: a settings object is a value (hashable, safe to share between shards and tasks)
    model_config = ConfigDict(frozen=True)
    subject: ClassVar[str] = ""  # what each field name is prefixed with in a problem ("trainer max_length ...")
    heading: ClassVar[str] = ""  # what the line of problems starts with

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise SettingsError(problems_of(type(self), e)) from None

    @classmethod
    def taken_from(cls, source: object, skip: tuple[str, ...] = (), prefix: str = ""):
        """This group's fields, read off an object that carries them (a Dagster config or resource, parsed CLI
        flags under a `prefix`); a field it does not carry, or in `skip`, keeps its default; a nested group is taken
        from its own form."""
        values = {}
        for name, field in cls.model_fields.items():
            if not hasattr(source, prefix + name) or name in skip:
                continue
            value, kind = getattr(source, prefix + name), field.annotation
            if isinstance(kind, type) and issubclass(kind, Settings) and type(value) is not kind:
                value = kind.taken_from(value)
            values[name] = value
        return cls(**values)


SAMPLING_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)  # GenerationSettings' sampling, recorded per row under these names
WINDOW_FIELDS = ("cap_policy", "trainer_max_length", "overshoot")  # GenerationSettings: how the window sizes requests
TRAINER_FLAGS = "trainer_"  # TrainerSettings' flags: --trainer-max-length, --trainer-format (dest trainer_max_length)


class TrainerSettings(Settings):
    """The drafter trainer that reads the export: its window (docs/trainer-window.md) and the form it reads."""

    subject: ClassVar[str] = "trainer "

    name: TrainerName = Field(
        "specforge",
        description="The drafter trainer that reads the export: 'specforge' or 'speculators'. It chooses the export "
        "form ('auto'), the file written beside it (specforge_data.yaml, speculators_flags.txt), the validation run, "
        "the held-out route and the command that starts the trainer on the export.",
    )
    max_length: int = Field(
        4096,
        gt=0,
        description="The trainer's window in tokens, counted as the trainer counts it: the rendered sample, "
        "prompt plus assistant (SpecForge data.max_length; speculators --seq-length).",
    )
    format: TrainerFormat = Field(
        "auto",
        description="The export form: 'conversations' (SpecForge's {id, status, conversations}), 'per_turn' (one "
        "generation-event row per assistant turn, as SpecForge's expand_reasoning_conversations.py makes them, "
        "trained with train_only_last_turn), 'messages' (OpenAI's {id, messages}) or 'pretokenized' ({id, "
        "input_ids, loss_mask} from the server's own token ids, read as is by SpecForge's online trainer and "
        "speculators); 'auto': per_turn for regenerated multi-turn conversations under a chat_template that "
        "drops earlier reasoning, else conversations.",
    )
    min_loss_tokens: int = Field(
        2,
        gt=0,
        description="The fewest supervised tokens, adjacent and inside the window, of a sample the trainer keeps: "
        "2 is SpecForge's DFlash rule (has_consecutive_supervised_tokens), TorchSpec's DFlash configs ask 32; a "
        "sample with fewer is not exported (rules.trainable_sql).",
    )
    chat_template: str = Field(
        "qwen3.5",
        description="The chat template SpecForge renders the text forms with (data.chat_template: 'qwen3.5' in its "
        "qwen3.6-27b DFlash recipes; a config of thinking-off rows only is written with 'qwen3-instruct', which masks "
        "the empty think block), written into the trainer's settings beside the export.",
    )
    held_out_share: float = Field(
        0.02,
        ge=0,
        lt=1,
        description="The share of exported conversations written to the held-out file instead of the train file, "
        "drawn by a seeded hash of the prompt id (quality/training/split.py): every row of a prompt on one side, the same "
        "side in every export and form; 0 writes no held-out file.",
    )
    held_out_seed: int = Field(
        0, description="The seed of the held-out draw: the same seed holds out the same prompts."
    )

    @model_validator(mode="after")
    def _form_the_trainer_reads(self) -> TrainerSettings:
        if self.format not in ("auto", "messages", *TRAINER_READS[self.name]):
            raise ValueError(
                f"trainer {self.name} does not read the {self.format} form; its forms: "
                f"{', '.join(TRAINER_READS[self.name])} (or auto)"
            )
        return self

    def named(self) -> str:
        """The window as every report names it, with how to change it."""
        return (
            f"the trainer's window max_length {self.max_length:,} (trainer.max_length; change it with "
            f"--trainer-max-length or the quality resource's trainer.max_length)"
        )


class RequestSettings(Settings):
    """What a completion is, as a person sets it: the completions config and the flags are built from these (the
    window is TrainerSettings.max_length: GenerationSettings.of puts the two together)."""

    heading: ClassVar[str] = "invalid generation config: "

    max_output_tokens: int = Field(
        4096, gt=0, description="The config's cap: max_completion_tokens of every request (the window policy: at most)."
    )
    temperature: float = Field(0.6, ge=0, description="Sampling temperature (>= 0).")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling, in (0, 1].")
    top_k: int = Field(20, description="Top-k sampling; -1 turns it off.")
    # sent explicitly too: left out, the chat route takes them from the model's generation_config.json
    # (protocol.py to_sampling_params) while /generate uses SamplingParams' defaults, and a continued row
    # would be sampled unlike its parent
    min_p: float = Field(0.0, ge=0, le=1, description="Min-p sampling, in [0, 1].")
    repetition_penalty: float = Field(1.0, gt=0, le=2, description="Repetition penalty, in (0, 2] (1 = off).")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="Presence penalty, in [-2, 2].")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="Frequency penalty, in [-2, 2].")
    enable_thinking: bool = Field(True, description="chat_template_kwargs.enable_thinking (Qwen3 thinking traces).")
    regenerate: Regenerate = Field(
        "auto",
        description="Which assistant turns are generated: 'auto' (every assistant turn of a conversation, in "
        "order, when the prompt source's prompts carry earlier assistant turns, as SpecForge's and "
        "speculators' regeneration do; else last_turn, the config of a single-turn source as it always "
        "was), 'last_turn' (the final one, or a new answer to a final user turn: the source's earlier "
        "answers stay in the history, and a trainer that puts loss on every turn learns them) or "
        "'all_turns' (every one, in order, each conditioned on the regenerated ones before it).",
    )
    cap_policy: CapPolicy = Field(
        "window",
        description="'window' (the default): each request asks min(max_output_tokens, the trainer's max_length - "
        "prompt_tokens + overshoot), the tokens the trainer's window reads, and a prompt that fills the window is "
        "rejected; 'fixed': every request asks max_output_tokens, for whole answers beyond the trainer's window.",
    )
    overshoot: int = Field(
        16,
        ge=0,
        description="cap_policy window: tokens asked past the window, so that after the trainer re-renders "
        "and re-tokenizes the sample its window still ends inside generated text (never on a "
        "closing tag the model did not write).",
    )
    chat_template_kwargs: dict = Field(
        {},
        description="More chat_template_kwargs, sent beside enable_thinking with every request and with "
        "/v1/tokenize (a JSON object on the command line).",
    )
    thinking_share: float | None = Field(
        None,
        ge=0,
        le=1,
        description="A seeded mix of modes in one config: the share of prompts generated with enable_thinking on, "
        "the rest with it off, each prompt's mode drawn from a seeded hash of its id (mode_seed: rules.thinks), the "
        "same after a kill, a resume and on another machine; each row records its mode (enable_thinking). None: "
        "every prompt as enable_thinking says.",
    )
    mode_seed: int = Field(0, description="The seed of thinking_share's draw.")

    @field_validator("max_output_tokens")
    @classmethod
    def _fits_a_model(cls, cap: int) -> int:
        if cap > LARGEST_CONTEXT:
            raise ValueError(
                f"max_output_tokens {cap:,} is larger than the largest context any model SGLang serves "
                f"({LARGEST_CONTEXT:,} tokens): no server could grant it; set a cap below the servers' context length"
            )
        return cap

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, top_k: int) -> int:
        if top_k == 0 or top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {top_k!r}")
        return top_k

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_setting(cls, kwargs: dict) -> dict:
        if "enable_thinking" in kwargs:
            raise ValueError("set enable_thinking with its own setting, not inside chat_template_kwargs")
        return kwargs


class GenerationSettings(RequestSettings):
    """The settings that decide what a completion is; rows record all of them, and every one that changes the
    output is in the config hash. `trainer_max_length` is TrainerSettings.max_length, set by `of`."""

    trainer_max_length: int = Field(
        TrainerSettings().max_length,
        gt=0,
        description="cap_policy window: the trainer's window the requests are sized to: TrainerSettings.max_length "
        "(--trainer-max-length, the quality resource's trainer.max_length).",
    )

    # what the fleet says it serves (fleet/provenance.py), in the config hash: not a setting, read at connect
    _provenance: dict | None = PrivateAttr(None)
    # TrainerSettings.min_loss_tokens (rules.leaves_loss_room): decides which prompts are sent, so it is not hashed
    _min_loss_tokens: int = PrivateAttr(TrainerSettings().min_loss_tokens)

    @classmethod
    def of(cls, source: object, trainer: TrainerSettings) -> GenerationSettings:
        """The request settings `source` carries (a completions config, flags), sized to the trainer's window."""
        settings = cls.taken_from(source).model_copy(update={"trainer_max_length": trainer.max_length})
        settings._min_loss_tokens = trainer.min_loss_tokens
        return settings

    @property
    def min_loss_tokens(self) -> int:
        return self._min_loss_tokens

    def resolved(self, carries_history: bool) -> GenerationSettings:
        """regenerate 'auto' resolved for a source: all_turns where it `carries_history`, else last_turn."""
        if self.regenerate != "auto":
            return self
        return self.model_copy(update={"regenerate": "all_turns" if carries_history else "last_turn"})

    def with_provenance(self, provenance: dict | None) -> GenerationSettings:
        """These settings with what the fleet says it serves in their config hash (None: without it)."""
        copy = self.model_copy()
        copy._provenance = provenance
        return copy

    @property
    def provenance(self) -> dict | None:
        return self._provenance

    def config_hash(self, model: str) -> str:
        """12 hex chars over the model, the fleet's provenance (when given) and every setting that changes the output,
        of the resolved mode; a setting at the value it had before it existed leaves the hash as it was."""
        if self.regenerate == "auto":
            raise SettingsError(
                "regenerate 'auto' has no config hash until it is resolved against the prompt source "
                "(GenerationSettings.resolved)"
            )
        settings = self.model_dump()
        if settings["regenerate"] == "last_turn":  # the behaviour before the setting existed: the same hashes
            del settings["regenerate"]
        if settings["thinking_share"] is None:  # one mode, as before the mix existed: the same hashes
            del settings["thinking_share"], settings["mode_seed"]
        else:  # each prompt's mode is its draw's: enable_thinking decides nothing
            del settings["enable_thinking"]
        if settings["cap_policy"] == "fixed":  # the window does not change a fixed-cap request: the same hashes
            for name in WINDOW_FIELDS:
                del settings[name]
        if self._provenance is not None:
            settings["provenance"] = self._provenance
        payload = json.dumps({"model": model, **settings}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    @property
    def windowed(self) -> bool:
        return self.cap_policy == "window"

    @property
    def window(self) -> int | None:
        """The trainer's window the requests are sized to; None under a fixed cap."""
        return self.trainer_max_length if self.windowed else None

    def sampling(self) -> dict:
        """Every sampling parameter, as both routes take them (chat body fields, /generate sampling_params)."""
        return {name: getattr(self, name) for name in SAMPLING_PARAMS}


class DispatchSettings(Settings):
    """How hard to drive the fleet. None of this changes a completion, so none of it is hashed."""

    max_in_flight_per_server: int = Field(
        0,
        ge=0,
        description="Requests in flight per server; 0 = the server's own max_running_requests + waiting_margin.",
    )
    waiting_margin: int = Field(
        2, description="Requests queued at each server beyond its running slots, so its slots never idle."
    )
    max_attempts: int = Field(4, ge=1, description="Attempts per request on retryable errors (5xx, timeouts).")
    retry_quarantined: bool = Field(
        False,
        description="Send again the prompts an earlier run quarantined (in flight when 2 servers died: "
        "generation/quarantine.py); by default they stay in the failures table, unsent.",
    )
    backoff_base_s: float = Field(0.5, description="First retry delay; doubles each attempt (with jitter).")
    backoff_max_s: float = Field(30.0, description="The longest retry delay.")
    eject_after: int = Field(3, description="Consecutive retryable failures before a server is ejected and probed.")
    commit_rows: int = Field(512, ge=1, description="Commit a Parquet part every this many rows ...")
    commit_seconds: float = Field(10.0, gt=0, description="... or every this many seconds.")
    progress_seconds: float = Field(30.0, description="A progress line in the run log every this many seconds.")
    store_token_ids: bool = Field(
        False,
        description="Record prompt_token_ids and output_ids (return_token_ids): exact ids for training, "
        "and what continuing truncated rows at a larger cap needs.",
    )
    load_sample_s: float = Field(
        5.0, description="Poll each server's /v1/loads this often for the fleet tuning report (0: off)."
    )
    no_server_timeout_s: float = Field(
        120.0, description="Stop the run when no server has been healthy for this long (committed rows stay)."
    )
    same_server_max_imbalance: float = Field(
        0.25,
        description="all_turns: a conversation's next turn goes to the server of its previous turn (whose "
        "prefix cache holds the history) unless that server's share of busy slots exceeds the "
        "least-loaded server's by more than this (negative: always the least-loaded server).",
    )

    stream: bool = Field(
        True,
        description="Stream every generation request (SSE) and watch it while it runs: a stall is noticed "
        "in stall_timeout_s, a loop stopped when it starts (docs/streaming.md). Off: one blocking "
        "POST per request, watched by request_timeout_s only.",
    )
    stall_timeout_s: float = Field(
        60.0,
        gt=0,
        description="stream: a request whose stream sends no token for this long is closed (SGLang aborts "
        "it) and retried on another server.",
    )
    first_token_timeout_s: float = Field(
        900.0,
        gt=0,
        description="stream: the same, before the first token (a request queued behind a busy server's "
        "running ones waits longer than a decode step).",
    )
    runaway_check_tokens: int = Field(
        256,
        ge=0,
        json_schema_extra={"zero": "0: off"},
        description="stream: apply the runaway rules to the streamed text every this many tokens; a loop is "
        "stopped and committed with finish_reason 'runaway' (0: off, runaways decode to the cap).",
    )


class RepeatSettings(Settings):
    """Repeats in the prompt source, exact or near (generation/dedupe.py): rejected unless kept."""

    subject: ClassVar[str] = "repeats "
    heading: ClassVar[str] = "invalid repeat settings: "

    keep_repeats: bool = Field(
        False,
        description="Send repeated prompts too: counted (the `repeats` reason) but not rejected.",
    )
    near_threshold: float = Field(
        0.9,
        ge=0.8,
        le=1.0,
        description="The estimated Jaccard similarity of two prompts' word shingles at which the later one is a "
        "near-duplicate (0.8 at least: the LSH bands find pairs below it only by chance).",
    )
    shingle_words: int = Field(3, ge=1, description="Words per shingle.")


class QuotaSettings(Settings):
    """Quotas by `source`, drawn in prompt_shards (generation/quotas.py); a source not named is taken whole."""

    subject: ClassVar[str] = "quota "
    heading: ClassVar[str] = "invalid quotas: "

    quotas: dict[str, float] = Field(
        {},
        description="{source: count or share}: a whole number is a count, a number between 0 and 1 a share, e.g. "
        "{\"gsm8k\": 2000, \"sharegpt\": 0.25} (a JSON object).",
    )
    quota_seed: int = Field(0, description="The seed of the draw: the same seed draws the same prompts.")

    @field_validator("quotas")
    @classmethod
    def _counts_or_shares(cls, quotas: dict) -> dict:
        for source, quota in quotas.items():
            if quota < 0 or (quota >= 1 and not float(quota).is_integer()):
                raise ValueError(
                    f"the quota of source {source!r} must be a whole count (0 or more) or a share between 0 and 1, "
                    f"got {quota!r}"
                )
        return quotas


class ProbeSettings(Settings):
    """The length probe: which prompts (a seeded random sample) and at which cap. Its sampling settings are the
    GenerationSettings, which must match the run the plan is for."""

    max_output_tokens: int = Field(
        0,
        ge=0,
        json_schema_extra={"zero": "0: the largest the context allows"},
        description="The probe's cap; 0 = the largest the fleet's context allows for the sampled prompts.",
    )
    size: int = Field(
        0,
        ge=0,
        json_schema_extra={"zero": "0: from share and min_prompts"},
        description="Prompts in the probe; 0 = the larger of min_prompts and share of all prompts.",
    )
    share: float = Field(0.01, gt=0, le=1, description="Share of the prompts to sample when size is 0.")
    min_prompts: int = Field(500, ge=1, description="At least this many prompts when size is 0.")
    seed: int = Field(0, description="Seed of the random sample: the same prompts and seed give the same sample.")
    mode: ProbeMode = Field(
        "prompts",
        description="What the probe samples: 'prompts' (random prompts generated at the "
        "probe's cap) or 'cut_rows' (the run's honest cut rows, continued to "
        "it: every row informs the tail; needs a run at a smaller cap).",
    )


class RunawaySettings(Settings):
    """What counts as a runaway (generation/runaway.py judges by these). Prose repeats almost no 8-word sequence
    within a few kB; a loop repeats nearly all."""

    tail_chars: int = Field(4000, description="The end of the output that is judged, in characters.")
    ngram_words: int = Field(8, description="Words per n-gram of the repeated n-gram rule.")
    repeated_ngram_share: float = Field(
        0.5, description="A loop: at least this share of the tail's n-grams repeat an earlier n-gram of the tail."
    )
    repeated_line_share: float = Field(
        0.5, description="A loop: at least this share of the tail's non-blank lines equal its most common line ..."
    )
    min_line_repeats: int = Field(4, description="... and that line is seen at least this often.")
    min_ngrams: int = Field(32, description="A tail of fewer n-grams is never judged a loop (too little to tell).")
    end_chars: int = Field(
        32,
        description="The end that must recur for either rule to count: the last line, or "
        "its last this many characters.",
    )


class QualitySettings(Settings):
    """Every limit the quality checks judge by: a check passes when its rate (a share of rows) <= its limit.
    Defects that mean a stage is broken (duplicates, leaked think markers, empty answers, a budget that did not fit
    the context) default to zero tolerance."""

    truncation_rate_max: float = Field(
        0.05,
        description="The truncation_rate check fails above this share of rows cut inside the trainer's "
        "window (rules.py), per shard and per config: the blocking truncation.",
    )
    cap_saturation_percentile: float = Field(
        0.99, description="cap_saturation fails when this percentile of completion_tokens reaches the cap."
    )
    cap_hit_agreement_rate_max: float = Field(
        0.0, description="Rows where 'at the cap' and finish_reason 'length' disagree."
    )
    silent_clamp_rate_max: float = Field(
        0.0, description="Rows that finished 'length' below their own max_output_tokens."
    )
    context_overflow_rate_max: float = Field(0.0, description="Completion rows generated with prompt + cap > context.")
    context_overflow_reject_rate_max: float = Field(
        0.01, description="Prompts of a config rejected because prompt + cap > context."
    )
    accounting_rate_max: float = Field(
        0.0, description="Accounting: prompts with no completion, reject or failure row."
    )
    duplicates_rate_max: float = Field(0.0, description="Extra rows on (prompt_id, config_hash).")
    empty_content_rate_max: float = Field(0.0, description="Rows with an empty answer.")
    think_markers_rate_max: float = Field(0.0, description="Rows with a think marker leaked into the answer.")
    reasoning_misrouted_rate_max: float = Field(
        0.0, description="enable_thinking rows whose reasoning did not reach reasoning_content."
    )
    truncated_thinking_rate_max: float = Field(0.01, description="Rows cut while still thinking.")
    trainer: TrainerSettings = Field(
        TrainerSettings(),
        description="The drafter trainer: its window max_length (what the checks judge "
        "truncation against) and the export form.",
    )
    decoded_past_window_rate_max: float = Field(
        0.02,
        description="decoded_past_window warns above this share of decoded tokens past the trainer's window: "
        "GPU time no training step reads.",
    )
    max_length_overflow_rate_max: float = Field(
        0.05, description="Rows whose prompt plus completion run past the trainer's window (it cuts them)."
    )
    runaway_rate_max: float = Field(
        0.0,
        description="The runaway_rate check warns above this share of rows cut while looping: any is worth a "
        "look at the sampling settings.",
    )
    runaway: RunawaySettings = Field(RunawaySettings(), description="What counts as a runaway.")
    severity: dict[str, str] = Field(
        {}, description="Check name -> 'ERROR' or 'WARN': overrides a check's own severity."
    )

    @field_validator("severity")
    @classmethod
    def _severities(cls, severity: dict[str, str]) -> dict[str, str]:
        # dict[str, Severity] would do it, but Dagster's config has no map of enums: the resource keeps str values
        if bad := {name: level for name, level in severity.items() if level not in SEVERITIES}:
            raise ValueError(f"severity must be one of {', '.join(SEVERITIES)}, got {bad}")
        for old in set(severity) & set(RENAMED_CHECKS):  # an override written for a check's old name still holds
            warnings.warn(
                f"severity names the check {old!r}, now {RENAMED_CHECKS[old]!r}: the override applies to "
                f"{RENAMED_CHECKS[old]!r}; rename it there",
                FutureWarning,
                stacklevel=2,
            )
        return {RENAMED_CHECKS.get(name, name): level for name, level in severity.items()}


class ServerSettings(Settings):
    """The typed `sglang serve` flags of one server. None means "SGLang decides" and emits no flag."""

    served_model_name: str | None = Field(None, description="The model name the server answers to.")
    host: str = Field("127.0.0.1", description="Where the server listens (loopback unless told otherwise).")
    tp_size: int = Field(1, description="Tensor-parallel GPUs per server.")
    context_length: int | None = Field(None, description="--context-length (default: the model's).")
    max_running_requests: int | None = Field(None, description="--max-running-requests.")
    max_mamba_cache_size: int | None = Field(None, description="--max-mamba-cache-size (hybrid models).")
    mem_fraction_static: float | None = Field(None, description="--mem-fraction-static, in (0, 1).")
    chunked_prefill_size: int | None = Field(None, description="--chunked-prefill-size.")
    cuda_graph_max_bs_decode: int | None = Field(None, description="--cuda-graph-max-bs-decode.")
    reasoning_parser: str | None = Field("qwen3", description="--reasoning-parser: thinking goes to reasoning_content.")
    enable_metrics: bool = Field(True, description="--enable-metrics: Prometheus /metrics.")
    max_queued_requests: int | None = Field(None, description="--max-queued-requests.")
    # SGLang's default 1 (an event per token) costs the client too many cores (docs/streaming.md)
    stream_interval: int | None = Field(
        4,
        description="--stream-interval: tokens per streamed event (SGLang's "
        "default 1 costs the client too much CPU to parse).",
    )


class LaunchSettings(ServerSettings):
    """`launch` mode and `dflash fleet up`: one `sglang serve` per GPU (or per tp_size GPUs), detached."""

    model_path: str = Field("", description="The model every server loads (a local directory or a HF repo id).")
    gpus: str = Field("0", description="Comma-separated GPU ids.")
    base_port: int = Field(30000, description="The server on GPU g listens on base_port + g.")
    command: str = Field(
        "sglang",
        description="'sglang' (sglang serve), 'launch_server' (python -m "
        "sglang.launch_server), 'emulator', or a full command line.",
    )
    extra_args: str = Field("", description="More sglang serve flags, quoted as one string.")
    health_timeout_s: float = Field(1200.0, description="Seconds to wait for a new server's /health.")


class FleetSettings(Settings):
    """How the pipeline reaches its servers. The API key is not here: it comes from DFLASH_API_KEY only."""

    subject: ClassVar[str] = "fleet "

    mode: FleetMode = Field("emulated", description="'emulated', 'attach' or 'launch'.")
    urls: str = Field("", description="attach: comma-separated base URLs (or one router / gateway URL).")
    num_servers: int = Field(2, ge=1, description="emulated: how many emulator servers.")
    emulator_args: str = Field(
        "--reasoning-parser qwen3 --tool-call-parser qwen25",
        description="emulated: emulator flags, e.g. add '--decode-tokens-per-s 4000'.",
    )
    health_timeout_s: float = Field(120.0, description="Seconds to wait for every server's /health at connect.")
    connect_refused_s: float = Field(
        10.0,
        ge=0,
        description="Stop waiting at connect once every server has refused the connection for this long: nothing "
        "listens there (a URL or a port is wrong, or the servers are down). SGLang binds its port only once "
        "the model has loaded, so attaching to servers still starting needs more (0: wait health_timeout_s).",
    )
    request_timeout_s: float = Field(3600.0, description="Seconds one request may take (a long generation).")

    @model_validator(mode="after")
    def _attach_needs_urls(self) -> FleetSettings:
        if self.mode == "attach" and not self.urls.strip():
            raise ValueError("fleet mode 'attach' needs at least one server URL (set DFLASH_FLEET_URLS)")
        return self


@dataclass(frozen=True)
class EnvSetting:
    """A deployment setting: the environment variable that sets it and the default when it is unset."""

    name: str
    default: str

    def value(self) -> str:
        return os.environ.get(self.name, self.default)


class Deployment:
    """The environment variables of a deployment (docs/settings.md): read at run launch, but those that shape the
    definitions (a cron, a backfill's runs, the retry delay) when the code location loads (defs/partitions.py)."""

    DATA_DIR = EnvSetting("DFLASH_DATA_DIR", "data")
    LOCAL_DIR = EnvSetting("DFLASH_LOCAL_DIR", "data")
    PROMPTS = EnvSetting("DFLASH_PROMPTS", str(DEMO_PROMPTS))
    SHARD_SIZE = EnvSetting("DFLASH_SHARD_SIZE", "100")
    SHARDS_PER_RUN = EnvSetting("DFLASH_SHARDS_PER_RUN", "8")
    # DuckDB's memory in a reader of every row (checks, reports, export): past it, its tables spill to disk (a
    # million rows fill 128 MB; each reader then grows by what it is given)
    DUCKDB_MEMORY_LIMIT = EnvSetting("DFLASH_DUCKDB_MEMORY_LIMIT", "64MB")
    # its threads there: each holds its own buffers of the text it reads, and the fleet, not DuckDB, sets the pace
    DUCKDB_THREADS = EnvSetting("DFLASH_DUCKDB_THREADS", "1")
    RETRY_DELAY_S = EnvSetting("DFLASH_RETRY_DELAY_S", "10")  # a failed generating step's first retry waits this
    CHECKS_CRON = EnvSetting("DFLASH_CHECKS_CRON", "0 * * * *")
    FLEET_MODE = EnvSetting("DFLASH_FLEET_MODE", FleetSettings().mode)
    FLEET_URLS = EnvSetting("DFLASH_FLEET_URLS", FleetSettings().urls)
    NUM_SERVERS = EnvSetting("DFLASH_NUM_SERVERS", str(FleetSettings().num_servers))
    EMULATOR_ARGS = EnvSetting("DFLASH_EMULATOR_ARGS", FleetSettings().emulator_args)
    MODEL_PATH = EnvSetting("DFLASH_MODEL_PATH", LaunchSettings().model_path)
    GPUS = EnvSetting("DFLASH_GPUS", LaunchSettings().gpus)
    BASE_PORT = EnvSetting("DFLASH_BASE_PORT", str(LaunchSettings().base_port))
    SGLANG_COMMAND = EnvSetting("DFLASH_SGLANG_COMMAND", LaunchSettings().command)
    SGLANG_ARGS = EnvSetting("DFLASH_SGLANG_ARGS", LaunchSettings().extra_args)
    API_KEY = EnvSetting("DFLASH_API_KEY", "")
    S3_ENDPOINT = EnvSetting("DFLASH_S3_ENDPOINT", "")  # s3:// data dirs (store/storage.py), before AWS_ENDPOINT_URL
