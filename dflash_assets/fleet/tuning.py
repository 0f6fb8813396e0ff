"""Is each server sized right? `/v1/loads` sampled during a run (`LoadSampler`), turned into per-server figures
(`summarize`) and advice with the numbers behind it (`advise`): slots pinned, a queue, KV pool nearly empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from rich.table import Table

from dflash_assets.fleet.client import MAMBA_SLOTS_PER_REQUEST, ServerAccessError, ServerClient, ServerError, ServerInfo

# mamba usage is not in 0.5.23's /v1/loads (load_snapshot.py), only in this gauge with --enable-metrics
MAMBA_USAGE_METRIC = "sglang:mamba_usage"


@dataclass(frozen=True)
class LoadSample:
    """One server's `/v1/loads` at one moment, summed over its DP ranks."""

    t: float  # seconds since the sampler started
    server: str
    running: int = 0
    waiting: int = 0
    max_running: int | None = None
    token_usage: float | None = None  # KV tokens in use / KV pool
    mamba_usage: float | None = None  # /metrics sglang:mamba_usage, the fullest DP rank
    gen_throughput: float | None = None  # tokens/s decoded
    metrics: bool | None = None  # /metrics was read (True), answered 404: no --enable-metrics (False), not asked
    error: str | None = None  # the poll failed; the other fields are empty


def parse_loads(server: str, t: float, body: dict) -> LoadSample:
    rows = body.get("loads") or []
    if not rows:
        return LoadSample(t, server, error="/v1/loads returned no loads")

    def total(key: str) -> int | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return int(sum(values)) if values else None

    pool, used = total("max_total_num_tokens"), total("num_used_tokens")
    usage = used / pool if pool and used is not None else max((r.get("token_usage") or 0.0) for r in rows)
    throughput = [r["gen_throughput"] for r in rows if r.get("gen_throughput") is not None]
    return LoadSample(
        t,
        server,
        running=total("num_running_reqs") or 0,
        waiting=total("num_waiting_reqs") or 0,
        max_running=total("max_running_requests"),
        token_usage=usage,
        gen_throughput=sum(throughput) if throughput else None,
    )


