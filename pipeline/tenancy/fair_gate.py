"""FairGate: a stage's few slots of work, handed to waiting tenants in turn.

Preprocess and the VisionEncoder are where one tenant's flood of new images hurts
everyone: first come, first served, a tenant with eight large images queued puts
every other tenant's image behind all eight. With the gate, each tenant's waiting
items are granted in start-time fair order (start-time fair queueing, SFQ): an item
is tagged `max(virtual time, its tenant's last tag)` and then advances its tenant's
tag by `cost / weight`; the lowest tag goes next. A tenant arriving at an idle
moment starts at the current virtual time, so it neither banks credit while idle
nor waits behind another's backlog: it waits for at most the slots already taken
and one item per other busy tenant (by weight).

`fair=False` grants in arrival order (first come, first served), for comparison.
Plain asyncio, no Ray: one gate per replica.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


@dataclass(order=True)
class _Waiter:
    tag: float
    seq: int
    grant: asyncio.Future = field(compare=False)


class FairGate:
    def __init__(self, capacity: int, fair: bool = True, weights: Mapping[str, float] | None = None):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.fair = fair
        self.weights = dict(weights or {})
        self.held = 0
        self._queue: list[_Waiter] = []  # a heap by (tag, arrival)
        self._seq = itertools.count()
        self._virtual_time = 0.0  # the tag of the item granted last
        self._last_tag: dict[str, float] = {}  # tenant -> tag its next item starts from

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._queue if not w.grant.done())

    @asynccontextmanager
    async def slot(self, tenant: str, cost: float = 1.0) -> AsyncIterator[float]:
        """Hold one slot for the block; yields the seconds waited for it."""
        start = time.perf_counter()
        await self._acquire(tenant, cost)
        try:
            yield time.perf_counter() - start
        finally:
            self._release()

    async def _acquire(self, tenant: str, cost: float) -> None:
        seq = next(self._seq)
        if self.fair:
            tag = max(self._virtual_time, self._last_tag.get(tenant, 0.0))
            self._last_tag[tenant] = tag + max(cost, 1e-9) / self.weights.get(tenant, 1.0)
            self._forget_idle_tenants()
        else:
            tag = float(seq)
        waiter = _Waiter(tag, seq, asyncio.get_running_loop().create_future())
        heapq.heappush(self._queue, waiter)
        self._dispatch()
        try:
            await waiter.grant
        except asyncio.CancelledError:
            if waiter.grant.done() and not waiter.grant.cancelled():
                self._release()  # granted as we were cancelled: pass the slot on
            else:
                waiter.grant.cancel()  # skipped when it reaches the head
            raise

    def _release(self) -> None:
        self.held -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        while self._queue and self.held < self.capacity:
            waiter = heapq.heappop(self._queue)
            if waiter.grant.done():  # its caller left while waiting
                continue
            self.held += 1
            self._virtual_time = max(self._virtual_time, waiter.tag)
            waiter.grant.set_result(None)

    def _forget_idle_tenants(self) -> None:
        """Tags at or below the virtual time say nothing any more: drop them (memory stays
        bounded by the tenants with work queued)."""
        if len(self._last_tag) > 1024:
            self._last_tag = {t: tag for t, tag in self._last_tag.items() if tag > self._virtual_time}


class FairSharing(BaseModel):
    """How Preprocess and the VisionEncoder share their slots between tenants."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        True,
        description="Serve tenants in turn (by weight) in Preprocess and the VisionEncoder; false: first "
        "come, first served, where one tenant's burst of new images queues every other tenant behind it.",
    )
    tenant_weights: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="Share of a tenant (by its name: a configured key's tenant, the "
        "tenant header's value, or `key-...` for an unconfigured key's hash) relative to the others; unlisted "
        "tenants weigh 1.",
    )
    preprocess_slots: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = Field(
        "auto",
        description="Images or videos one Preprocess replica decodes at once; the rest wait their "
        "tenant's turn. auto: the replica's CPUs (ray_actor_options.num_cpus) rounded up: a decode keeps a core "
        "busy, so more at once than the replica has cores only slows the others down.",
    )
    encoder_slots: Annotated[int, Field(ge=1, le=4096)] | Literal["auto"] = Field(
        "auto",
        description="Images or videos one VisionEncoder replica has queued for or in its forward pass; "
        "the rest wait their tenant's turn. auto: twice the encoder batch size (one batch runs while the "
        "next fills).",
    )
