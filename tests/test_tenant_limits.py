"""Per-tenant limits (pipeline/tenancy/limits.py) against the shared Redis, without Ray: two
limiters stand for two ingress replicas. Each test has a namespace of its own, deleted after."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from cache_service.config import CacheConfig
from pipeline.errors import IrisError
from pipeline.tenancy.limits import WINDOW_MS, LimitSet, TenantLimiter, TenantLimits
from tests.cache_fixtures import free_port
from tests.support.namespaces import SHARED_REDIS_URL


class Clock:
    """Wall-clock seconds, 20 s into a minute, moved by hand."""

    def __init__(self):
        self.now = (time.time() * 1000 // WINDOW_MS) * WINDOW_MS / 1000 + 20

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def replicas(namespace):
    """make(limits, **cache) -> a TenantLimiter on the shared Redis (one per ingress replica)."""
    made: list[TenantLimiter] = []

    def make(limits: dict, clock=time.time, request_timeout_s: float = 300, **cache) -> TenantLimiter:
        config = CacheConfig(**{"redis_url": SHARED_REDIS_URL, "namespace": namespace, **cache})
        limiter = TenantLimiter(TenantLimits.model_validate(limits), config, request_timeout_s, clock)
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.close()


async def refused(limiter: TenantLimiter, tenant: str, images: int = 0) -> IrisError:
    with pytest.raises(IrisError) as err:
        await limiter.admit(limiter.ticket(tenant), images)
    return err.value


async def admitted(limiter: TenantLimiter, tenant: str, images: int = 0, counted: bool = True):
    ticket = limiter.ticket(tenant)
    await limiter.admit(ticket, images)
    assert (ticket.backend is not None) == counted
    return ticket


def test_overrides_replace_the_defaults_field_by_field():
    limits = TenantLimits.model_validate(
        {
            "default": {"max_concurrent_requests": 4, "images_per_minute": 100},
            "tenants": {"acme": {"images_per_minute": 5}, "trusted": {"max_concurrent_requests": None}},
        }
    )
    assert limits.of("other") == LimitSet(max_concurrent_requests=4, images_per_minute=100)
    assert limits.of("acme") == LimitSet(max_concurrent_requests=4, images_per_minute=5)
    assert limits.of("trusted") == LimitSet(images_per_minute=100)  # an explicit null lifts a limit
    assert TenantLimits().any is False and TenantLimits().of("x").off


async def test_no_limits_no_redis(replicas):
    off = replicas({})
    assert off.redis is None  # no client at all: nothing is ever asked
    await admitted(off, "acme", 3, counted=False)
    # Limits for one tenant only: the others cost no round trip either.
    some = replicas({"tenants": {"acme": {"max_concurrent_requests": 1}}})
    other = some.ticket("globex")
    await some.admit(other, 3)
    await some.release(other)
    assert other.backend is None and some.stats == {"redis_admissions": 0, "memory_admissions": 0, "redis_errors": 0}


async def test_concurrency_holds_across_replicas(replicas):
    limits = {"default": {"max_concurrent_requests": 2}}
    a, b = replicas(limits), replicas(limits)
    first, second = await admitted(a, "acme"), await admitted(b, "acme")
    for limiter in (a, b):
        err = await refused(limiter, "acme")
        assert err.status_code == 429 and err.headers == {"Retry-After": "1"}
        assert err.to_dict()["error"]["code"] == "rate_limit_exceeded"
        assert err.to_dict()["error"]["type"] == "rate_limit_error" and err.extra["limit"] == "concurrency"
    globex = await admitted(a, "globex")  # another tenant has slots of its own
    await a.release(first)
    await a.release(first)  # twice is once
    third = await admitted(b, "acme")
    await refused(a, "acme")
    await b.release(second), await b.release(third)
    await a.release(globex)
    assert a.stats["redis_admissions"] + b.stats["redis_admissions"] == 7  # the refusals included
    assert a.stats["memory_admissions"] == 0


async def test_images_per_minute_across_replicas(replicas):
    clock = Clock()
    limits = {"tenants": {"acme": {"images_per_minute": 3}}}
    a, b = replicas(limits, clock), replicas(limits, clock)
    await admitted(a, "acme", 2)
    err = await refused(b, "acme", 2)  # 2 + 2 > 3
    assert err.extra["limit"] == "images" and err.headers == {"Retry-After": "40"}  # the rest of the minute
    await admitted(b, "acme", 1)
    await refused(a, "acme", 1)
    await admitted(a, "globex", 50, counted=False)  # no limit for globex
    clock.now += 60  # the next minute
    await admitted(b, "acme", 3)


async def test_more_images_than_a_minute_allows_is_a_400_not_a_429(replicas):
    limiter = replicas({"tenants": {"acme": {"images_per_minute": 3}}}, Clock())
    err = await refused(limiter, "acme", 4)
    assert err.status_code == 400 and err.code == "too_many_images" and "at most 3 per minute" in err.message
    await admitted(limiter, "acme", 3)  # the refused request took nothing from the minute


async def test_prompt_tokens_are_charged_when_the_answer_ends(replicas):
    clock = Clock()
    limits = {"default": {"prompt_tokens_per_minute": 100}}
    a, b = replicas(limits, clock), replicas(limits, clock)
    first, second = await admitted(a, "acme"), await admitted(b, "acme")  # nothing charged yet
    first.prompt_tokens = 60
    await a.release(first)
    await admitted(b, "acme")  # 60 < 100
    second.prompt_tokens = 60
    await b.release(second)  # 120: over budget (one request may overshoot)
    err = await refused(a, "acme")
    assert err.extra["limit"] == "prompt_tokens" and err.headers == {"Retry-After": "40"}
    clock.now += 60
    await admitted(a, "acme")


async def test_a_crashed_replicas_slot_expires(replicas, raw_redis):
    limits = {"default": {"max_concurrent_requests": 1}, "slot_grace_s": 0.3}
    crashed = replicas(limits, request_timeout_s=0.2)
    ticket = await admitted(crashed, "acme")  # never released: its replica died
    survivor = replicas(limits, request_timeout_s=0.2)
    await refused(survivor, "acme")
    inflight, _, _ = survivor.keys("acme", 0)
    assert 0 < raw_redis.pttl(inflight) <= 500  # the set itself expires too
    assert "acme" not in inflight  # keys name a hash of the tenant
    await asyncio.sleep(0.6)
    await admitted(survivor, "acme")
    assert ticket.backend == "redis"


async def test_without_redis_each_replica_limits_in_memory(replicas, caplog):
    limits = {"default": {"max_concurrent_requests": 1, "images_per_minute": 2}}
    down = replicas(limits, redis_url=f"redis://127.0.0.1:{free_port()}/0", backoff_initial_s=30, backoff_max_s=60)
    started = time.monotonic()
    first = await admitted(down, "acme", 1)
    assert first.backend == "memory" and down.stats["redis_errors"] == 1
    err = await refused(down, "acme")
    assert err.extra["limit"] == "concurrency"
    await down.release(first)
    second = await admitted(down, "acme", 1)
    await down.release(second)
    assert (await refused(down, "acme", 1)).extra["limit"] == "images"
    assert down.stats["redis_errors"] == 1  # backing off: Redis not asked again meanwhile
    assert time.monotonic() - started < 2
    assert any("Redis unreachable" in r.message for r in caplog.records)
    assert not any("127.0.0.1" in r.message for r in caplog.records)  # no URL (it may hold a password)


async def test_back_to_redis_after_the_backoff(replicas, redis_process, namespace):
    limits = {"default": {"max_concurrent_requests": 1}}
    settings = dict(redis_url=redis_process.url, backoff_initial_s=0.1, backoff_max_s=0.1)
    limiter = replicas(limits, **settings)
    held = await admitted(limiter, "acme")
    assert held.backend == "redis"
    redis_process.kill()
    in_memory = await admitted(limiter, "acme")  # Redis's count is out of reach: memory counts alone
    assert in_memory.backend == "memory"
    await limiter.release(held)  # its Redis entry will expire; no error
    await limiter.release(in_memory)
    redis_process.start()
    await asyncio.sleep(0.15)
    again = await admitted(limiter, "acme")
    assert again.backend == "redis"
    assert redis.Redis.from_url(redis_process.url).zcard(limiter.keys("acme", 0)[0]) == 1


def test_tenant_labels_are_salted_by_the_deployment_secret(monkeypatch):
    """An unsalted hash let anyone confirm a guessed tenant name from a dashboard; under the
    secret the label says nothing without it, and the same secret gives the same label."""
    import hashlib

    from pipeline.tenancy import tenant as tenancy

    unsalted = hashlib.sha256(b"iris-metric-tenant\0acme").hexdigest()[:12]
    monkeypatch.setenv(tenancy.METRIC_SALT_ENV, "secret-one")
    one = tenancy.metric_tenant("acme")
    assert one != unsalted and one == tenancy.metric_tenant("acme") and one != tenancy.metric_tenant("acmf")
    monkeypatch.setenv(tenancy.METRIC_SALT_ENV, "secret-two")
    assert tenancy.metric_tenant("acme") != one
    monkeypatch.delenv(tenancy.METRIC_SALT_ENV)
    opaque = tenancy.metric_tenant("acme")  # a random salt of this process
    assert opaque not in (unsalted, one) and tenancy.metric_tenant("acme") == opaque
