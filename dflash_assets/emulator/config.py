"""Command line and resolved configuration of the emulated server.

The parser is `sglang serve`'s (all 0.5.23 flags, from sglang_flags.json), so a launcher's command line parses and
fails as it would against the real server; the flags that shape behaviour are typed here, the rest reported in
/server_info, with the emulator's own knobs beside them. Capacity follows 0.5.23 (model_config.py,
kv_cache_configurator.py, tp_worker.py): max_req_len = min(context_len - 1, kv_pool - 1), max_req_input_len =
max_req_len - 5, max_running_requests capped by the mamba state slots.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from .faults import FAULT_FLAGS
from .model import LengthModel

# Every `sglang serve` flag of 0.5.23 as [names, nargs, dest], from the wheel (test_sglang_contract.py
# extract_sglang_flags). nargs: 0 = a switch (BooleanOptionalAction adds `--no-x`), null = one value, or "?", "*", "+".
FLAGS: tuple[tuple[tuple[str, ...], int | str | None, str], ...] = tuple(
    (tuple(names), nargs, dest)
    for names, nargs, dest in json.loads((Path(__file__).parent / "sglang_flags.json").read_text())
)

# Set to its own pid by whoever starts an emulator for its own use (start_emulator): the emulator stops when that
# process is gone, so a SIGKILLed run or test leaves no server behind. A standalone `dflash emulator` outlives it.
EXIT_WITH_PARENT = "DFLASH_EMULATOR_EXIT_WITH_PARENT"

VERSION = "0.5.23"
REASONING_PARSERS = ["qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi", "gpt-oss"]
# mamba state slots per running request with the radix cache on (MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO)
MAMBA_SLOTS_PER_REQUEST = 3
# the chat templates the stand-in model can be served with (tokenizer.apply_chat_template), the default first
TEMPLATE_VARIANTS = ("qwen3.5", "qwen3.5-default-system")


def human_readable_int(value: str) -> int:
    """SGLang's int parser for --context-length: '32768', '32k', '32Ki'."""
    value = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if m:
        number, suffix = m.groups()
        if suffix.endswith("i"):
            if "." in number:
                raise argparse.ArgumentTypeError(f"Decimals are not allowed with IEC suffixes like '{suffix}'.")
            return int(number) * 2 ** (10 * "KMGT".index(suffix[0]) + 10)
        return int(Decimal(number) * 10 ** (3 * "kMGT".index(suffix) + 3))
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"Invalid integer value: {value!r}") from None


