"""FeatureCache: L1 in process + L2, the cluster-wide FeatureStore (store.py; Redis), with
single-flight computation.

Reads go L1 first, then one batched L2 read for the L1 misses; L2 hits are
promoted into L1. Writes go to both. `get_or_compute_many` adds single-flight:
when several callers miss on the same key at once, in this process or on any
replica, the features are computed once:

- in process, the first caller owns one future per key and later callers
  await it;
- across replicas, the owner takes a lock per key in L2 (expiring after
  `lock_ttl_s` in case the replica dies); a caller that finds the lock
  taken polls L2 until the value appears, and computes itself when
  `single_flight_wait_s` runs out (counted) or when the lock disappears
  without a value (the holder failed; the waiter takes the lock over);
- a caller that computes in turns (`admit`, the encoder's fair gate) takes
  its locks once its turn has come, so a lock stands for a computation that
  is running, not for a place in a queue that may outlast the wait.

A failed or cancelled computation makes the callers that joined it compute
for themselves, so each request only ever sees its own compute's errors.

With `write_behind=True` a computed value is returned as soon as it is in L1;
its L2 write and the lock release follow in a background task (in that
order, so a waiting replica still sees the value before the lock goes). The
serving path uses it: the request that computed the features gets them
directly and should not wait on a multi-megabyte SET.

Sliding TTL: a value read (from L2, or from L1 where it is known to be in L2) gets its TTL
in L2 reset to `ttl_s`, at most once per `ttl_refresh_s` per key in this process, in the
background (one PEXPIRE per key, batched), so a uuid in use does not expire after `ttl_s`
however often it is sent, and a hit costs no extra round trip.

Never raises because of L2 or because of what it holds: a value that fails to decode or to
pass the check, for whatever reason, is counted (`corrupt` / `rejected`), deleted and a miss.
When L2 is unreachable the cache serves L1 only
(see store.py, redis_tier.py). Everything runs in one asyncio event loop;
nothing here is thread-safe. Returned Features are shared with the cache: treat
them as read-only (see codec.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from cache_service.codec import decode, encode
from cache_service.config import CacheConfig
from cache_service.features import Features
from cache_service.l1 import L1Cache
from cache_service.single_flight import Compute, ComputeResult, SingleFlight
from cache_service.stats import CacheStats
from cache_service.store_factory import make_store
from cache_service.validation import ValueCheck

logger = logging.getLogger(__name__)


class FeatureCache:
    def __init__(self, config: CacheConfig | None = None, check: ValueCheck | None = None):
        """`check`: what values read from L2 must satisfy beyond the checksum
        (model fingerprint, the family's shapes); None accepts any decodable value."""
        self.config = config or CacheConfig()
        self._check = check
        self.counters = CacheStats()
        self._l1 = L1Cache(self.config.l1_max_bytes)
        self.l2 = make_store(self.config, self.counters)
        self._ttl_ms = max(1, round(self.config.ttl_s * 1000))
        self._single_flight = SingleFlight(self, self.l2, self.config, self.counters)
        self._refreshed: dict[str, float] = {}  # key -> when its TTL was last reset (monotonic)
        self._refreshes: set[asyncio.Task] = set()

    @property
    def redis_available(self) -> bool:
        return self.l2 is not None and self.l2.available

    async def ping(self) -> bool:
        """True when L2 answers now, every master of a Redis Cluster (see RedisTier.ping)."""
        return self.l2 is not None and await self.l2.ping()

    def stats(self) -> dict[str, int | float]:
        self.counters.l1_evictions = self._l1.evictions
        snapshot = self.counters.snapshot()
        snapshot["l1_bytes"] = self._l1.nbytes
        snapshot["l1_entries"] = len(self._l1)
        return snapshot

    async def close(self, timeout_s: float | None = None) -> None:
        """Finish the background work (write-behinds and their lock releases, TTL refreshes), then close L2.
        `timeout_s` bounds the wait (a replica shutting down): what is left then is cancelled, logged and
        counted in `writes_dropped`; the locks it held expire after `lock_ttl_s`."""
        background = [*self._refreshes, *self._single_flight.background]
        if background:
            _, late = await asyncio.wait(background, timeout=timeout_s)
            if late:
                self.counters.writes_dropped += len(late)
                logger.warning(
                    "closing the feature cache: %d background writes unfinished after %.1f s, dropped",
                    len(late),
                    timeout_s,
                )
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
        if self.l2 is not None:
            await self.l2.close()

    # -- reads and writes -----------------------------------------------------

    async def get_many(self, keys: list[str]) -> list[Features | None]:
        return [None if hit is None else hit[0] for hit in await self._lookup(keys)]

    async def contains_many(self, keys: list[str]) -> list[bool]:
        present = [key in self._l1 for key in keys]
        missing = [i for i, p in enumerate(present) if not p]
        if missing and self.redis_available:
            in_l2 = await self.l2.exists_many([keys[i] for i in missing])
            for i, exists in zip(missing, in_l2 or []):
                present[i] = exists
        self._refresh_ttl([k for k, p in zip(keys, present) if p])
        return present

    def remember(self, key: str, features: Features) -> None:
        """Keep features in L1 only: they were handed over directly and whoever
        computed them writes L2."""
        self._l1.put(key, features.cpu(), in_l2=False)

    def forget(self, key: str) -> bool:
        """Drop `key` from L1 (L2 is untouched); whether L1 held it."""
        held = key in self._l1
        self._l1.discard(key)
        return held

    async def put_many(self, items: list[tuple[str, Features]]) -> list[bool]:
        """Store in L1 and L2; True where the value is now in L2."""
        stored = [False] * len(items)
        writes: list[tuple[int, str, bytearray, Features]] = []
        for i, (key, features) in enumerate(items):
            features = features.cpu()  # L1 holds host memory, never device memory
            self.counters.puts += 1
            # L1 first, so concurrent readers hit while the L2 write is in flight.
            self._l1.put(key, features, in_l2=False)
            if not self.redis_available:
                continue  # no encoding work while degraded
            try:
                value = encode(features)
            except Exception:
                self.counters.encode_errors += 1
                logger.exception("cannot serialise features for %s; kept in process memory only", key)
                continue
            if len(value) > self.config.max_value_bytes:
                self.counters.oversize += 1
                continue
            writes.append((i, key, value, features))
        if writes:
            ok = await self.l2.set_many([(key, value) for _, key, value, _ in writes], self._ttl_ms)
            for (i, key, value, features), written in zip(writes, ok or [False] * len(writes)):
                if written:
                    stored[i] = True
                    self._refreshed[key] = time.monotonic()  # the write set its TTL
                    self.counters.l2_bytes_written += len(value)
                    entry = self._l1.get(key)
                    if entry is not None and entry.features is features:
                        entry.in_l2 = True
        return stored

    async def _lookup(self, keys: list[str]) -> list[tuple[Features, bool] | None]:
        """Per key (features, known to be in L2) or None; L1, then one batched L2 read."""
        found: list[tuple[Features, bool] | None] = [None] * len(keys)
        missing: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            entry = self._l1.get(key)
            if entry is not None:
                self.counters.l1_hits += 1
                found[i] = (entry.features, entry.in_l2)
                if entry.in_l2:
                    self._refresh_ttl([key])
            else:
                self.counters.l1_misses += 1
                missing.setdefault(key, []).append(i)
        if not missing:
            return found
        values = await self.read_l2(list(missing)) if self.redis_available else None
        if values is None:
            if self.l2 is not None:
                self.counters.l2_skipped += len(missing)
            return found
        for indexes, features in zip(missing.values(), values):
            if features is None:
                self.counters.l2_misses += 1
                continue
            for i in indexes:
                found[i] = (features, True)
        return found

    async def read_l2(self, keys: list[str]) -> list[Features | None] | None:
        """Values of `keys` in L2, checked and promoted into L1 (hits counted); None per
        key absent or refused (a corrupt or foreign value is deleted); None when L2 is not there."""
        values = await self.l2.get_many(keys)
        if values is None:
            return None
        corrupt: list[str] = []
        found = [self._accept_l2_value(key, value, corrupt) for key, value in zip(keys, values)]
        self.counters.l2_hits += sum(f is not None for f in found)
        self._refresh_ttl([key for key, f in zip(keys, found) if f is not None])
        if corrupt:
            await self.l2.delete_many(corrupt)
        return found

    def _accept_l2_value(self, key: str, value: bytes | None, corrupt: list[str]) -> Features | None:
        """Decode a value read from L2 and promote it into L1; None if absent or refused (then
        listed in `corrupt`, to be deleted)."""
        if value is None:
            return None
        self.counters.l2_bytes_read += len(value)
        try:
            features = decode(value)
        except Exception as exc:  # CorruptValue, or a bug of the codec's: a miss either way
            self.counters.corrupt += 1
            corrupt.append(key)
            logger.warning("corrupt cache value at %s (%s); deleted, treated as a miss", key, str(exc)[:300])
            return None
        problem = self._check.problem(key, features) if self._check is not None else None
        if problem is not None:
            # Well-formed but wrong for this model: stale, misplaced or forged.
            self.counters.rejected += 1
            corrupt.append(key)
            logger.warning("rejected cache value at %s (%s); deleted, treated as a miss", key, problem)
            return None
        self._l1.put(key, features, in_l2=True)
        return features

    def _refresh_ttl(self, keys: list[str]) -> None:
        """Reset the L2 TTL of `keys` in the background, each at most once per ttl_refresh_s."""
        if not keys or not self.redis_available:
            return
        now = time.monotonic()
        due = [k for k in dict.fromkeys(keys) if now - self._refreshed.get(k, -1e18) >= self.config.ttl_refresh_s]
        if not due:
            return
        for key in due:
            self._refreshed[key] = now
        if len(self._refreshed) > 4 * max(1, len(self._l1)) + 10_000:  # forget refreshes too old to matter
            self._refreshed = {k: t for k, t in self._refreshed.items() if now - t < self.config.ttl_refresh_s}
        self.counters.ttl_refreshes += len(due)
        task = asyncio.get_running_loop().create_task(self.l2.expire_many(due, self._ttl_ms))
        self._refreshes.add(task)
        task.add_done_callback(self._refreshes.discard)

    # -- single-flight --------------------------------------------------------

    async def get_or_compute_many(
        self,
        keys: list[str],
        compute: Compute,
        write_behind: bool = False,
        admit: Callable[[], AbstractAsyncContextManager] | None = None,
    ) -> list[ComputeResult]:
        """Features for every key, computing the missing ones once cluster-wide.

        `compute(indexes)` gets indexes into `keys` (the first index of a key
        that appears more than once) and returns one Features per index. It is
        called at most twice: once for the keys this call locked, and again for
        keys whose wait on another caller timed out or whose computing caller
        failed. Its exceptions propagate to the caller. With `write_behind`,
        computed results have shared=False: their L2 write is still running
        (`ComputeResult.stored` says when it is done).

        `admit()`: the caller's turn to compute (the encoder's fair gate), entered after the lookup
        missed keys that no other call in this process is computing, and held until they are done.
        The keys' cluster-wide locks are taken inside it, so they cover the computation only, never
        the wait for a turn: another replica's caller then waits for a computation that is running.
        """
        results: list[ComputeResult | None] = [None] * len(keys)
        positions: dict[str, list[int]] = {}  # key -> its indexes in keys, for misses
        for i, hit in enumerate(await self._lookup(keys)):
            if hit is not None:
                results[i] = ComputeResult(hit[0], computed=False, shared=hit[1])
            else:
                positions.setdefault(keys[i], []).append(i)
        if not positions:
            return results  # type: ignore[return-value]
        if admit is None or all(key in self._single_flight.flights for key in positions):
            await self._single_flight.run(positions, results, compute, write_behind)
            return results  # type: ignore[return-value]
        async with admit():
            # Computed in this process while we waited for our turn? (Another replica's value shows
            # when the lock is claimed.)
            for key in list(positions):
                entry = self._l1.get(key)
                if entry is not None:
                    for i in positions.pop(key):
                        results[i] = ComputeResult(entry.features, computed=False, shared=entry.in_l2)
            if positions:
                await self._single_flight.run(positions, results, compute, write_behind)
        return results  # type: ignore[return-value]
