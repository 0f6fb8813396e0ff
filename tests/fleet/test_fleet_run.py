"""fleet.run: the heap that was there before a run talks to its fleet is frozen while it does, and not after; young
collections come every YOUNG_COLLECTION_EVERY objects meanwhile."""

import gc

from dflash_assets.fleet.fleet import YOUNG_COLLECTION_EVERY, run


def test_a_fleet_run_freezes_the_heap_before_it_then_unfreezes_it():
    before = gc.get_freeze_count()
    held = [[] for _ in range(100)]  # containers the collector tracks, in the heap before the run: frozen in it

    async def inside() -> int:
        return gc.get_freeze_count()

    assert run(inside()) >= before + len(held)
    assert gc.get_freeze_count() == 0 if before == 0 else gc.get_freeze_count() >= before


def test_a_fleet_run_collects_young_objects_every_hundred_thousand_not_seven_hundred():
    """400,000 containers kept alive by a run: Python's default would collect (and promote them) ~570 times."""
    thresholds, young = gc.get_threshold(), []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 0:
            young.append(1)

    async def inside() -> int:
        assert gc.get_threshold()[0] == YOUNG_COLLECTION_EVERY
        before = len(young)
        kept = [[i] for i in range(400_000)]
        collections = len(young) - before
        del kept
        return collections

    gc.callbacks.append(count)
    try:
        collections = run(inside())
    finally:
        gc.callbacks.remove(count)
    assert collections <= 400_000 // YOUNG_COLLECTION_EVERY
    assert gc.get_threshold() == thresholds  # the rest of the process collects as it did
