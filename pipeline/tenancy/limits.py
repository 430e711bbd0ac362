"""Per-tenant limits: requests in flight, images per minute, prompt tokens per minute (no Ray).

Limits hold across ingress replicas: the counters live in Redis (the cache's `redis_url`,
under its namespace), and each admission is one Lua script, so one round trip and atomic:

- **concurrency**: a sorted set of the tenant's requests in flight, scored by a deadline
  (`request_timeout_s` + `slot_grace_s`). A finished request removes its entry; the entry of a
  request whose replica crashed expires at its deadline, so a crash never leaks a slot for good.
- **per minute**: one counter per tenant and clock minute (fixed windows, which expire with
  their minute). Images are charged when the request is admitted (every image or video item
  counts one); a request whose items would take the minute past the limit is refused.
- **prompt tokens** are known only once the engine has tokenized the prompt: a request is
  refused while its tenant's current minute is already at or over budget, and the prompt
  tokens of the answer's usage are charged when the answer ends. So one request may overshoot
  a budget, and the next ones wait for the next minute.

Over a limit, `admit` raises a 429 `rate_limit_exceeded` with `Retry-After`: the seconds left in
the minute for the per-minute limits, 1 s for concurrency.

With no limit for a tenant (the default) nothing is counted and Redis is never asked. When
Redis cannot be reached, each replica counts in its own memory (so N ingress replicas admit up to
N times the limits) and tries Redis again after a backoff that doubles from the cache's
`backoff_initial_s` up to `backoff_max_s`. A release goes where its admission was counted.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from cache_service.config import CacheConfig
from cache_service.redis_client import REDIS_ERRORS, Backoff, connect
from pipeline.errors import IrisError, bad_request

logger = logging.getLogger(__name__)

WINDOW_MS = 60_000
CONCURRENCY_RETRY_S = 1


class LimitSet(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrent_requests: int | None = Field(
        None, ge=1, description="Chat and completion requests of one tenant in flight at once; None: no limit."
    )
    images_per_minute: int | None = Field(
        None,
        ge=1,
        description="Images and videos (each item counts one) one tenant may send per clock minute; None: no limit.",
    )
    prompt_tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="Prompt tokens one tenant may use per clock minute, charged from each answer's "
        "usage; a request is refused while the minute is already at or over it. None: no limit.",
    )

    @property
    def off(self) -> bool:
        return (
            self.max_concurrent_requests is None
            and self.images_per_minute is None
            and self.prompt_tokens_per_minute is None
        )

    def over(self, override: LimitSet) -> LimitSet:
        """These limits with the fields `override` sets replaced (an explicit null lifts a limit)."""
        return self.model_copy(update={name: getattr(override, name) for name in override.model_fields_set})


class TenantLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    default: LimitSet = Field(default_factory=LimitSet, description="Limits of every tenant (all off by default).")
    tenants: dict[str, LimitSet] = Field(
        default_factory=dict,
        description="Overrides by tenant name (a name from the key mapping, `key-<hash>` of an unmapped key, "
        "or `default`): the fields given replace the default's, null lifts one.",
    )
    slot_grace_s: float = Field(
        30,
        gt=0,
        description="A request's concurrency slot expires request_timeout_s plus this after it was "
        "taken, should its ingress replica die before releasing it.",
    )

    def of(self, tenant: str) -> LimitSet:
        override = self.tenants.get(tenant)
        return self.default if override is None else self.default.over(override)

    @property
    def any(self) -> bool:
        return not self.default.off or any(not limits.off for limits in self.tenants.values())


def rate_limited(limit: str, retry_after_s: int, message: str) -> IrisError:
    return IrisError(
        message,
        status_code=429,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        extra={"limit": limit},
        headers={"Retry-After": str(retry_after_s)},
    )


@dataclass
class Ticket:
    """One request's admission: what it holds, and where it was counted."""

    tenant: str
    limits: LimitSet
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    backend: str | None = None  # "redis" | "memory" once admitted; None: nothing held
    prompt_tokens: int = 0  # charged on release (the answer's usage)
    released: bool = False
    scope: str = ""  # the model whose own limits count it (an app of several models); "": the app's