def parse_mamba_usage(text: str) -> float | None:
    """The fullest DP rank's `sglang:mamba_usage` in a Prometheus text; None when absent (a dense model)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((MAMBA_USAGE_METRIC + "{", MAMBA_USAGE_METRIC + " "))
    ]
    return max(values) if values else None


class LoadSampler:
    """Polls `/v1/loads` of every client each `interval_s` (the last `max_samples` kept); a failed poll is a sample."""

    def __init__(self, clients: Sequence[ServerClient], interval_s: float = 1.0, max_samples: int = 3600):
        self.clients = list(clients)
        self.interval_s = interval_s
        self._samples: dict[str, deque[LoadSample]] = {c.url: deque(maxlen=max_samples) for c in self.clients}
        self._metrics: dict[str, bool] = {}  # url -> whether its /metrics answered
        self._task: asyncio.Task | None = None
        self._t0 = time.monotonic()

    @property
    def samples(self) -> list[LoadSample]:
        return sorted((s for q in self._samples.values() for s in q), key=lambda s: (s.t, s.server))

    async def _one(self, client: ServerClient) -> None:
        t = time.monotonic() - self._t0
        try:
            body = await asyncio.wait_for(client.loads(), timeout=max(2.0, self.interval_s))
            sample = parse_loads(client.url, t, body)
            if self._metrics.get(client.url) is not False:  # a 404 once means no --enable-metrics: not asked again
                text = await asyncio.wait_for(client.metrics(), timeout=max(2.0, self.interval_s))
                self._metrics[client.url] = text is not None
                sample = replace(
                    sample, metrics=text is not None, mamba_usage=parse_mamba_usage(text) if text is not None else None
                )
            else:
                sample = replace(sample, metrics=False)
        except (TimeoutError, ServerError, ServerAccessError, TypeError, ValueError, KeyError) as e:
            sample = LoadSample(t, client.url, error=getattr(e, "message", None) or f"{type(e).__name__}: {e}")
        self._samples[client.url].append(sample)

    async def sample_once(self) -> None:
        await asyncio.gather(*(self._one(c) for c in self.clients))

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            await self.sample_once()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def start(self) -> LoadSampler:
        if self._task is None:
            self._t0 = time.monotonic()
            self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> list[LoadSample]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        return self.samples


# ---- per-server figures ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerLoad:
    server: str
    samples: int
    failed: int  # polls that got no answer
    span_s: float
    max_running: int | None
    running_mean: float
    running_max: int
    occupancy: float  # mean running / max_running
    pinned_share: float  # samples with running >= max_running
    waiting_mean: float
    waiting_max: int
    waiting_share: float  # samples with a queue
    blocked_share: float  # samples with a queue while slots were free: something else (KV) holds requests back
    busy_share: float  # samples with anything running or waiting
    token_usage_p95: float | None
    mamba_usage_p95: float | None
    throughput_mean: float | None
    occupancy_line: str  # running / max_running over time, as a sparkline
    waiting_line: str
    metrics_off: bool = False  # every answered sample found /metrics off (404): mamba usage cannot be known


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], top: float, width: int = 24) -> str:
    """`values` averaged into at most `width` buckets, each drawn as a bar of height value / top."""
    if not values:
        return ""
    edges = [round(i * len(values) / min(width, len(values))) for i in range(min(width, len(values)) + 1)]
    means = [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]
    return "".join(_BARS[min(7, int(8 * m / top)) if top > 0 else 0] for m in means)


def _p95(values: list[float]) -> float | None:
    return sorted(values)[max(0, math.ceil(0.95 * len(values)) - 1)] if values else None


def summarize(
    samples: Iterable[LoadSample], infos: Sequence[ServerInfo] | Mapping[str, ServerInfo] = ()
) -> list[ServerLoad]:
    info = infos if isinstance(infos, Mapping) else {i.url: i for i in infos}
    by_server: dict[str, list[LoadSample]] = {}
    for s in sorted(samples, key=lambda s: s.t):
        by_server.setdefault(s.server, []).append(s)
    out = []
    for server, all_ in by_server.items():
        ok = [s for s in all_ if s.error is None]
        limit = next((s.max_running for s in reversed(ok) if s.max_running), None)
        limit = limit or (info[server].max_running_requests if server in info else None)
        n = max(len(ok), 1)
        running, waiting = [s.running for s in ok], [s.waiting for s in ok]
        usage = [s.token_usage for s in ok if s.token_usage is not None]
        mamba = [s.mamba_usage for s in ok if s.mamba_usage is not None]
        rate = [s.gen_throughput for s in ok if s.gen_throughput is not None]
        out.append(
            ServerLoad(
                server=server,
                samples=len(all_),
                failed=len(all_) - len(ok),
                span_s=all_[-1].t - all_[0].t,
                max_running=limit,
                running_mean=sum(running) / n,
                running_max=max(running, default=0),
                occupancy=sum(running) / n / limit if limit else 0.0,
                pinned_share=sum(limit is not None and r >= limit for r in running) / n,
                waiting_mean=sum(waiting) / n,
                waiting_max=max(waiting, default=0),
                waiting_share=sum(w > 0 for w in waiting) / n,
                blocked_share=sum(s.waiting > 0 and limit is not None and s.running < limit for s in ok) / n,
                busy_share=sum(s.running + s.waiting > 0 for s in ok) / n,
                token_usage_p95=_p95(usage),
                mamba_usage_p95=_p95(mamba),
                metrics_off=bool(ok) and all(s.metrics is False for s in ok),
                throughput_mean=sum(rate) / len(rate) if rate else None,
                occupancy_line=sparkline(running, limit or max(running, default=1)),
                waiting_line=sparkline(waiting, max(max(waiting, default=0), 1)),
            )
        )
    return out


# ---- advice ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TuningThresholds:
    """When a rule fires: shares of a server's answered samples, usages P95 (constants, not settings)."""

    min_samples: int = 3
    unreachable_share: float = 0.5  # polls without an answer
    idle_busy_share: float = 0.1  # anything running or waiting in fewer samples than this: idle
    queue_share: float = 0.5  # "requests waiting" means a queue in at least this share of samples
    pinned_share: float = 0.5  # running at max_running_requests in at least this share of samples
    kv_headroom: float = 0.7  # KV usage below this leaves room for more running requests
    kv_full: float = 0.9  # KV usage at or above this with a queue: the KV pool is the limit
    kv_target: float = 0.8  # the KV usage a suggested --max-running-requests aims at
    mamba_full: float = 0.95
    under_used_occupancy: float = 0.5  # running below this share of max_running_requests ...
    under_used_busy_share: float = 0.8  # ... while busy in at least this share of samples ...
    quiet_queue_share: float = 0.1  # ... and a queue in fewer than this share
    max_raise_factor: float = 4.0  # a suggested --max-running-requests is at most this times the current one