# Flags whose values the emulator uses: dest -> argparse kwargs (replacing the generic entry).
_TYPED: dict[str, dict[str, Any]] = {
    "model_path": {"required": True},
    "host": {"default": "127.0.0.1"},
    "port": {"type": int, "default": 30000},
    "context_length": {"type": human_readable_int},
    "tp_size": {"type": int, "default": 1},
    "dp_size": {"type": int, "default": 1},
    "max_running_requests": {"type": int},
    "max_queued_requests": {"type": int},
    "max_total_tokens": {"type": int},
    "max_mamba_cache_size": {"type": int},
    "chunked_prefill_size": {"type": int},
    "mem_fraction_static": {"type": float},
    "stream_interval": {"type": int},  # None: not given (SGLang's 1; see engine.stream_step)
    "reasoning_parser": {"choices": ["auto"] + REASONING_PARSERS},
    "default_chat_template_kwargs": {"type": json.loads},
    "preferred_sampling_params": {"type": json.loads},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang serve",
        usage="%(prog)s --model-path PATH [emulator options] [SGLang 0.5.23 flags]",
        description="Emulator of an SGLang 0.5.23 server (no GPU): same flags, routes, shapes and errors.",
    )
    # the emulator's own knobs first (what a user of the emulator comes for), SGLang's flags after them
    emu = parser.add_argument_group("emulator options", "Knobs of the emulator itself (not SGLang flags).")
    sglang = parser.add_argument_group(
        "SGLang 0.5.23 flags",
        "Accepted for compatibility with `sglang serve` (the same names, prefixes and value checks); only "
        "--model-path, --host, --port and the capacity, reasoning and sampling flags change what the emulator does.",
    )
    for names, nargs, dest in FLAGS:
        if dest in _TYPED:
            sglang.add_argument(*names, dest=dest, **_TYPED[dest])
        elif nargs == 0:
            sglang.add_argument(*names, dest=dest, action="store_true", default=None)
        else:
            sglang.add_argument(*names, dest=dest, nargs=nargs)
    emu.add_argument("--startup-delay", type=float, default=0.0, help="Seconds /health answers 503 (warmup).")
    emu.add_argument(
        "--health-delay",
        type=float,
        default=None,
        help="Seconds a healthy /health takes. Default: 1, as 0.5.23's one-token health generation polls after "
        "asyncio.sleep(1); 0 when SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false (then /health answers at once).",
    )
    emu.add_argument(
        "--decode-tokens-per-s", type=float, default=0.0, help="Decode rate per running request; 0 = instant."
    )
    emu.add_argument("--prefill-tokens-per-s", type=float, default=0.0, help="Prefill rate per request; 0 = instant.")
    emu.add_argument("--length-median", type=float, default=LengthModel.median, help="Median output tokens.")
    emu.add_argument("--length-sigma", type=float, default=LengthModel.sigma, help="Lognormal sigma of output length.")
    emu.add_argument("--length-min", type=int, default=LengthModel.minimum)
    emu.add_argument("--length-max", type=int, default=LengthModel.maximum)
    emu.add_argument(
        "--length-prompt-share",
        type=float,
        default=LengthModel.prompt_share,
        help="Share of the log-length variance set by the prompt when requests draw anew.",
    )
    emu.add_argument(
        "--sampling",
        choices=("per-request", "per-prompt"),
        default=os.environ.get("DFLASH_EMULATOR_SAMPLING", "per-request"),
        help="per-request (a server, the default): temperature > 0 without a seed draws anew each "
        "request; per-prompt: every request for a prompt gets the same completion, whatever the "
        "temperature (env DFLASH_EMULATOR_SAMPLING; the test suite sets it for row-for-row checks).",
    )
    emu.add_argument(
        "--loop-share",
        type=float,
        default=LengthModel.loop_share,
        help="Share of prompts (fixed per prompt and seed) whose generation repeats one line until "
        "--length-max: runaway generations.",
    )
    emu.add_argument(
        "--non-ascii",
        action="store_true",
        help="Text with multi-byte characters: every other comma between two words becomes an em dash "
        "(' —', byte tokens), so a cap can cut a character in two, and reply texts are what "
        "SGLang's incremental detokenizer sends (U+FFFD for a cut character). Off: ASCII only.",
    )
    emu.add_argument(
        "--native-context-length", type=int, default=32768, help="The stand-in model's config.json context."
    )
    emu.add_argument(
        "--generation-config",
        type=json.loads,
        default={"temperature": 0.6, "top_k": 20, "top_p": 0.95},
        help="The stand-in model's generation_config.json (Qwen3's by default): the chat route's sampling "
        "defaults for what a request leaves out, with --sampling-defaults model.",
    )
    emu.add_argument("--kv-capacity", type=int, default=400_000, help="KV pool tokens the emulated GPU profiles to.")
    emu.add_argument(
        "--auto-mamba-cache-size", type=int, default=144, help="Mamba slots when --max-mamba-cache-size is unset."
    )
    emu.add_argument(
        "--always-think",
        action="store_true",
        help="The stand-in model's chat template opens <think> whatever enable_thinking says (as templates that "
        "match template_detection's force_reasoning_pattern do): the server then always reasons.",
    )
    emu.add_argument("--dense-model", action="store_true", help="Emulate a dense model (no mamba cap on requests).")
    emu.add_argument(
        "--template-variant",
        choices=TEMPLATE_VARIANTS,
        default=TEMPLATE_VARIANTS[0],
        help="The stand-in model's chat template: qwen3.5 (the default), or qwen3.5-default-system, which puts a "
        "default system turn before a conversation that has none (as Qwen2.5's template does): another template "
        "behind the same model name and flags, which only the rendered token ids tell apart.",
    )
    emu.add_argument(
        "--reported-version",
        default=VERSION,
        help="The SGLang version /server_info and /v1/loads report (another release behind the same routes).",
    )
    for flag, (name, kind, said) in FAULT_FLAGS.items():
        emu.add_argument(flag, dest=f"fault_{name}", help=said, **kind)
    return parser


