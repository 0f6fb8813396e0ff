"""The slot picker: which server the next request goes to. Least-loaded first, per-server slots, eject and
re-admit.

Each server gets as many requests in flight as it runs at once (its effective max_running_requests)
plus a small waiting margin, so its slots never idle between two requests; servers of different
capacity get proportional load. A server that fails repeatedly is ejected, probed with /health, and
re-admitted when it answers. When no server is healthy the run waits, says so once, and takes back the first
server that answers /health again (one relaunched at its port by a supervisor, systemd, Kubernetes or a person);
when none has been healthy for `no_server_timeout_s`, `acquire` raises FleetDown: the circuit breaker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dflash_assets.fleet.client import ServerClient, ServerInfo
from dflash_assets.settings import DispatchSettings

_DISPATCH = DispatchSettings()  # the defaults, from settings.py


class FleetDown(RuntimeError):
    """No server of the fleet has been healthy for longer than the configured time."""


@dataclass
class Slot:
    client: ServerClient
    info: ServerInfo
    limit: int
    in_flight: int = 0
    consecutive_failures: int = 0
    ejected_at: float | None = None
    completed: int = 0
    output_tokens: int = 0
    busy_since: float | None = None
    stats: dict = field(default_factory=lambda: {"ok": 0, "retried": 0})
    stalls: int = 0  # streams closed for silence (a stall counts as a failure: a server whose streams all stall
    ejections: int = 0  # is ejected like one whose requests all fail)
    membership: list[dict] = field(default_factory=list)  # a gateway's workers joining or leaving (fleet/membership.py)

    @property
    def url(self) -> str:
        return self.info.url


class SlotPicker:
    def __init__(
        self,
        clients: list[ServerClient],
        infos: list[ServerInfo],
        dispatch: DispatchSettings = _DISPATCH,
        *,
        probe_interval_s: float = 2.0,
        log: Callable[[str], None] = lambda _: None,
        on_back: Callable[[str, float], None] = lambda url, since: None,  # (url, when the /health that said so began)
    ):
        self.dispatch, self.probe_interval_s, self.log, self.on_back = dispatch, probe_interval_s, log, on_back
        self.slots = [Slot(c, i, self.limit_of(i)) for c, i in zip(clients, infos)]
        self._changed = asyncio.Event()
        self._probes: dict[str, asyncio.Task] = {}
        self._all_down_since: float | None = None

    def limit_of(self, info: ServerInfo) -> int:
        """Requests in flight at one URL: a gateway URL stands for info.servers servers, each with its slots and
        its waiting margin."""
        return self.dispatch.max_in_flight_per_server * info.servers or (
            info.max_running_requests + self.dispatch.waiting_margin * info.servers
        )

    def resize(self, slot: Slot, info: ServerInfo) -> None:
        """The servers behind `slot`'s URL changed (a gateway's membership): its facts and limit are `info`'s."""
        slot.info, slot.limit = info, self.limit_of(info)
        self._changed.set()

    @property
    def capacity(self) -> int:
        return sum(s.limit for s in self.slots)

    def healthy(self) -> list[Slot]:
        return [s for s in self.slots if s.ejected_at is None]

    def _pick(self, prefer: str | None = None, avoid: frozenset[str] = frozenset()) -> Slot | None:
        free = [s for s in self.healthy() if s.in_flight < s.limit]
        if avoid and any(s.url not in avoid for s in self.healthy()):
            # a retry after a stall goes to another server, waiting for a slot there if need be; only when every
            # healthy server is one it stalled on does it go back to one of them
            free = [s for s in free if s.url not in avoid]
        if not free:
            return None
        best = min(free, key=lambda s: (s.in_flight / s.limit, s.in_flight))
        if prefer is not None and prefer != best.url:
            mine = next((s for s in free if s.url == prefer), None)
            # the server that served a conversation's previous turn holds its history in its prefix cache: keep
            # the conversation there unless that server is clearly busier than the least loaded one
            bound = self.dispatch.same_server_max_imbalance
            if mine is not None and mine.in_flight / mine.limit - best.in_flight / best.limit <= bound:
                return mine
        return best

    async def acquire(self, prefer: str | None = None, avoid: frozenset[str] = frozenset()) -> Slot:
        """A slot on the least-loaded healthy server (not one in `avoid` while another is healthy), or on `prefer`
        within the allowed imbalance."""
        # Single-threaded asyncio: picking a slot and taking it happen with no await in between, so no lock;
        # waiters sleep on an Event that every release and re-admission sets, then look again.
        while (slot := self._pick(prefer, avoid)) is None:
            timeout, patience = 1.0, self.dispatch.no_server_timeout_s
            if not self.healthy():
                urls = ", ".join(s.url for s in self.slots)
                if self._all_down_since is None:
                    self._all_down_since = time.monotonic()
                    self.log(
                        f"no healthy server ({urls} down): the run waits up to {patience:.0f}s for one to answer "
                        "/health again (a server relaunched at its URL is taken back)"
                    )
                waited = time.monotonic() - self._all_down_since
                if waited >= patience:
                    raise FleetDown(f"no healthy server for {waited:.0f}s (of {len(self.slots)}: {urls})")
                timeout = min(timeout, patience - waited)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                pass
        self._all_down_since = None
        slot.in_flight += 1
        return slot

    def release(self, slot: Slot, *, ok: bool) -> None:
        slot.in_flight -= 1
        if ok:
            slot.consecutive_failures = 0
        else:
            slot.consecutive_failures += 1
            if slot.ejected_at is None and slot.consecutive_failures >= self.dispatch.eject_after:
                slot.ejected_at = time.monotonic()
                slot.ejections += 1
                self._probes[slot.url] = asyncio.create_task(self._probe_until_back(slot))
        self._changed.set()

    async def _probe_until_back(self, slot: Slot) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            began = time.monotonic()
            if await slot.client.healthy():  # the client's timeout: /health takes a second or more
                slot.ejected_at = None
                slot.consecutive_failures = 0
                self.on_back(slot.url, began)
                if self._all_down_since is not None:
                    self.log(f"{slot.url} answers /health again: the run goes on there")
                self._changed.set()
                return

    async def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