@dataclass(frozen=True)
class Advice:
    server: str
    rule: str  # unreachable | too_few_samples | idle | kv_full | mamba_full | mamba_unavailable | slots_pinned
    #            | under_used | fine
    message: str
    evidence: dict[str, int | float | str]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"


def _evidence(load: ServerLoad, **extra) -> dict[str, int | float | str]:
    figures = {
        "samples": load.samples,
        "span_s": round(load.span_s, 1),
        "max_running_requests": load.max_running,
        "running_mean": round(load.running_mean, 2),
        "running_max": load.running_max,
        "occupancy": round(load.occupancy, 3),
        "pinned_share": round(load.pinned_share, 3),
        "waiting_mean": round(load.waiting_mean, 2),
        "waiting_max": load.waiting_max,
        "waiting_share": round(load.waiting_share, 3),
        "blocked_share": round(load.blocked_share, 3),
        "token_usage_p95": load.token_usage_p95,
        "mamba_usage_p95": load.mamba_usage_p95,
        **extra,
    }
    return {k: v for k, v in figures.items() if v is not None}


@dataclass(frozen=True)
class _Judged:
    """One server's load as the rules read it (mamba slots per request None: not a hybrid model)."""

    load: ServerLoad
    th: TuningThresholds
    in_flight: int | None
    slots_per_request: int | None

    @property
    def queue(self) -> bool:
        return self.load.waiting_share >= self.th.queue_share

    @property
    def mamba(self) -> bool:
        return self.load.mamba_usage_p95 is not None and self.load.mamba_usage_p95 >= self.th.mamba_full

    @property
    def seen(self) -> str:
        load = self.load
        return (
            f"requests waiting in {_pct(load.waiting_share)} of samples ({load.waiting_mean:.0f} on average, "
            f"peak {load.waiting_max})"
        )

    def advice(self, rule: str, message: str, **extra) -> Advice:
        return Advice(self.load.server, rule, message, _evidence(self.load, **extra))


def _unjudged(j: _Judged) -> Advice | None:
    """A server that cannot be judged: unreachable, too few answered samples, or sent no work."""
    load, th = j.load, j.th
    answered = load.samples - load.failed
    if load.failed and load.failed / load.samples >= th.unreachable_share:
        return j.advice(
            "unreachable",
            f"/v1/loads failed in {load.failed} of {load.samples} samples: the server "
            f"is down, restarting or too busy to answer",
        )
    if answered < th.min_samples:
        return j.advice("too_few_samples", f"only {answered} answered samples: sample for longer before judging")
    if load.busy_share < th.idle_busy_share:
        return j.advice(
            "idle",
            f"nothing ran in {answered} samples over {load.span_s:.0f} s: the client sent this "
            f"server no work (ejected after failures, or missing from the fleet's list?)",
        )
    return None


