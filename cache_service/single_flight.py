"""Single-flight for FeatureCache.get_or_compute_many: the keys one call missed are
computed once, in this process and across replicas (see feature_cache.py's docstring).

`SingleFlight` is one cache's state (the computations in flight in this process, background
writes and lock releases); a `Flight` is one call's. They use the cache through `Tiers`, and
the cluster-wide locks through the FeatureStore.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from cache_service.config import CacheConfig
from cache_service.features import Features
from cache_service.stats import CacheStats
from cache_service.store import FeatureStore

logger = logging.getLogger(__name__)

Compute = Callable[[list[int]], Awaitable[list[Features]]]


@dataclass
class ComputeResult:
    features: Features
    computed: bool  # computed by this call (not found in a tier, not computed by another caller)
    shared: bool  # present in L2, visible to other replicas
    # With write_behind, for a value computed by this call: resolves to whether its L2 write succeeded.
    stored: asyncio.Future[bool] | None = None


class Abandoned(Exception):
    """The caller computing a key failed or was cancelled; joiners compute themselves."""


class Tiers(Protocol):
    """The cache's value path, which a flight reads and writes through."""

    async def read_l2(self, keys: list[str]) -> list[Features | None] | None:
        """Checked values from the store, promoted into L1; None when the store is not there."""

    async def put_many(self, items: list[tuple[str, Features]]) -> list[bool]:
        """Store in L1 and the store; True where the value is now in the store."""

    def remember(self, key: str, features: Features) -> None:
        """Keep in L1 only."""


