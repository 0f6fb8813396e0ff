"""The request path below the HTTP routes, in 0.5.23's order:

1. tokenizer manager (`_validate_one_request`): prompt >= context_len or prompt + max_new_tokens > context_len
   -> 400 (with --allow-auto-truncate, max_new_tokens is cut instead); then `SamplingParams.verify`.
2. scheduler: max_new_tokens SILENTLY clamped to max_req_len - input - 1; a prompt of at least max_req_input_len
   aborted with 400; a full waiting queue aborted with 503: finish_reason {"type": "abort", ...} outputs.
Then the timed stream of outputs.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import random
import time
import uuid
from array import array
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from . import detokenizer, model
from . import tokenizer as tok
from .config import EmulatorSetup
from .faults import NO_FAULT, QUEUE_FULL, Faults, Verdict
from .prefix_cache import PrefixCache
from .scheduler import QueueFull, Scheduler

# Streaming (output_streamer.py accept): the first token alone, then an event per `stream_interval` tokens; not given,
# chunks of this many, as the tokenizer manager coalesces outputs behind a busy writer (_stream_one_response).
STREAM_CHUNK_TOKENS = 32
INSTANT_STREAM_CHUNK_TOKENS = 256
T = TypeVar("T")
HOLD_POLL_S = 0.05  # how often a held request looks whether the hold was cleared


class TokenizerError(ValueError):
    """A tokenizer-manager ValueError: HTTP 400 before the request is scheduled."""


@dataclass
class Request:
    input_ids: list[int]
    sampling: dict  # SGLang sampling_params keys (max_new_tokens, stop, ignore_eos, ...)
    stream: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    require_reasoning: bool = False
    tools: list[dict] | None = None  # the request's tool schemas: its answer may call them (model.plan_completion)
    sample_index: int = 0  # n > 1: the i-th sample of one prompt
    # SamplingParams' default when absent: 128 on /generate, None on chat (to the end of the context)
    default_max_new_tokens: int | None = None
    arrival: float = field(default_factory=time.perf_counter)


@dataclass
class Output:
    """One step's state of a request, cumulative (what the detokenizer hands up)."""

    output_ids: list[int]
    text: str
    finish: dict | None  # SGLang finish_reason JSON; None while running
    prompt_tokens: int
    reasoning_tokens: int = 0
    e2e_latency: float | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not prefilled again)

    @property
    def done(self) -> dict:
        """The finish_reason of an output that has one (a finished or aborted request)."""
        if self.finish is None:
            raise RuntimeError("the request is still running: it has no finish_reason yet")
        return self.finish

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def aborted(self) -> bool:
        return bool(self.finish and self.finish.get("type") == "abort")