def _kv_full(j: _Judged) -> Advice | None:
    load, th, r, kv = j.load, j.th, j.load.max_running, j.load.token_usage_p95
    if not (j.queue and (load.blocked_share >= th.queue_share or (kv is not None and kv >= th.kv_full))):
        return None
    slots = (
        f"while only {load.running_mean:.1f} of max_running_requests={r} ran"
        if load.blocked_share >= th.queue_share
        else f"with {load.running_mean:.1f} of {r} slots running"
    )
    return j.advice(
        "kv_full",
        f"{j.seen} {slots}, KV token usage "
        f"{_pct(kv)} (P95; the scheduler also reserves each request's output still to come): the KV pool is "
        f"the limit, not the slots. Lower the concurrency (the client's in-flight per server, or "
        f"--max-running-requests to about {max(1, math.ceil(load.running_mean))}) or the cap "
        f"(max_output_tokens), or give the KV pool more memory (--mem-fraction-static; on a hybrid model a "
        f"smaller --max-mamba-cache-size leaves more for KV)",
    )


def _mamba_full(j: _Judged) -> Advice | None:
    if not (j.queue and j.mamba):
        return None
    return j.advice(
        "mamba_full",
        f"mamba state usage {_pct(j.load.mamba_usage_p95)} (P95) and {j.seen}: the hybrid model's state slots are "
        f"the limit. Raise --max-mamba-cache-size ({j.slots_per_request or MAMBA_SLOTS_PER_REQUEST} slots per "
        f"running request on this server); the slots come out of the KV pool",
    )


def _mamba_unavailable(j: _Judged) -> Advice | None:
    if not (j.queue and j.slots_per_request is not None and j.load.metrics_off):
        return None
    return j.advice(
        "mamba_unavailable",
        f"{j.seen} on a hybrid model, but the mamba_full rule cannot be judged: mamba state usage is only in "
        f"/metrics (sglang:mamba_usage), and this server runs without --enable-metrics",
    )


def _slots_pinned(j: _Judged) -> Advice | None:
    load, th, r, kv, per = j.load, j.th, j.load.max_running, j.load.token_usage_p95, j.slots_per_request
    if not (
        j.queue and r and load.pinned_share >= th.pinned_share and not j.mamba and (kv is None or kv < th.kv_headroom)
    ):
        return None
    room = math.floor(r * th.kv_target / max(kv, 1e-3)) if kv is not None else None
    target = max(r + 1, min(room or 10**9, int(r * th.max_raise_factor)))
    kv_note = f"the KV pool has room for about {room} at {th.kv_target:.0%} usage" if room else "KV usage unknown"
    mamba_slots = per * target if per is not None else None  # a hybrid model's
    mamba_text = (
        f" and --max-mamba-cache-size to at least {mamba_slots} ({per} state slots per running request on this server)"
        if mamba_slots is not None
        else ""
    )
    return j.advice(
        "slots_pinned",
        f"running requests pinned at max_running_requests={r} in {_pct(load.pinned_share)} of samples, "
        f"{j.seen}, while KV usage peaked at {_pct(kv)}: the slots are the limit. Raise --max-running-requests "
        f"to about {target} ({kv_note}){mamba_text}; the client's default in-flight (max_running_requests + 2) follows",
        suggested_max_running_requests=target,
        **({"suggested_max_mamba_cache_size": mamba_slots} if mamba_slots is not None else {}),
    )


