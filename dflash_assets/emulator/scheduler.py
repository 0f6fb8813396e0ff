"""One DP rank's scheduler: running slots, a KV budget, a FCFS waiting queue.

A request is admitted when a slot is free AND its prompt + output fit the KV pool beside the running ones, in
arrival order with head-of-line blocking (SGLang's fcfs); with --max-queued-requests a full queue refuses it (503).
Prefill and decode take real `tokens / rate` seconds, computed once; a rate of 0 is instant.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Ticket:
    input_len: int
    output_len: int
    arrival: float = field(default_factory=time.monotonic)
    admitted: asyncio.Future | _Done | None = None
    start: float = 0.0  # when admitted (monotonic)
    prefill_s: float = 0.0
    cached: int = 0  # prompt tokens served from the prefix cache
    per_token_s: float = 0.0

    @property
    def kv_tokens(self) -> int:
        return self.input_len + self.output_len

    def generated(self, now: float) -> int:
        """Output tokens produced by `now`: the request's progress, for /v1/loads."""
        if self.per_token_s <= 0:
            return self.output_len
        done = (now - self.start - self.prefill_s) / self.per_token_s
        return max(0, min(self.output_len, int(done)))

    def time_of_token(self, n: int) -> float:
        """Monotonic time at which output token n (1-based) is out."""
        return self.start + self.prefill_s + n * self.per_token_s


class Scheduler:
    def __init__(
        self,
        *,
        dp_rank: int,
        max_running_requests: int,
        max_total_num_tokens: int,
        max_queued_requests: int | None,
        decode_tokens_per_s: float,
        prefill_tokens_per_s: float,
        prefix_cache=None,
    ):
        self.dp_rank = dp_rank
        self.prefix_cache = prefix_cache  # a PrefixCache, or None with --disable-radix-cache
        self.max_running_requests = max_running_requests
        self.max_total_num_tokens = max_total_num_tokens
        self.max_queued_requests = max_queued_requests
        self.decode_tokens_per_s = decode_tokens_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.running: set[Ticket] = set()
        self.waiting: deque[Ticket] = deque()
        self._kv_reserved = 0
        # cumulative, for /v1/loads
        self.total_prefill_tokens = 0
        self.total_prefill_busy_s = 0.0
        # exact slot occupancy, for benchmarks (GET /_emulator/stats): every change of the running count
        self.timeline: deque[tuple[float, int]] = deque([(time.monotonic(), 0)], maxlen=1_000_000)

    def submit(self, input_len: int, output_len: int, slow_factor: float = 1.0, cached: int = 0) -> Ticket:
        """`cached`: leading prompt tokens the prefix cache holds; only the rest is prefilled."""
        if self.max_queued_requests is not None and len(self.waiting) + 1 > self.max_queued_requests:
            raise QueueFull()
        t = Ticket(input_len, output_len)
        t.cached = cached
        t.prefill_s = (input_len - cached) / self.prefill_tokens_per_s if self.prefill_tokens_per_s > 0 else 0.0
        t.per_token_s = slow_factor / self.decode_tokens_per_s if self.decode_tokens_per_s > 0 else 0.0
        self.waiting.append(t)
        self._pump()
        return t

    async def wait_admitted(self, t: Ticket) -> None:
        if t.admitted is None:
            t.admitted = asyncio.get_running_loop().create_future()
            self._pump()
        if isinstance(t.admitted, asyncio.Future) and not t.admitted.done():  # a _Done is done
            await t.admitted

    def _mark(self) -> None:
        now = time.monotonic()
        if self.timeline[-1][0] == now:
            self.timeline.pop()
        self.timeline.append((now, len(self.running)))

    def release(self, t: Ticket) -> None:
        """The request finished or its client went away: free its slot and KV."""
        if t in self.running:
            self.running.discard(t)
            self._kv_reserved -= t.kv_tokens
            self._mark()
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(t)
        self._pump()

    def _pump(self) -> None:
        while self.waiting:
            head = self.waiting[0]
            if len(self.running) >= self.max_running_requests:
                return
            if self._kv_reserved + head.kv_tokens > self.max_total_num_tokens:
                return
            self.waiting.popleft()
            self.running.add(head)
            self._mark()
            self._kv_reserved += head.kv_tokens
            head.start = time.monotonic()
            self.total_prefill_tokens += head.input_len - head.cached
            self.total_prefill_busy_s += head.prefill_s
            if head.admitted is None:
                head.admitted = _DONE
            elif isinstance(head.admitted, asyncio.Future) and not head.admitted.done():  # a _Done is done
                head.admitted.set_result(None)

    # ---- load, as the scheduler's LoadSnapshot reports it ----

    def used_tokens(self, now: float) -> int:
        return sum(t.input_len + t.generated(now) for t in self.running)

    def gen_throughput(self, now: float) -> float:
        """Tokens/s being decoded now: the running requests past their prefill."""
        decoding = [
            t
            for t in self.running
            if t.per_token_s > 0 and now >= t.start + t.prefill_s and t.generated(now) < t.output_len
        ]
        return sum((1.0 / t.per_token_s for t in decoding), 0.0)

    def load(self) -> dict:
        now = time.monotonic()
        used = self.used_tokens(now)
        waiting_tokens = sum(t.input_len for t in self.waiting)
        return {
            "timestamp": time.time(),
            "dp_rank": self.dp_rank,
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_waiting_uncached_tokens": waiting_tokens,
            "num_used_tokens": used,
            "num_total_tokens": used + waiting_tokens,
            "num_active_tokens": used + waiting_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "token_usage": round(used / self.max_total_num_tokens, 4),
            "gen_throughput": round(self.gen_throughput(now), 2),
            "cache_hit_rate": 0.0,
            "utilization": round(len(self.running) / self.max_running_requests, 4),
            "total_prefill_uncached_tokens": self.total_prefill_tokens,
            "total_prefill_busy_us": int(self.total_prefill_busy_s * 1e6),
            "decode_moments": None,
        }


class _Done:
    """A stand-in for a resolved future when admission needs no waiting."""

    def done(self) -> bool:
        return True


_DONE = _Done()
