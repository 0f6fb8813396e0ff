"""fleet.run: the collector tuned for many short requests while a run talks to its fleet, and put back after."""

import gc

from dflash_assets.fleet.fleet import YOUNG_COLLECTION_OBJECTS, run


def test_a_fleet_run_freezes_the_heap_before_it_and_spaces_young_collections_then_puts_both_back():
    before = gc.get_threshold(), gc.get_freeze_count()
    held = [object() for _ in range(100)]  # in the heap before the run: frozen while it runs

    async def inside() -> tuple[int, int]:
        return gc.get_threshold()[0], gc.get_freeze_count()

    young, frozen = run(inside())
    assert young == max(before[0][0], YOUNG_COLLECTION_OBJECTS) and frozen >= before[1] + len(held)
    assert gc.get_threshold() == before[0]
    assert gc.get_freeze_count() == 0 if before[1] == 0 else gc.get_freeze_count() >= before[1]
