"""fleet.run: the heap that was there before a run talks to its fleet is frozen while it does, and not after."""

import gc

from dflash_assets.fleet.fleet import run


def test_a_fleet_run_freezes_the_heap_before_it_then_unfreezes_it():
    before = gc.get_freeze_count()
    held = [[] for _ in range(100)]  # containers the collector tracks, in the heap before the run: frozen in it

    async def inside() -> int:
        return gc.get_freeze_count()

    assert run(inside()) >= before + len(held)
    assert gc.get_freeze_count() == 0 if before == 0 else gc.get_freeze_count() >= before
