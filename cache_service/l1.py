"""L1: the per-process tier, an LRU of decoded Features bounded in bytes.

Not thread-safe: a FeatureCache lives in one asyncio event loop, and nothing
here awaits, so no two calls interleave.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from cache_service.features import Features


@dataclass
class L1Entry:
    features: Features
    nbytes: int
    # True when the value is known to be in Redis (written or read there).
    # It may have expired since; this only feeds ComputeResult.shared.
    in_l2: bool


class L1Cache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evictions = 0
        self._entries: OrderedDict[str, L1Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> L1Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, features: Features, in_l2: bool) -> bool:
        """Store (replacing any entry under key); False when larger than the whole tier."""
        nbytes = features.nbytes
        self.discard(key)
        if nbytes > self.max_bytes:
            return False
        while self.nbytes + nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
            self.evictions += 1
        self._entries[key] = L1Entry(features, nbytes, in_l2)
        self.nbytes += nbytes
        return True

    def discard(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
