"""Fault injection: what a flaky GPU server does to a client.

Set by --fault-* flags at start, and at run time through an emulator-only route (authenticated):
GET /_emulator/faults (settings, counters), POST (merge; null clears one), DELETE (clear all). The settings are
FaultSettings' fields; "generation requests" are POST /generate and /v1/chat/completions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

QUEUE_FULL = "The request queue is full."


@dataclass
class FaultSettings:
    # the process exits hard (os._exit) when generation request N+1 arrives (as a CUDA fault would); counts from set
    crash_after: int | None = None
    # the same exit when a generation request's prompt contains this: an input that kills its server
    crash_on: str | None = None
    fail_next: int | None = None  # the next N generation requests get 503 "The request queue is full."
    fail_rate: float | None = None  # each generation request gets that 503 with this probability
    fail_message: str | None = None  # the message of those 503s
    # a generation request is accepted, then held this many seconds before it is served (a hung scheduler)
    stall_seconds: float | None = None
    stall_next: int | None = None  # stall only the next N requests (default: every request)
    # the stall comes mid-stream, once K output tokens are out; a client that closes the stream aborts the request
    stall_after_tokens: int | None = None
    # a stalled request does not see its client go (half-open): it holds its slot until the stall ends or is aborted
    half_open: bool | None = None
    slow_factor: float | None = None  # decode takes F times longer (a throttled or noisy GPU)
    unhealthy: bool | None = None  # /health and /health_generate answer 503 (a stuck detokenizer)
    # a generation request is accepted, then held until hold is cleared (a test that needs work certainly in flight)
    hold: bool | None = None
    # the same hold for every generation request after the first N (from when set), until cleared; a held request
    # whose client goes is aborted
    hold_after: int | None = None
    # the next N generation requests end in a status-less abort, HTTP 200 (as /abort_request's in 0.5.23)
    abort_next: int | None = None
    tokenize_fail_next: int | None = None  # the next N /v1/tokenize requests get 503 (a server warming up)


@dataclass(frozen=True)
class Verdict:
    """What to do to one generation request before serving it."""

    crash: bool = False
    fail: str | None = None  # a 503 with this message
    stall: float = 0.0
    stall_after: int = 0  # output tokens out before the stall (0: before serving)
    half_open: bool = False  # the stalled request does not see its client go
    hold: bool = False  # wait until the hold setting is cleared
    abort: bool = False  # finish with a status-less abort (HTTP 200, finish_reason "abort")


NO_FAULT = Verdict()

SWITCH = {"action": "store_true", "default": None}  # None unless given, as FaultSettings' unset fields
# The command line's --fault-* flags (config.py): flag -> (FaultSettings field, argparse kwargs, help).
FAULT_FLAGS: dict[str, tuple[str, dict, str]] = {
    "--fault-crash-after": ("crash_after", {"type": int}, "Exit hard when generation request N+1 arrives."),
    "--fault-crash-on": ("crash_on", {}, "Exit hard when a generation request's prompt contains this text."),
    "--fault-503-next": ("fail_next", {"type": int}, "Answer the next N generation requests with 503."),
    "--fault-503-rate": ("fail_rate", {"type": float}, "Answer this share of generation requests with 503."),
    "--fault-stall-seconds": ("stall_seconds", {"type": float}, "Hold generation requests this long before serving."),
    "--fault-stall-next": ("stall_next", {"type": int}, "Stall only the next N requests (default: all)."),
    "--fault-stall-after-tokens": ("stall_after_tokens", {"type": int}, "Stall once this many output tokens are out."),
    "--fault-half-open": ("half_open", SWITCH, "A stalled request keeps its slot when its client goes (half-open)."),
    "--fault-hold": ("hold", SWITCH, "Hold generation requests until POST /_emulator/faults clears hold."),
    "--fault-hold-after": ("hold_after", {"type": int}, "Serve N generation requests, then hold every later one."),
    "--fault-slow-factor": ("slow_factor", {"type": float}, "Multiply decode time by this factor."),
}


class Faults:
    def __init__(self, settings: FaultSettings | None = None, seed: int = 0):
        self.settings = settings or FaultSettings()
        self.requests_seen = 0  # generation requests since crash_after was set
        self.requests_before_hold = 0  # generation requests since hold_after was set
        self.injected = {"crash": 0, "fail": 0, "stall": 0, "hold": 0, "abort": 0, "tokenize_fail": 0}
        self._rng = random.Random(seed)

    @property
    def slow_factor(self) -> float:
        return self.settings.slow_factor or 1.0

    @property
    def unhealthy(self) -> bool:
        return bool(self.settings.unhealthy)

    @property
    def held(self) -> bool:
        return bool(self.settings.hold) or self.settings.hold_after is not None

    def update(self, changes: dict) -> None:
        known = {f.name for f in fields(FaultSettings)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown fault settings: {sorted(unknown)}; known: {sorted(known)}")
        for key, value in changes.items():
            setattr(self.settings, key, value)
        if "crash_after" in changes:
            self.requests_seen = 0
        if "hold_after" in changes:
            self.requests_before_hold = 0

    def clear(self) -> None:
        self.settings = FaultSettings()

    def to_dict(self) -> dict:
        return {
            "settings": {f.name: getattr(self.settings, f.name) for f in fields(FaultSettings)},
            "requests_seen": self.requests_seen,
            "injected": dict(self.injected),
        }

    def judge(self, prompt: str = "") -> Verdict:
        """Called once per arriving generation request, with its prompt's text (`prompt_text`)."""
        s = self.settings
        self.requests_seen += 1
        self.requests_before_hold += 1
        if (s.crash_after is not None and self.requests_seen > s.crash_after) or (s.crash_on and s.crash_on in prompt):
            self.injected["crash"] += 1
            return Verdict(crash=True)
        if s.fail_next:
            s.fail_next -= 1
            self.injected["fail"] += 1
            return Verdict(fail=s.fail_message or QUEUE_FULL)
        if s.abort_next:
            s.abort_next -= 1
            self.injected["abort"] += 1
            return Verdict(abort=True)
        if s.fail_rate and self._rng.random() < s.fail_rate:
            self.injected["fail"] += 1
            return Verdict(fail=s.fail_message or QUEUE_FULL)
        if s.hold or (s.hold_after is not None and self.requests_before_hold > s.hold_after):
            self.injected["hold"] += 1
            return Verdict(hold=True)
        if s.stall_seconds and (s.stall_next is None or s.stall_next > 0):
            if s.stall_next is not None:
                s.stall_next -= 1
            self.injected["stall"] += 1
            return Verdict(stall=s.stall_seconds, stall_after=s.stall_after_tokens or 0, half_open=bool(s.half_open))
        return NO_FAULT

    def tokenize_fails(self) -> bool:
        """Called once per /v1/tokenize request: True when it is to be answered 503."""
        if self.settings.tokenize_fail_next:
            self.settings.tokenize_fail_next -= 1
            self.injected["tokenize_fail"] += 1
            return True
        return False


def prompt_text(body: dict) -> str:
    """The text of a generation request's prompt: its messages' contents (text parts too), or /generate's text."""
    if "messages" in body:
        texts = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            parts = content if isinstance(content, list) else [content]
            texts += [p.get("text") if isinstance(p, dict) else p for p in parts]
        return "\n".join(t for t in texts if isinstance(t, str))
    text = body.get("text")
    return "\n".join(t for t in (text if isinstance(text, list) else [text]) if isinstance(t, str))


def from_args(args) -> Faults:
    return Faults(FaultSettings(**{name: getattr(args, f"fault_{name}") for name, _, _ in FAULT_FLAGS.values()}))
