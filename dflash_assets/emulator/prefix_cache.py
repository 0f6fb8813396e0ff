"""SGLang's radix (prefix) cache, as far as what it saves: the prompt tokens a request finds already cached.

A finished request leaves its prompt and output in the cache (SGLang's `cache_finished_req`); a new request's
longest cached prefix is not prefilled again and is reported as `cached_tokens` (meta_info, and the OpenAI
usage's `prompt_tokens_details` with --enable-cache-report). Token-level, like SGLang's default page size of 1.
A prefix is kept as a chain of per-token keys; the oldest are evicted first when the cache holds more than
`capacity` tokens (SGLang evicts LRU leaves; the difference only matters under memory pressure). Off with
--disable-radix-cache.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def match(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` are cached (at most all but the last: SGLang always prefills one)."""
        key, n = 0, 0
        for token in ids[: len(ids) - 1]:
            key = hash((key, token))
            if key not in self._keys:
                break
            n += 1
        return n

    def insert(self, ids: list[int]) -> None:
        key = 0
        for token in ids:
            key = hash((key, token))
            self._keys[key] = None
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