class SingleFlight:
    def __init__(self, tiers: Tiers, store: FeatureStore | None, config: CacheConfig, stats: CacheStats):
        self.tiers = tiers
        self.store = store
        self.stats = stats
        self.lock_ttl_ms = max(1, round(config.lock_ttl_s * 1000))
        self.wait_s, self.poll_s = config.single_flight_wait_s, config.single_flight_poll_s
        # key -> future of (Features, shared) for keys being computed by a call in this process.
        self.flights: dict[str, asyncio.Future[tuple[Features, bool]]] = {}
        # Write-behinds, and lock releases left running after a failed or cancelled call (strong refs).
        self._background: set[asyncio.Task] = set()

    @property
    def store_available(self) -> bool:
        return self.store is not None and self.store.available

    async def run(
        self, positions: dict[str, list[int]], results: list[ComputeResult | None], compute: Compute, write_behind: bool
    ) -> None:
        """Fill `results` at the `positions` of each missed key (see get_or_compute_many)."""
        flight = Flight(self, positions, results, compute, write_behind)
        try:
            await flight.run()
        finally:
            flight.finish()

    def in_background(self, work: Awaitable) -> None:
        """Run `work` in the background, strongly referenced until done (FeatureCache.close awaits it)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def background(self) -> set[asyncio.Task]:
        """Write-behinds and lock releases still running."""
        return self._background


class Flight:
    """The single-flight state of one get_or_compute_many call over its missed keys."""

    def __init__(
        self,
        single_flight: SingleFlight,
        positions: dict[str, list[int]],
        results: list[ComputeResult | None],
        compute: Compute,
        write_behind: bool = False,
    ):
        self.single_flight = single_flight
        self.tiers = single_flight.tiers
        self.store = single_flight.store
        self.stats = single_flight.stats
        self.write_behind = write_behind
        self.positions = positions
        self.results = results
        self.compute = compute
        self.token = uuid.uuid4().hex  # identifies our locks in the store
        self.owned: dict[str, asyncio.Future[tuple[Features, bool]]] = {}
        self.joined: dict[str, asyncio.Future[tuple[Features, bool]]] = {}
        self.locked: set[str] = set()  # keys whose lock we hold

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for key in self.positions:
            future = self.single_flight.flights.get(key)
            if future is not None:
                self.joined[key] = future
                self.stats.single_flight_local_waits += 1
            else:
                future = loop.create_future()
                self.single_flight.flights[key] = future
                self.owned[key] = future

        compute_now, wait_for = await self._claim(list(self.owned))
        tasks = []
        if compute_now:
            tasks.append(asyncio.ensure_future(self._compute(compute_now)))
        if wait_for:
            tasks.append(asyncio.ensure_future(self._wait_for_other_replicas(wait_for)))
        if self.joined:
            tasks.append(asyncio.ensure_future(self._join_local()))
        try:
            outcomes = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()  # no-op for finished tasks; stops the rest after an error
        # The second (and last) compute: waits that timed out, locks taken over
        # from a failed holder, and joins whose owner failed.
        again = [key for outcome in outcomes if outcome for key in outcome]
        if again:
            await self._compute(again)

    def finish(self) -> None:
        """Settle every future we own and release our locks, whatever happened."""
        for key, future in self.owned.items():
            if self.single_flight.flights.get(key) is future:
                del self.single_flight.flights[key]
            if not future.done():
                future.set_exception(Abandoned())
                future.exception()  # mark retrieved: nobody may be waiting on it
        if self.locked and self.store is not None:
            # Only after an error or a cancellation; released in the background
            # so a cancelled caller returns at once. The lock TTL is the backstop.
            self.single_flight.in_background(self.store.release_many(list(self.locked), self.token))
            self.locked.clear()

    def _resolve(
        self,
        key: str,
        features: Features,
        computed: bool,
        shared: bool,
        for_joiners: Features | None = None,
        stored: asyncio.Future[bool] | None = None,
    ) -> None:
        for i in self.positions[key]:
            self.results[i] = ComputeResult(features, computed=computed, shared=shared, stored=stored)
        future = self.owned.get(key)
        if future is not None and not future.done():
            future.set_result((features if for_joiners is None else for_joiners, shared))

    async def _claim(self, keys: list[str]) -> tuple[list[str], list[str]]:
        """Lock keys in the store; returns (keys to compute now, keys another replica computes)."""
        if not keys:
            return [], []
        available = self.single_flight.store_available
        claims = await self.store.claim_many(keys, self.token, self.single_flight.lock_ttl_ms) if available else None
        if claims is None:
            return keys, []  # no store: nothing to coordinate with, compute here
        held = {key for key, (is_holder, _) in zip(keys, claims) if is_holder}
        self.locked |= held
        # Values that another replica finished between our miss and the claim.
        done = await self._take_values([key for key, (_, exists) in zip(keys, claims) if exists])
        await self._release([k for k in done if k in held])
        compute_now = [k for k in keys if k in held and k not in done]
        wait_for = [k for k in keys if k not in held and k not in done]
        return compute_now, wait_for

    async def _take_values(self, keys: list[str]) -> set[str]:
        """Read keys' values from the store and resolve those found; returns the keys resolved."""
        if not keys:
            return set()
        values = await self.tiers.read_l2(keys)
        resolved = set()
        for key, features in zip(keys, values or [None] * len(keys)):
            if features is not None:
                self._resolve(key, features, computed=False, shared=True)
                resolved.add(key)
        return resolved

    async def _release(self, keys: list[str]) -> None:
        if keys:
            self.locked.difference_update(keys)
            await self.store.release_many(keys, self.token)

    async def _compute(self, keys: list[str]) -> None:
        indexes = [self.positions[key][0] for key in keys]
        self.stats.compute_calls += 1
        features = await self.compute(indexes)
        if not isinstance(features, list) or len(features) != len(indexes):
            raise ValueError(
                f"compute returned {type(features).__name__} for {len(indexes)} indexes; need a list of that length"
            )
        if not all(isinstance(f, Features) for f in features):
            raise TypeError("compute must return Features")
        self.stats.computations += len(keys)
        # The caller gets back what its compute returned (on its device); the
        # cache and other callers in this process get host copies.
        on_host = [f.cpu() for f in features]
        if self.write_behind:
            for key, host in zip(keys, on_host):
                self.tiers.remember(key, host)  # local readers hit at once
            locked = [k for k in keys if k in self.locked]
            self.locked.difference_update(locked)  # the background task releases them
            loop = asyncio.get_running_loop()
            stored = [loop.create_future() for _ in keys]
            self.single_flight.in_background(self._store_then_release(list(zip(keys, on_host)), locked, stored))
            for key, f, host, written in zip(keys, features, on_host, stored):
                self._resolve(key, f, computed=True, shared=False, for_joiners=host, stored=written)
            return
        # Write the values before releasing the locks: a waiter that sees the
        # lock gone without a value takes over and computes again.
        shared = await self.tiers.put_many(list(zip(keys, on_host)))
        for key, f, host, in_l2 in zip(keys, features, on_host, shared):
            self._resolve(key, f, computed=True, shared=in_l2, for_joiners=host)
        await self._release([k for k in keys if k in self.locked])

    async def _store_then_release(
        self, items: list[tuple[str, Features]], locked: list[str], stored: list[asyncio.Future[bool]]
    ) -> None:
        written, cancelled = [False] * len(items), False
        try:
            written = await self.tiers.put_many(items)
        except asyncio.CancelledError:
            cancelled = True  # the cache is closing: no more Redis calls; the locks expire after lock_ttl_s
            raise
        finally:
            for future, ok in zip(stored, written):
                if not future.done():
                    future.set_result(ok)
            if locked and not cancelled:
                await self.store.release_many(locked, self.token)

    async def _wait_for_other_replicas(self, keys: list[str]) -> list[str]:
        """Poll until another replica's values appear; returns keys to compute ourselves."""
        self.stats.single_flight_waits += len(keys)
        deadline = asyncio.get_running_loop().time() + self.single_flight.wait_s
        pending = list(keys)
        ours: list[str] = []
        while pending:
            await asyncio.sleep(self.single_flight.poll_s)
            states = await self.store.poll_many(pending) if self.single_flight.store_available else None
            if states is None:
                return ours + pending  # store gone: nobody can hand us the value
            ready = [k for k, (has_value, _) in zip(pending, states) if has_value]
            orphaned = [k for k, (has_value, has_lock) in zip(pending, states) if not has_value and not has_lock]
            if ready:
                resolved = await self._take_values(ready)
                orphaned += [k for k in ready if k not in resolved]  # evicted or corrupt since the poll
            if orphaned:
                # The holder failed (released or lock expired) without a value: take over.
                compute_now, _ = await self._claim(orphaned)
                ours.extend(compute_now)
            pending = [k for k in pending if self.results[self.positions[k][0]] is None and k not in ours]
            if pending and asyncio.get_running_loop().time() >= deadline:
                self.stats.single_flight_wait_timeouts += len(pending)
                logger.info("gave up waiting for %d keys computed elsewhere; computing here", len(pending))
                return ours + pending
        return ours

    async def _join_local(self) -> list[str]:
        """Await computations of other calls in this process; returns keys whose owner failed."""
        failed = []
        for key, future in self.joined.items():
            try:
                features, shared = await asyncio.shield(future)
            except Abandoned:
                failed.append(key)
                continue
            self._resolve(key, features, computed=False, shared=shared)
        return failed