def _under_used(j: _Judged) -> Advice | None:
    load, th, r = j.load, j.th, j.load.max_running
    if not (
        r
        and load.occupancy < th.under_used_occupancy
        and load.waiting_share < th.quiet_queue_share
        and load.busy_share >= th.under_used_busy_share
    ):
        return None
    sent = f" (it sends {j.in_flight})" if j.in_flight else ""
    return j.advice(
        "under_used",
        f"running {load.running_mean:.1f} of max_running_requests={r} on average ({_pct(load.occupancy)}) "
        f"with nothing waiting while busy in {_pct(load.busy_share)} of samples: the client is the limit, "
        f"not the server. Raise the client's in-flight per server{sent} to about {r + 2} "
        f"(max_in_flight_per_server; 0 means the server's max_running_requests + 2)",
        suggested_in_flight_per_server=r + 2,
    )


RULES = (_kv_full, _mamba_full, _mamba_unavailable, _slots_pinned, _under_used)


def _server_rules(
    load: ServerLoad,
    th: TuningThresholds,
    in_flight: int | None,
    slots_per_request: int | None = MAMBA_SLOTS_PER_REQUEST,
) -> list[Advice]:
    j = _Judged(load, th, in_flight, slots_per_request)
    if (unjudged := _unjudged(j)) is not None:
        return [unjudged]
    found = [a for rule in RULES if (a := rule(j)) is not None]
    return found or [
        j.advice(
            "fine",
            f"all fine: {load.running_mean:.1f} of {load.max_running or '?'} slots used on average "
            f"({_pct(load.occupancy)}), KV usage {_pct(load.token_usage_p95)} (P95), {load.waiting_mean:.1f} waiting "
            f"on average",
        )
    ]


def advise(
    samples: Iterable[LoadSample],
    infos: Sequence[ServerInfo] | Mapping[str, ServerInfo] = (),
    thresholds: TuningThresholds = TuningThresholds(),
    client_in_flight: int | Mapping[str, int] | None = None,
) -> list[Advice]:
    """Advice per server (at least one each: "fine" when nothing else applies), in server order."""
    info = infos if isinstance(infos, Mapping) else {i.url: i for i in infos}
    out = []
    for load in summarize(samples, info):
        sent = client_in_flight.get(load.server) if isinstance(client_in_flight, Mapping) else client_in_flight
        slots = info[load.server].mamba_slots_per_request if load.server in info else MAMBA_SLOTS_PER_REQUEST
        out += _server_rules(load, thresholds, sent, slots)
    return out


# ---- for people ------------------------------------------------------------------------------------------


def _figures(load: ServerLoad) -> list[str]:
    running = f"{load.running_mean:.1f} / {load.running_max} of {load.max_running or '-'}"
    return [
        load.server,
        str(load.samples),
        running,
        _pct(load.pinned_share),
        f"{load.waiting_mean:.1f} / {load.waiting_max}",
        _pct(load.token_usage_p95),
        "-" if load.throughput_mean is None else f"{load.throughput_mean:,.0f}",
        load.occupancy_line,
        load.waiting_line,
    ]


FIGURE_COLUMNS = (
    "server",
    "samples",
    "running (mean / max of limit)",
    "pinned",
    "waiting (mean / max)",
    "KV P95",
    "tok/s",
    "slots over time",
    "queue over time",
)


def tuning_table(loads: Sequence[ServerLoad], advice: Sequence[Advice]) -> Table:
    table = Table(title="Fleet tuning", title_justify="left")
    for col in (*FIGURE_COLUMNS, "advice"):
        table.add_column(
            col, justify="left" if col in ("server", "advice") or "time" in col else "right", overflow="fold"
        )
    for load in loads:
        rules = ", ".join(a.rule for a in advice if a.server == load.server)
        table.add_row(*_figures(load), rules)
    return table


def tuning_markdown(loads: Sequence[ServerLoad], advice: Sequence[Advice]) -> str:
    lines = ["| " + " | ".join(FIGURE_COLUMNS) + " |", "|---|" + "---:|" * 6 + "---|---|"]
    lines += ["| " + " | ".join(_figures(load)) + " |" for load in loads]
    lines += [""] + [f"- **{a.server}** `{a.rule}`: {a.message}" for a in advice]
    return "\n".join(lines)
