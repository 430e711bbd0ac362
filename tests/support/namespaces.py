"""Cache namespaces in the shared Redis at 127.0.0.1:6379, which the tests never flush:
each test or app gets a namespace of its own and deletes its keys afterwards."""

from __future__ import annotations

import uuid

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"


def new_namespace(prefix: str = "iris-test") -> str:
    """A namespace no other test or run uses (a valid CacheConfig.namespace)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def delete_namespace(namespace: str, url: str = SHARED_REDIS_URL) -> None:
    """Delete every key of `namespace` (never FLUSHDB: other runs share this Redis)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
