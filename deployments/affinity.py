"""Which decode replica should serve an image: rendezvous hashing with a load bound.

No Ray here; `deployments/image_affinity_router.py` feeds it Serve's replica ids
and queue lengths.

- Every caller ranks replicas by the same hash of (image key, replica id), so all
  ingress processes agree without sharing state, and adding or removing a replica
  moves only the keys it wins or held (about 1/N of them).
- The preferred replica is skipped when it is saturated (at max_ongoing_requests)
  or would carry more than `max_load_factor` times the mean in-flight load; the
  request then goes to the least-loaded replica (ties broken by the same hash
  order, so spill-over is still deterministic when loads are equal).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash


@dataclass(frozen=True)
class ReplicaLoad:
    replica_id: str
    in_flight: int  # requests this caller believes the replica is running
    max_ongoing: int  # the replica rejects requests beyond this


def affinity_key(media_keys: Sequence[str] | None) -> str | None:
    """The first image's (or video's) key: prefix caching reuses a prompt up to its first
    difference, so requests (and later turns of a chat) that open with the same
    image share the most KV blocks on one replica."""
    for key in media_keys or ():
        if key:
            return key
    return None


def _weight(key: str, replica_id: str) -> int:
    # xxh64 rather than hash(): stable across processes and Python hash seeds.
    return xxhash.xxh64_intdigest(f"{key}\x00{replica_id}".encode())


def rendezvous_order(key: str, replica_ids: Iterable[str]) -> list[str]:
    """Replica ids, most preferred first, for this key (highest random weight)."""
    return sorted(replica_ids, key=lambda rid: (_weight(key, rid), rid), reverse=True)


def load_cap(total_in_flight: int, num_replicas: int, max_load_factor: float) -> int:
    """Most requests one replica may hold after taking one more request.

    ceil(factor * mean) with the new request counted, so an idle cluster always
    accepts; for factor >= 1 the least-loaded replica is always within it."""
    return math.ceil(max_load_factor * (total_in_flight + 1) / num_replicas)


def rank_for_key(key: str, loads: Sequence[ReplicaLoad], max_load_factor: float) -> list[list[str]]:
    """Ranks of replica ids for a request keyed by `key`.

    [[preferred], [everyone else, least loaded first]] when the preferred replica
    has room; otherwise [[least loaded], [the rest]]. Serve tries the ranks in
    order and within a rank takes the replica with the shortest queue.
    """
    if not loads:
        return []
    by_id = {load.replica_id: load for load in loads}
    order = rendezvous_order(key, by_id)
    cap = load_cap(sum(load.in_flight for load in loads), len(loads), max_load_factor)
    preferred = by_id[order[0]]
    hash_rank = {rid: i for i, rid in enumerate(order)}
    by_load = sorted(order, key=lambda rid: (by_id[rid].in_flight, hash_rank[rid]))
    if preferred.in_flight < preferred.max_ongoing and preferred.in_flight + 1 <= cap:
        first = preferred.replica_id
    else:
        first = by_load[0]
    rest = [rid for rid in by_load if rid != first]
    return [[first], rest] if rest else [[first]]


def two_choices(replica_ids: Sequence[str], rng: random.Random | None = None) -> list[str]:
    """Serve's default for requests without images: two random replicas; the
    router then takes the one with the shorter queue."""
    rng = rng or random
    if len(replica_ids) <= 2:
        return rng.sample(list(replica_ids), len(replica_ids))
    return rng.sample(list(replica_ids), 2)