@dataclass
class EmulatorSetup:
    """What the server runs with: the parsed flags and the capacity they resolve to."""

    args: argparse.Namespace
    argv: list[str]
    context_len: int
    max_total_num_tokens: int
    max_running_requests: int  # effective, per DP rank
    max_mamba_cache_size: int | None
    max_req_len: int
    max_req_input_len: int
    lengths: LengthModel
    warnings: list[str] = field(default_factory=list)

    @property
    def served_model_name(self) -> str:
        return self.args.served_model_name or self.args.model_path

    @property
    def reasoning_parser(self) -> str | None:
        p = self.args.reasoning_parser
        return "qwen3" if p == "auto" else p  # auto detects the Qwen template

    @property
    def model_sampling_defaults(self) -> dict:
        """ModelConfig.get_default_sampling_params: generation_config.json's with 'model', {} with 'openai'."""
        if (self.args.sampling_defaults or "model") != "model":
            return {}
        keys = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
        return {k: self.args.generation_config[k] for k in keys if self.args.generation_config.get(k) is not None}

    @property
    def health_delay(self) -> float:
        """http_server.health_generate: a generation, then `await asyncio.sleep(1)` before the first check."""
        if self.args.health_delay is not None:
            return self.args.health_delay
        generation = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").strip().lower()
        return 0.0 if generation in ("0", "false", "no", "off") else 1.0


class EmulatorFlagError(SystemExit):
    """A configuration SGLang refuses at startup (it raises; the launch fails)."""


def resolve(argv: list[str]) -> EmulatorSetup:
    args = build_parser().parse_args(argv)
    warnings: list[str] = []
    if args.config:
        raise EmulatorFlagError("emulator: --config (YAML) is not supported; pass the flags instead")
    if args.served_model_name and ":" in args.served_model_name:
        raise EmulatorFlagError(f"served_model_name must not contain ':', got {args.served_model_name!r}.")
    native = args.native_context_length
    context_len = native
    if args.context_length is not None:
        if args.context_length > native and os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN") != "1":
            raise EmulatorFlagError(
                f"Warning: User-specified context_length ({args.context_length}) is greater than the derived "
                f"context_length ({native}). This may lead to incorrect model outputs or CUDA errors. Note that "
                "the derived context_length may differ from max_position_embeddings in the model's config. "
                "To allow overriding this maximum, set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"
            )
        context_len = args.context_length
    kv = args.kv_capacity
    if args.max_total_tokens is not None:
        if args.max_total_tokens > kv:
            warnings.append(
                f"max_total_tokens={args.max_total_tokens} is larger than the profiled value {kv}. "
                "Use the profiled value instead."
            )
        kv = min(kv, args.max_total_tokens)
    if kv < context_len:
        warnings.append(f"KV pool holds {kv} tokens, fewer than --context-length {context_len}.")
    running, mamba = _max_running_requests(args, kv, context_len)
    max_req_len = min(context_len - 1, kv - 1)
    lengths = LengthModel(
        median=args.length_median,
        sigma=args.length_sigma,
        minimum=args.length_min,
        maximum=args.length_max,
        prompt_share=args.length_prompt_share,
        loop_share=args.loop_share,
    )
    return EmulatorSetup(
        args=args,
        argv=list(argv),
        context_len=context_len,
        max_total_num_tokens=kv,
        max_running_requests=running,
        max_mamba_cache_size=mamba,
        max_req_len=max_req_len,
        max_req_input_len=max_req_len - 5,
        lengths=lengths,
        warnings=warnings,
    )


