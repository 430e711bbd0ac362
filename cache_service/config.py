"""CacheConfig: every knob of the feature cache, validated once at start-up."""

from __future__ import annotations

import os
import re
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cache_service.keys import DEFAULT_NAMESPACE

GiB = 1 << 30
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
MiB = 1 << 20


class CacheConfig(BaseModel):
    # No input in errors, and no redis_url in repr: it may hold a password written in clear.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    redis_url: str | None = Field(
        "redis://127.0.0.1:6379/0",
        repr=False,
        description="Redis for the cluster-wide tier (redis://, rediss:// or unix://). "
        "None runs the cache on the in-process tier only. ${NAME} is replaced where Iris connects "
        "by that environment variable, URL-quoted (e.g. redis://:${IRIS_REDIS_PASSWORD}@host:6379/0).",
    )
    redis_cluster: bool = Field(
        False,
        description="redis_url names one node of a Redis Cluster: keys spread over its masters "
        "(redis-py's cluster client follows MOVED/ASK and failovers); a master that is down makes its keys "
        "misses while the others keep serving. The cluster must run with cluster-require-full-coverage no.",
    )
    namespace: str = Field(
        DEFAULT_NAMESPACE,
        pattern=r"^[A-Za-z0-9_.\-]{1,64}$",
        description="Key prefix; must equal the namespace the keys were built with.",
    )
    l1_max_bytes: int = Field(1 * GiB, ge=0, description="Bytes of features kept in process memory; 0 disables L1.")
    ttl_s: float = Field(
        86400.0,
        gt=0,
        description="Time to live of every entry written to Redis, in seconds; a hit resets it "
        "(sliding, see ttl_refresh_s), so a value in use does not expire.",
    )
    ttl_refresh_s: float = Field(
        60.0,
        gt=0,
        description="A hit resets its value's TTL in Redis at most once per this many seconds per "
        "key and process (one PEXPIRE in the background).",
    )
    max_value_bytes: int = Field(
        64 * MiB,
        gt=0,
        description="Encoded values larger than this are not written to Redis (counted as oversize); they stay in L1.",
    )
    redis_connect_timeout_s: float = Field(
        0.25, gt=0, description="Timeout of a TCP connect to Redis before the cache goes degraded."
    )
    redis_timeout_s: float = Field(
        0.25,
        gt=0,
        description="How long one reply may take (one value's, for GET/SET of values, which are "
        "pipelined per value) before the cache goes degraded.",
    )
    redis_pool_size: int = Field(
        16,
        ge=1,
        le=1024,
        description="Concurrent Redis commands per FeatureCache, and the size of its connection pool.",
    )
    lock_ttl_s: float = Field(
        30.0,
        gt=0,
        description="Expiry of the single-flight lock of a replica computing a key; should exceed "
        "the longest compute, else another replica starts computing the same key.",
    )
    single_flight_wait_s: float = Field(
        10.0,
        gt=0,
        description="How long a caller waits for another replica's computation before computing "
        "itself (counted as a wait timeout).",
    )
    single_flight_poll_s: float = Field(
        0.02, gt=0, description="Interval at which a waiting caller checks Redis for the result."
    )
    backoff_initial_s: float = Field(0.5, gt=0, description="First delay before reconnecting to an unreachable Redis.")
    backoff_max_s: float = Field(
        30.0, gt=0, description="Upper bound of the reconnect delay, which doubles per failure."
    )

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is not None and url.split("://", 1)[0] not in ("redis", "rediss", "unix"):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        return url

    def connect_url(self) -> str | None:
        """redis_url with each ${NAME} taken from this process's environment. Expanded at
        connect time, not at validation, so a password from a Kubernetes Secret is never
        stored in the (pickled, checkpointed) config or shown by `serve status`."""
        if self.redis_url is None:
            return None

        def value(match: re.Match) -> str:
            name = match.group(1)
            if name not in os.environ:
                raise ValueError(f"redis_url uses ${{{name}}} but {name} is not set in this process's environment")
            return quote(os.environ[name], safe="")

        return _ENV_REF.sub(value, self.redis_url)

    @model_validator(mode="after")
    def _check_bounds(self) -> CacheConfig:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        if self.redis_cluster and (self.redis_url is None or self.redis_url.startswith("unix://")):
            raise ValueError("redis_cluster needs a redis:// or rediss:// redis_url naming one node of the cluster")
        if self.single_flight_poll_s > self.single_flight_wait_s:
            raise ValueError("single_flight_poll_s must be <= single_flight_wait_s")
        return self