# sampling/sampling_params.py SamplingParams.__init__ defaults: what /generate samples with when nothing is sent
SAMPLING_PARAM_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def verify_sampling(sp: dict) -> None:
    """SamplingParams.verify's checks and messages (ValueError -> HTTP 400)."""
    t = sp.get("temperature", 1.0)
    t = 1.0 if t is None else t
    if not math.isfinite(t) or t < 0.0:
        raise TokenizerError(f"temperature must be a non-negative finite number, got {t}.")
    top_p = 1.0 if sp.get("top_p") is None else sp["top_p"]
    if not 0.0 < top_p <= 1.0:
        raise TokenizerError(f"top_p must be in (0, 1], got {top_p}.")
    min_p = 0.0 if sp.get("min_p") is None else sp["min_p"]
    if not 0.0 <= min_p <= 1.0:
        raise TokenizerError(f"min_p must be in [0, 1], got {min_p}.")
    top_k = 1 << 30 if sp.get("top_k") is None else sp["top_k"]
    if top_k != -1 and top_k < 1:  # -1 means the whole vocabulary
        raise TokenizerError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        v = sp.get(name) or 0.0
        if not -2.0 <= v <= 2.0:
            raise TokenizerError(f"{name} must be in [-2, 2], got {v}.")
    rp = 1.0 if sp.get("repetition_penalty") is None else sp["repetition_penalty"]
    if not 0.0 < rp <= 2.0:
        raise TokenizerError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rp}.")
    min_new = sp.get("min_new_tokens") or 0
    if min_new < 0:
        raise TokenizerError(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    max_new = sp.get("max_new_tokens")
    if max_new is not None:
        if max_new < 0:
            raise TokenizerError(f"max_new_tokens must be at least 0, got {max_new}.")
        if min_new > max_new:
            raise TokenizerError(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    seed = sp.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise TokenizerError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")


class Engine:
    def __init__(self, cfg: EmulatorSetup, faults: Faults):
        self.cfg = cfg
        self.faults = faults
        self._random = random.Random()  # seeded by the OS: every server, every request draws its own
        # with --random-seed, the n-th request of the same input ids draws the same on every run, in any order
        self._seeded_draws: dict[bytes, int] | None = {} if cfg.args.random_seed is not None else None
        a = cfg.args
        self.schedulers = [
            Scheduler(
                dp_rank=rank,
                max_running_requests=cfg.max_running_requests,
                max_total_num_tokens=cfg.max_total_num_tokens,
                max_queued_requests=a.max_queued_requests,
                decode_tokens_per_s=a.decode_tokens_per_s,
                prefill_tokens_per_s=a.prefill_tokens_per_s,
                prefix_cache=None if a.disable_radix_cache else PrefixCache(cfg.max_total_num_tokens),
            )
            for rank in range(max(1, a.dp_size))
        ]
        self._round_robin = itertools.cycle(self.schedulers)
        self.stream_interval = a.stream_interval  # None: not given
        # tokenizer-side counters for /metrics: (is_streaming) -> value
        self.counters: dict[str, dict] = {"prompt_tokens": {}, "generation_tokens": {}, "requests": {}}
        self.num_aborted = 0
        self.abort_events: dict[str, asyncio.Event] = {}  # rid -> set by /abort_request, for requests running now
        self.abort_requests: list[dict] = []  # every /abort_request: its rid, and whether a request had it
        self.stalled_rids: list[str] = []  # the requests the stall fault held, in arrival order
        self.detached: set[asyncio.Task] = set()  # half-open streams still running for a client that left
        self.sampled: deque = deque(maxlen=1000)  # the last requests' resolved sampling parameters
        self.e2e_sum = 0.0
        self.e2e_count = 0

    # ---- 1. tokenizer manager ----

    def abort_request(self, rid: str, abort_all: bool = False) -> None:
        """tokenizer_manager.abort_request: this rid, or all, end in a status-less abort (empty rid: ignored)."""
        targets = list(self.abort_events) if abort_all else [rid] if rid and rid in self.abort_events else []
        self.abort_requests.append({"rid": rid, "abort_all": abort_all, "running": bool(targets)})
        for target in targets:
            self.abort_events[target].set()

    def record_sampling(self, req: Request) -> None:
        """What a request is sampled with, defaults filled in, kept for /_emulator/stats."""
        sp = req.sampling
        self.sampled.append(
            {
                "rid": req.rid,
                **{k: v if (v := sp.get(k)) is not None else default for k, default in SAMPLING_PARAM_DEFAULTS.items()},
            }
        )

    def validate(self, req: Request) -> None:
        """`_validate_one_request` then `SamplingParams.verify`; raises TokenizerError."""
        ctx = self.cfg.context_len
        n = len(req.input_ids)
        if n >= ctx:
            if not self.cfg.args.allow_auto_truncate:
                raise TokenizerError(
                    f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
                )
            del req.input_ids[ctx:]
            n = len(req.input_ids)
        max_new = req.sampling.get("max_new_tokens")
        if max_new is not None and max_new + n > ctx:
            if not self.cfg.args.allow_auto_truncate:
                raise TokenizerError(
                    f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                    f"You requested a total of {max_new + n} tokens: {n} tokens from the input messages and "
                    f"{max_new} tokens for the completion. Please reduce the number of tokens in the input "
                    "messages or the completion to fit within the limit."
                )
            req.sampling["max_new_tokens"] = max(0, ctx - n)
        req.sampling.setdefault("max_new_tokens", req.default_max_new_tokens)
        verify_sampling(req.sampling)
        self.record_sampling(req)

    # ---- 2. scheduler and model ----

    async def final(self, req: Request, verdict: Verdict = NO_FAULT) -> Output:
        """The last output of `run` (a request not streamed)."""
        out = None
        async for out in self.run(req, verdict):  # noqa: B007 (the last one is returned)
            pass
        if out is None:
            raise RuntimeError("the engine gave no output for the request")
        return out

    async def run(self, req: Request, verdict: Verdict = NO_FAULT) -> AsyncGenerator[Output, None]:
        """Outputs of one validated request: progress chunks when streaming, then the final one (or an abort)."""
        if len(req.input_ids) >= self.cfg.max_req_input_len:
            if not self.cfg.args.allow_auto_truncate:
                yield self._abort(
                    req,
                    f"Input length ({len(req.input_ids)} tokens) exceeds the maximum allowed length "
                    f"({self.cfg.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.",
                    400,
                )
                return
            req.input_ids = req.input_ids[: self.cfg.max_req_input_len]
        aborted = self.abort_events[req.rid] = asyncio.Event()
        outputs = self._run(req, verdict, aborted)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()  # its slot is freed now, not when it is collected
            if self.abort_events.get(req.rid) is aborted:
                del self.abort_events[req.rid]

    async def _run(self, req: Request, verdict: Verdict, aborted: asyncio.Event) -> AsyncGenerator[Output, None]:
        ids = req.input_ids
        sp = req.sampling
        max_new = sp.get("max_new_tokens")
        max_new = max(0, min(1 << 30 if max_new is None else max_new, self.cfg.max_req_len - len(ids) - 1))
        if verdict.stall:
            self.stalled_rids.append(req.rid)
        if verdict.stall and not verdict.stall_after and await _stalled(verdict.stall, aborted):
            yield self._abort(req, "Aborted", None)
            return
        try:
            while verdict.hold and self.faults.held:
                await asyncio.sleep(HOLD_POLL_S)
        except (asyncio.CancelledError, GeneratorExit):  # its client went while it waited: aborted, as SGLang
            self.num_aborted += 1  # counts any request it knows (tokenizer_manager.abort_request)
            raise
        if verdict.fail:
            yield self._abort(req, verdict.fail, 503)
            return
        if verdict.abort:  # FINISH_ABORT() with no status_code: the client sees HTTP 200, finish_reason "abort"
            yield self._abort(req, "Aborted", None)
            return
        gen = self._generate(req, max_new)
        sched = next(self._round_robin)
        cached = sched.prefix_cache.match(ids) if sched.prefix_cache else 0
        try:
            ticket = sched.submit(len(ids), len(gen.output_ids), self.faults.slow_factor, cached=cached)
        except QueueFull:
            yield self._abort(req, QUEUE_FULL, 503)
            return
        finished = False
        try:
            await sched.wait_admitted(ticket)
            n = len(gen.output_ids)
            steps = []
            if req.stream and n > 1:
                step = self.stream_step(req, ticket.per_token_s > 0)
                steps = [1, *range(1 + step, n, step)]
            sent = self._sent_texts(req, gen, steps) if self.cfg.args.non_ascii else None
            skip, text, done = sp_skip(sp), "", 0
            stall_at = verdict.stall_after if verdict.stall else None  # a stall mid-stream, once that many are out
            for i, k in enumerate(steps):
                await _sleep_until(ticket.time_of_token(k))
                if sent is None:
                    text += tok.decode(gen.output_ids[done:k], skip_special_tokens=skip)  # O(n) overall
                else:
                    text += sent[i]
                done = k
                yield Output(gen.output_ids[:k], text, None, len(ids), self._reasoning(req, gen, k))
                if stall_at is not None and k >= stall_at:
                    stall_at = None
                    if await _stall(ticket, verdict.stall, aborted):
                        break
                if aborted.is_set():
                    break
            if stall_at is not None and stall_at < n and not aborted.is_set():  # not streamed: it hangs all the same
                await _sleep_until(ticket.time_of_token(stall_at))
                await _stall(ticket, verdict.stall, aborted)
            if aborted.is_set():  # /abort_request: FINISH_ABORT() without a status, the slot freed
                finished = True
                yield self._abort(req, "Aborted", None)
                return
            await _sleep_until(ticket.time_of_token(n))
            if sched.prefix_cache:
                sched.prefix_cache.insert(ids + gen.output_ids)
            if sent is not None:  # the reply's text is every piece the detokenizer sent, joined
                gen = replace(gen, text="".join(sent))
            finished = True
            yield replace(self._final(req, gen), cached_tokens=cached)
        finally:
            if not finished:  # the client went away (its handler was cancelled): SGLang aborts the request
                self.num_aborted += 1
            sched.release(ticket)

    def stream_step(self, req: Request, timed: bool) -> int:
        """Tokens per streamed event after the first: the request's stream_interval, the server's, or a chunk."""
        interval = req.sampling.get("stream_interval") or self.stream_interval
        if interval:
            return max(1, interval)
        return STREAM_CHUNK_TOKENS if timed else INSTANT_STREAM_CHUNK_TOKENS

    def _draw(self, input_ids: list[int]) -> float:
        if self._seeded_draws is None:
            return self._random.random()
        key = hashlib.blake2b(array("q", input_ids).tobytes(), digest_size=16).digest()
        nth = self._seeded_draws[key] = self._seeded_draws.get(key, 0) + 1
        return random.Random(f"{self.cfg.args.random_seed}:{key.hex()}:{nth}").random()

    def _generate(self, req: Request, max_new: int) -> model.Generation:
        sp = req.sampling
        # temperature > 0 (SGLang's default 1.0) without a seed draws anew; 0 or a seed: the prompt's completion
        temperature = 1.0 if sp.get("temperature") is None else sp["temperature"]
        seed = sp.get("sampling_seed")
        draw = (
            self._draw(req.input_ids)
            if temperature > 0 and seed is None and self.cfg.args.sampling == "per-request"
            else None
        )
        plan = model.plan_completion(
            req.input_ids,
            self.cfg.lengths,
            seed,
            req.sample_index,
            draw=draw,
            non_ascii=self.cfg.args.non_ascii,
            tools=req.tools,
        )
        stop = sp.get("stop")
        return model.generate(
            plan,
            max_new,
            ignore_eos=bool(sp.get("ignore_eos")),
            stop=[stop] if isinstance(stop, str) else stop,
            stop_token_ids=sp.get("stop_token_ids"),
            no_stop_trim=bool(sp.get("no_stop_trim")),
        )

    def _sent_texts(self, req: Request, gen: model.Generation, steps: list[int]) -> list[str]:
        """--non-ascii: what SGLang's detokenizer sends at each step (detokenizer.py), then at the finished one."""
        sp, n = req.sampling, len(gen.output_ids)
        steps = [*steps, n] if steps else detokenizer.non_streamed_steps(n)
        return detokenizer.output_strs(
            req.input_ids, gen.output_ids, steps, gen.finish, sp_skip(sp), bool(sp.get("no_stop_trim"))
        )

    def _reasoning(self, req: Request, gen: model.Generation, k: int) -> int:
        """Reasoning tokens among the first k outputs, when the request requires reasoning."""
        if not req.require_reasoning:
            return 0
        return min(k, gen.reasoning_tokens)

    def _final(self, req: Request, gen: model.Generation) -> Output:
        latency = time.perf_counter() - req.arrival
        key = str(req.stream).lower()
        for name, value in (
            ("prompt_tokens", len(req.input_ids)),
            ("generation_tokens", len(gen.output_ids)),
            ("requests", 1),
        ):
            self.counters[name][key] = self.counters[name].get(key, 0) + value
        self.e2e_sum += latency
        self.e2e_count += 1
        return Output(
            gen.output_ids,
            gen.text,
            gen.finish,
            len(req.input_ids),
            self._reasoning(req, gen, len(gen.output_ids)),
            e2e_latency=latency,
        )

    def _abort(self, req: Request, message: str, status: int | None) -> Output:
        self.num_aborted += 1
        finish = {"type": "abort", "message": message, "status_code": status, "err_type": None}
        return Output([], "", finish, len(req.input_ids), e2e_latency=time.perf_counter() - req.arrival)

    def loads(self) -> list[dict]:
        return [s.load() for s in self.schedulers]


def sp_skip(sp: dict) -> bool:
    v = sp.get("skip_special_tokens")
    return True if v is None else bool(v)


async def _stalled(seconds: float, aborted: asyncio.Event) -> bool:
    """No progress for `seconds`, or until /abort_request names the request: True when it was aborted."""
    try:
        await asyncio.wait_for(aborted.wait(), seconds)
    except TimeoutError:
        return False
    return True


async def _stall(ticket, seconds: float, aborted: asyncio.Event) -> bool:
    """The request makes no progress for `seconds`; what is left of its decode comes after. True: aborted."""
    if await _stalled(seconds, aborted):
        return True
    ticket.start += seconds
    return False


async def unseen_disconnect(engine: Engine, serving: Awaitable[T]) -> T:
    """The half-open fault: `serving` goes on when its client goes, holding its slot until it ends."""
    task = asyncio.ensure_future(serving)
    engine.detached.add(task)
    task.add_done_callback(_forget(engine.detached))
    return await asyncio.shield(task)


def _forget(tasks: set[asyncio.Task]) -> Callable[[asyncio.Task], None]:
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # a write to the gone client fails: retrieved, not logged as never retrieved

    return done


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
