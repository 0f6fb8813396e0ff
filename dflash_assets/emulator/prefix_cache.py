"""SGLang's radix (prefix) cache, as far as what it saves: the prompt tokens a request finds already cached.

A finished request leaves prompt and output cached (`cache_finished_req`); a new request's longest cached prefix is
its `cached_tokens` (off with --disable-radix-cache), matched in blocks of BLOCK tokens (SGLang: pages of 1), the
oldest evicted past `capacity` tokens (SGLang: LRU leaves).
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK = 16


class PrefixCache:
    def __init__(self, capacity: int):
        self.capacity_blocks = max(1, capacity // BLOCK)
        self._keys: OrderedDict[int, None] = OrderedDict()

    def match(self, ids: list[int]) -> int:
        """Leading tokens of `ids` in the cache, in whole blocks (never all: SGLang always prefills one)."""
        key, n = 0, 0
        for start in range(0, len(ids) - BLOCK, BLOCK):
            key = hash((key, tuple(ids[start : start + BLOCK])))
            if key not in self._keys:
                break
            n += BLOCK
        return n

    def insert(self, ids: list[int]) -> None:
        key = 0
        for start in range(0, len(ids) - BLOCK + 1, BLOCK):
            key = hash((key, tuple(ids[start : start + BLOCK])))
            self._keys[key] = None
        while len(self._keys) > self.capacity_blocks:
            self._keys.popitem(last=False)