def _max_running_requests(args: argparse.Namespace, kv: int, context_len: int) -> tuple[int, int | None]:
    """kv_cache_configurator.resolve_max_num_reqs, per DP rank."""
    estimated = max(min(int(kv / context_len * 512), 4096), 2048)
    if args.max_running_requests is not None:
        running = min(max(1, args.max_running_requests), kv // 2)
    else:
        running = min(estimated, kv // 2)
    if args.dense_model:
        return running, None
    mamba = args.max_mamba_cache_size if args.max_mamba_cache_size is not None else args.auto_mamba_cache_size
    ratio = mamba_ratio(args)
    cap = mamba // ratio
    if cap <= 0:
        raise EmulatorFlagError(
            "Hybrid (mamba/linear-attention) state cache is too small to serve any requests. "
            f"max_mamba_cache_size={mamba}, mamba_ratio={ratio}, resulting max_num_reqs={cap}."
        )
    return min(running, cap), mamba


def mamba_ratio(args: argparse.Namespace) -> int:
    """kv_cache_configurator._calculate_mamba_ratio: state slots per running request."""
    if args.disable_radix_cache:
        return 1
    strategy = args.mamba_radix_cache_strategy or "no_buffer"
    if strategy == "extra_buffer_lazy":
        return MAMBA_SLOTS_PER_REQUEST + 1
    if strategy == "extra_buffer":  # get_mamba_tracking_slots: 2 with the overlap scheduler, 1 without
        return MAMBA_SLOTS_PER_REQUEST + (1 if args.disable_overlap_schedule else 2)
    return MAMBA_SLOTS_PER_REQUEST


def server_args_dict(cfg: EmulatorSetup) -> dict:
    """`server_args.resolved_dict()` as /server_info reports it (context_length / max_running_requests null unless
    passed); as in 0.5.23 with `api_key` and `launch_command` verbatim: clients must redact."""
    a = cfg.args
    given = {k: v for k, v in vars(a).items() if v is not None and k in _FLAG_DESTS}
    resolved = {
        "model_path": a.model_path,
        "tokenizer_path": a.tokenizer_path or a.model_path,
        "served_model_name": cfg.served_model_name,
        "host": a.host,
        "port": a.port,
        "context_length": a.context_length,
        "tp_size": a.tp_size,
        "dp_size": a.dp_size,
        "pp_size": 1,
        "max_running_requests": a.max_running_requests,
        "max_queued_requests": a.max_queued_requests,
        "max_total_tokens": a.max_total_tokens,
        "max_mamba_cache_size": cfg.max_mamba_cache_size,
        "chunked_prefill_size": a.chunked_prefill_size if a.chunked_prefill_size is not None else 8192,
        "max_prefill_tokens": 16384,
        "mem_fraction_static": a.mem_fraction_static if a.mem_fraction_static is not None else 0.871,
        "schedule_policy": "fcfs",
        "disable_radix_cache": bool(a.disable_radix_cache),
        "disable_overlap_schedule": bool(a.disable_overlap_schedule),
        "mamba_radix_cache_strategy": a.mamba_radix_cache_strategy or "no_buffer",
        "page_size": 1,
        "dtype": "auto",
        "kv_cache_dtype": "auto",
        "device": "cuda",
        "reasoning_parser": a.reasoning_parser,
        "tool_call_parser": a.tool_call_parser,
        "enable_metrics": bool(a.enable_metrics),
        "enable_cache_report": bool(a.enable_cache_report),
        "api_key": a.api_key,
        "allow_auto_truncate": bool(a.allow_auto_truncate),
        "default_chat_template_kwargs": a.default_chat_template_kwargs,
        "stream_interval": a.stream_interval or 1,
        "incremental_streaming_output": bool(a.incremental_streaming_output),
        "skip_tokenizer_init": bool(a.skip_tokenizer_init),
        "sampling_defaults": a.sampling_defaults or "model",
        "weight_version": a.weight_version or "default",
        # ModelArgs.revision and ServingArgs.chat_template: null unless given (no resolved commit, no template text)
        "revision": a.revision,
        "chat_template": a.chat_template,
        "watchdog_timeout": 300.0,
        "enable_dp_attention": False,
    }
    return {**given, **resolved, "launch_command": " ".join(cfg.argv)}


_FLAG_DESTS = frozenset(dest for _, _, dest in FLAGS)
