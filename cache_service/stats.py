"""CacheStats: the counters a FeatureCache keeps; deployments export them as metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CacheStats:
    # Lookups (get_many, and the lookup step of get_or_compute_many), per key.
    l1_hits: int = 0
    l1_misses: int = 0
    l2_hits: int = 0
    l2_misses: int = 0  # looked up in Redis and absent (or corrupt)
    l2_skipped: int = 0  # L1 missed but Redis was unavailable, so never asked
    puts: int = 0  # entries stored by put_many / computations
    l1_evictions: int = 0
    l2_bytes_written: int = 0
    l2_bytes_read: int = 0
    corrupt: int = 0  # values that failed decoding; deleted from Redis
    rejected: int = 0  # decodable values that failed the ValueCheck (fingerprint, shapes); deleted
    oversize: int = 0  # values above max_value_bytes, kept out of Redis
    encode_errors: int = 0  # features that could not be serialised (kept in L1 only)
    l2_errors: int = 0  # failed Redis commands of any kind
    degraded_transitions: int = 0  # times a shard (one Redis, or a cluster master) became unreachable
    reconnects: int = 0  # times one came back
    degraded: int = 0  # shards unreachable now (one Redis: 1 while it is down), else 0
    single_flight_local_waits: int = 0  # keys joined to a computation in this process
    single_flight_waits: int = 0  # keys waited for on another replica's lock
    single_flight_wait_timeouts: int = 0  # ... of which the wait ran out
    compute_calls: int = 0  # calls of the compute callback
    computations: int = 0  # keys computed by this process
    ttl_refreshes: int = 0  # keys whose L2 TTL a hit reset (sliding TTL, at most once a minute per key)
    writes_dropped: int = 0  # background writes still running when close(timeout_s) gave up; cancelled

    def snapshot(self) -> dict[str, int | float]:
        return asdict(self)