# KEYS: in-flight set, images of this minute, prompt tokens of this minute
# ARGV: now_ms, request id, slot deadline_ms, max concurrent, images, max images, max tokens, ms left in minute
# Returns {limit refused ('' when admitted), ms to retry after}.
_ADMIT = """
local now, max_conc, images = tonumber(ARGV[1]), tonumber(ARGV[4]), tonumber(ARGV[5])
local max_img, max_tok, left = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
if max_tok > 0 and tonumber(redis.call('GET', KEYS[3]) or '0') >= max_tok then return {'prompt_tokens', left} end
if max_img > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') + images > max_img then return {'images', left} end
if max_conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= max_conc then return {'concurrency', 0} end
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
  redis.call('PEXPIREAT', KEYS[1], ARGV[3])
end
if max_img > 0 and images > 0 then
  redis.call('INCRBY', KEYS[2], images)
  redis.call('PEXPIRE', KEYS[2], left + 60000)
end
return {'', 0}
"""

# KEYS: in-flight set, prompt tokens of this minute; ARGV: request id ('' if none held), tokens, ttl_ms
_RELEASE = """
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[1], ARGV[1]) end
local tokens = tonumber(ARGV[2])
if tokens > 0 then
  redis.call('INCRBY', KEYS[2], tokens)
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return 1
"""


