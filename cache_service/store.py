"""FeatureStore: what FeatureCache and its single-flight ask of the cluster-wide tier (L2).

A store holds encoded values by key, each with a TTL, and the single-flight locks. It never
raises because of its backend: the cache is an optimisation, so a failure is a miss. Every
batch method returns None when the store could not be asked at all (down, closed), else one
answer per key, the "miss" answer for keys it could not reach (e.g. of a cluster master
that is down). It counts its own trouble in the CacheStats it is given: `l2_errors`,
`degraded`, `degraded_transitions`, `reconnects`.

A new backend is a module here that implements this protocol, and a branch in
store_factory.py, the one place that picks (and knows) the backend.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Protocol

Buffer = bytes | bytearray | memoryview | mmap.mmap


class FeatureStore(Protocol):
    @property
    def available(self) -> bool:
        """False while the store as a whole cannot be asked: callers skip it (no waiting)."""

    async def ping(self) -> bool:
        """True when the whole store answers now (the health check)."""

    async def close(self) -> None: ...

    # -- values ---------------------------------------------------------------

    async def get_many(self, keys: Sequence[str]) -> list[Buffer | None] | None: ...

    async def set_many(self, items: Sequence[tuple[str, Buffer]], ttl_ms: int) -> list[bool] | None:
        """Per item: True where the value is now stored."""

    async def exists_many(self, keys: Sequence[str]) -> list[bool] | None: ...

    async def delete_many(self, keys: Sequence[str]) -> None: ...

    async def expire_many(self, keys: Sequence[str], ttl_ms: int) -> None:
        """Reset the TTL of the keys that exist (absent keys stay absent)."""

    # -- single-flight locks, one per key, held by a token ---------------------

    async def claim_many(self, keys: Sequence[str], token: str, ttl_ms: int) -> list[tuple[bool, bool]] | None:
        """Lock each key for `token` unless another token holds it; per key (`token` holds the
        lock, the value is present), the presence read after the lock was taken. A key the
        store cannot reach counts as held and absent: it is computed here, as without a store."""

    async def release_many(self, keys: Sequence[str], token: str) -> None:
        """Drop the locks `token` still holds; a lock that expired and was taken since stays."""

    async def poll_many(self, keys: Sequence[str]) -> list[tuple[bool, bool]] | None:
        """Per key (value present, lock present), without transferring values."""
