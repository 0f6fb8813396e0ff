"""The slot picker (generation/slots.py) on real servers: each server's slots are its effective max_running_requests
plus the waiting margin, filled least-loaded first; a server that fails `eject_after` times in a row is ejected and
re-admitted once its /health answers; with none healthy for `no_server_timeout_s`, FleetDown; a retry after a stall
goes elsewhere; a conversation's server is kept within the allowed imbalance."""

import asyncio
import re

from dflash_assets.fleet.fleet import connected
from dflash_assets.generation.slots import FleetDown, SlotPicker
from dflash_assets.settings import DispatchSettings
from tests.support.http import set_faults

SMALL, LARGE = ["--max-running-requests", "4"], ["--max-running-requests", "8"]
MARGIN = DispatchSettings().waiting_margin
PROBE_S = 0.05  # the picker's probe interval here: a re-admission is seen within a few probes


def on_picker(urls: list[str], body, **options):
    """`body(picker)` on a SlotPicker over the servers at `urls`, as the dispatcher builds it."""

    async def go():
        async with connected(urls) as fleet:
            picker = SlotPicker(fleet.clients, fleet.infos, DispatchSettings(**options), probe_interval_s=PROBE_S)
            try:
                return await body(picker)
            finally:
                await picker.close()

    return asyncio.run(go())


async def readmitted(picker: SlotPicker, url: str, probes: int = 600) -> bool:
    """Whether `url` is healthy again within `probes` probe intervals (30 s: a /health answer takes a second or more)."""
    for _ in range(probes):
        if any(s.url == url for s in picker.healthy()):
            return True
        await asyncio.sleep(PROBE_S)
    return False


def test_each_servers_slots_are_its_running_requests_plus_the_margin_filled_least_loaded_first(emulator):
    small, large = emulator(*SMALL), emulator(*LARGE)

    async def body(picker: SlotPicker):
        limits = {s.url: s.limit for s in picker.slots}
        taken = [(await picker.acquire()).url for _ in range(8)]
        first_eight = {u: taken.count(u) for u in limits}
        rest = [await picker.acquire() for _ in range(picker.capacity - 8)]
        waiting = asyncio.create_task(picker.acquire())
        done, _ = await asyncio.wait([waiting], timeout=0.5)  # every slot is taken: it cannot return yet
        freed = next(s for s in rest if s.url == large.base)
        picker.release(freed, ok=True)
        return limits, taken[:4], first_eight, bool(done), (await waiting).url

    limits, order, first_eight, returned_while_full, after_release = on_picker([small.base, large.base], body)
    assert limits == {small.base: 4 + MARGIN, large.base: 8 + MARGIN}
    # the least loaded by share of its slots: a tie goes to the first, then the larger server until its share leads
    assert order == [small.base, large.base, large.base, small.base]
    assert first_eight == {small.base: 3, large.base: 5}
    assert not returned_while_full and after_release == large.base


def test_a_failing_server_is_ejected_and_readmitted_once_its_health_answers(emulator):
    sick, well = emulator(*SMALL), emulator(*SMALL)

    async def body(picker: SlotPicker):
        set_faults(sick.base, {"unhealthy": True})
        for _ in range(2):
            slot = await picker.acquire()
            assert slot.url == sick.base  # the least loaded (a tie goes to the first)
            picker.release(slot, ok=False)
        ejected = [s.url for s in picker.slots if s.ejected_at is not None]
        meanwhile = [(await picker.acquire()).url for _ in range(4)]
        set_faults(sick.base, {"unhealthy": None})
        back = await readmitted(picker, sick.base)
        after = (await picker.acquire()).url
        return ejected, meanwhile, back, after, {s.url: s.ejections for s in picker.slots}

    ejected, meanwhile, back, after, ejections = on_picker([sick.base, well.base], body, eject_after=2)
    assert ejected == [sick.base]
    assert meanwhile == [well.base] * 4  # never the ejected one, however less loaded
    assert back and after == sick.base  # re-admitted, and then the least loaded again
    assert ejections == {sick.base: 1, well.base: 0}


def test_a_success_between_failures_keeps_a_server_in(emulator):
    server = emulator(*SMALL)

    async def body(picker: SlotPicker):
        for ok in (False, True, False, True, False):
            picker.release(await picker.acquire(), ok=ok)
        return [s.ejected_at for s in picker.slots], picker.slots[0].consecutive_failures

    ejected_at, failures = on_picker([server.base], body, eject_after=2)
    assert (ejected_at, failures) == ([None], 1)


def test_with_no_server_healthy_for_no_server_timeout_s_acquire_raises_fleet_down(emulator):
    server = emulator(*SMALL)

    async def body(picker: SlotPicker):
        set_faults(server.base, {"unhealthy": True})
        try:
            picker.release(await picker.acquire(), ok=False)
            try:
                await picker.acquire()
            except FleetDown as e:
                return str(e)
            return None
        finally:
            set_faults(server.base, {"unhealthy": None})

    said = on_picker([server.base], body, eject_after=1, no_server_timeout_s=0.5)
    assert said is not None and re.fullmatch(rf"no healthy server for \ds \(of 1: {re.escape(server.base)}\)", said)


def test_a_retry_after_a_stall_goes_to_another_server_unless_every_healthy_one_stalled(emulator):
    a, b = emulator(*SMALL), emulator(*SMALL)

    async def body(picker: SlotPicker):
        elsewhere = (await picker.acquire(avoid=frozenset({a.base}))).url  # a is the less loaded: still not a
        both = (await picker.acquire(avoid=frozenset({a.base, b.base}))).url  # none left to avoid: the least loaded
        return elsewhere, both

    assert on_picker([a.base, b.base], body) == (b.base, a.base)


def test_a_conversation_stays_on_its_server_within_the_allowed_imbalance(emulator):
    home, other = emulator(*LARGE), emulator(*LARGE)  # 10 slots each

    async def body(picker: SlotPicker):
        return [(await picker.acquire(prefer=home.base)).url for _ in range(5)]

    # home's share ahead of other's when asked: 0, 0.1, 0.2 (kept), 0.3 (over 0.25: other), 0.2 (kept)
    assert on_picker([home.base, other.base], body, same_server_max_imbalance=0.25) == [
        home.base,
        home.base,
        home.base,
        other.base,
        home.base,
    ]