class MemoryCounters:
    """The same counters in this process's memory: the fallback while Redis is down."""

    def __init__(self):
        self.inflight: dict[str, dict[str, float]] = {}  # tenant -> request id -> deadline (ms)
        self.minutes: dict[tuple[str, str], tuple[int, int]] = {}  # (tenant, what) -> (minute, count)

    def used(self, tenant: str, what: str, minute: int) -> int:
        at, count = self.minutes.get((tenant, what), (minute, 0))
        return count if at == minute else 0

    def charge(self, tenant: str, what: str, minute: int, n: int) -> None:
        self.minutes[(tenant, what)] = (minute, self.used(tenant, what, minute) + n)

    def admit(self, ticket: Ticket, images: int, now_ms: int, deadline_ms: int) -> tuple[str, int]:
        limits, tenant, minute = ticket.limits, ticket.tenant, now_ms // WINDOW_MS
        left = (minute + 1) * WINDOW_MS - now_ms
        if limits.prompt_tokens_per_minute and self.used(tenant, "tokens", minute) >= limits.prompt_tokens_per_minute:
            return "prompt_tokens", left
        if limits.images_per_minute and self.used(tenant, "images", minute) + images > limits.images_per_minute:
            return "images", left
        if limits.max_concurrent_requests:
            held = self.inflight.setdefault(tenant, {})
            for rid in [r for r, deadline in held.items() if deadline <= now_ms]:
                del held[rid]
            if len(held) >= limits.max_concurrent_requests:
                return "concurrency", 0
            held[ticket.request_id] = deadline_ms
        if limits.images_per_minute and images:
            self.charge(tenant, "images", minute, images)
        return "", 0

    def release(self, ticket: Ticket, now_ms: int) -> None:
        self.inflight.get(ticket.tenant, {}).pop(ticket.request_id, None)
        if ticket.limits.prompt_tokens_per_minute and ticket.prompt_tokens:
            self.charge(ticket.tenant, "tokens", now_ms // WINDOW_MS, ticket.prompt_tokens)


class TenantLimiter:
    """admit() a request before any work on it, release() its ticket when its answer ends."""

    def __init__(
        self, limits: TenantLimits, cache: CacheConfig, request_timeout_s: float, clock=time.time, scope: str = ""
    ):
        self.limits = limits
        self.scope = scope  # a model with limits of its own: counted apart from the app's (Redis keys of its own)
        self.slot_ms = int((request_timeout_s + limits.slot_grace_s) * 1000)
        self.namespace = cache.namespace
        self.clock = clock
        self.memory = MemoryCounters()
        self.backoff = Backoff(cache)
        self.redis = connect(cache, "iris-tenant-limits") if limits.any and cache.redis_url else None
        self.stats = {"redis_admissions": 0, "memory_admissions": 0, "redis_errors": 0}

    def ticket(self, tenant: str) -> Ticket:
        return Ticket(tenant, self.limits.of(tenant), scope=self.scope)

    def keys(self, tenant: str, minute: int) -> tuple[str, str, str]:
        """The tenant's Redis keys: one hash tag per tenant, so a cluster runs its scripts on one slot."""
        tag = hashlib.sha256(b"iris-tenant-limits\0" + tenant.encode()).hexdigest()[:24]
        scope = f"model:{hashlib.sha256(self.scope.encode()).hexdigest()[:16]}:" if self.scope else ""
        base = f"{self.namespace}:limits:{scope}{{{tag}}}"
        return f"{base}:inflight", f"{base}:images:{minute}", f"{base}:tokens:{minute}"

    async def admit(self, ticket: Ticket, images: int = 0) -> None:
        """Count the request in, or raise a 429 saying which limit it is over. One Redis
        round trip, none when the tenant has no limits."""
        limits = ticket.limits
        if limits.off or ticket.backend is not None:
            return
        if limits.images_per_minute is not None and images > limits.images_per_minute:
            # Not a 429: waiting would not help.
            raise bad_request(
                f"this request has {images} images and videos; this API key may send at most "
                f"{limits.images_per_minute} per minute",
                param="messages",
                code="too_many_images",
            )
        now_ms = int(self.clock() * 1000)
        deadline_ms = now_ms + self.slot_ms
        refused, retry_ms = None, 0
        if self._redis_usable():
            minute = now_ms // WINDOW_MS
            try:
                refused, retry_ms = await self.redis.eval(
                    _ADMIT,
                    3,
                    *self.keys(ticket.tenant, minute),
                    now_ms,
                    ticket.request_id,
                    deadline_ms,
                    limits.max_concurrent_requests or 0,
                    images,
                    limits.images_per_minute or 0,
                    limits.prompt_tokens_per_minute or 0,
                    (minute + 1) * WINDOW_MS - now_ms,
                )
                refused = refused.decode() if isinstance(refused, bytes) else refused
                self._redis_ok()
                self.stats["redis_admissions"] += 1
                backend = "redis"
            except REDIS_ERRORS as err:
                self._redis_failed(err)
        if refused is None:
            refused, retry_ms = self.memory.admit(ticket, images, now_ms, deadline_ms)
            self.stats["memory_admissions"] += 1
            backend = "memory"
        if refused:
            raise self._refusal(refused, limits, images, retry_ms)
        ticket.backend = backend

    async def release(self, ticket: Ticket) -> None:
        """Give back the request's concurrency slot and charge its prompt tokens; once per ticket."""
        if ticket.backend is None or ticket.released:
            return
        ticket.released = True
        limits = ticket.limits
        held = ticket.request_id if limits.max_concurrent_requests else ""
        tokens = ticket.prompt_tokens if limits.prompt_tokens_per_minute else 0
        if not held and not tokens:
            return
        now_ms = int(self.clock() * 1000)
        if ticket.backend == "memory":
            self.memory.release(ticket, now_ms)
            return
        minute = now_ms // WINDOW_MS
        inflight, _, spent = self.keys(ticket.tenant, minute)
        try:
            await self.redis.eval(
                _RELEASE, 2, inflight, spent, held, tokens, (minute + 1) * WINDOW_MS - now_ms + WINDOW_MS
            )
        except REDIS_ERRORS as err:  # the slot expires at its deadline; these tokens go uncharged
            self._redis_failed(err)

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()

    # -- Redis health ----------------------------------------------------------------

    def _redis_usable(self) -> bool:
        return self.redis is not None and not self.backoff.waiting

    def _redis_ok(self) -> None:
        if self.backoff.failing:
            logger.warning("Iris tenant limits: Redis answers again; limits are cluster-wide again")
        self.backoff.answered()

    def _redis_failed(self, err: BaseException) -> None:
        self.stats["redis_errors"] += 1
        if not self.backoff.failing:  # the URL is not logged: it may hold a password
            logger.warning(
                "Iris tenant limits: Redis unreachable (%s); counting in this replica's memory", type(err).__name__
            )
        self.backoff.failed()

    @staticmethod
    def _refusal(limit: str, limits: LimitSet, images: int, retry_ms: int) -> IrisError:
        retry_s = max(1, math.ceil(retry_ms / 1000)) if retry_ms else CONCURRENCY_RETRY_S
        if limit == "concurrency":
            message = f"too many requests in flight for this API key (limit {limits.max_concurrent_requests})"
        elif limit == "images":
            message = (
                f"this request's {images} image(s) would exceed the limit of {limits.images_per_minute} "
                "images per minute for this API key"
            )
        else:
            message = (
                f"the limit of {limits.prompt_tokens_per_minute} prompt tokens per minute for this API key is used up"
            )
        return rate_limited(limit, retry_s, f"Rate limit reached: {message}; retry after {retry_s} s.")
