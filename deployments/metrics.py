"""Iris's Prometheus metrics, through ray.serve.metrics (exported on Serve's metrics endpoint)."""

from __future__ import annotations

import threading
import time
from collections import Counter

from ray.serve import metrics

from cache_service.feature_cache import FeatureCache
from pipeline.tenancy.tenant import metric_tenant

# Stats that are levels, not running counts.
GAUGES = {"degraded", "l1_bytes", "l1_entries"}
# Ray drops a gauge's series once it goes two metrics report intervals (1 s at least) without a set():
# levels are set again this often, not only when a request passes.
GAUGE_REFRESH_S = 1.0
_LATENCY_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


class CacheMetrics:
    """Mirrors a FeatureCache's counters into Prometheus counters, as deltas.
    (Serve tags every metric with its deployment and replica itself.)"""

    def __init__(self, cache: FeatureCache):
        self.cache = cache
        self.counter = metrics.Counter(
            "iris_feature_cache_events",
            description="Feature-cache events by kind "
            "(l1_hits, l1_misses, l2_hits, l2_misses, puts, corrupt, oversize, degraded transitions, ...)",
            tag_keys=("event",),
        )
        self.degraded = metrics.Gauge(
            "iris_feature_cache_degraded",
            description="Redis shards unreachable now (one Redis: 1 while it is down); their keys are misses",
        )
        self._last: dict[str, float] = {}
        # The level stays on the dashboard while the replica is idle (a thread: replicas build this in
        # sync and async constructors alike).
        threading.Thread(target=self._keep_level, name="iris-cache-degraded-gauge", daemon=True).start()

    def _keep_level(self) -> None:
        while True:
            time.sleep(GAUGE_REFRESH_S)
            self.degraded.set(self.cache.counters.degraded)

    def export(self) -> None:
        snapshot = self.cache.stats()
        for name, value in snapshot.items():
            if name in GAUGES:
                continue
            delta = value - self._last.get(name, 0)
            if delta > 0:
                self.counter.inc(delta, tags={"event": name})
        self._last = dict(snapshot)
        self.degraded.set(snapshot["degraded"])


def latency_histogram(name: str, description: str, tag_keys: tuple[str, ...] = ()) -> metrics.Histogram:
    return metrics.Histogram(name, description=description, boundaries=_LATENCY_BOUNDARIES, tag_keys=tag_keys)


class StageQueueMetrics:
    """Seconds an item waited for its tenant's turn in a stage (pipeline/tenancy/fair_gate.py), by tenant
    (hashed: pipeline/tenancy/tenant.py metric_tenant)."""

    def __init__(self, stage: str):
        self.stage = stage
        self.histogram = latency_histogram(
            "iris_stage_queue_seconds",
            "Seconds an image or video waited for a slot in a stage (Preprocess, VisionEncoder), by tenant",
            tag_keys=("stage", "tenant"),
        )

    def observe(self, seconds: float, tenant: str) -> None:
        self.histogram.observe(seconds, tags={"stage": self.stage, "tenant": metric_tenant(tenant)})


class RequestMetrics:
    """The ingress's counts: requests by outcome, items by how their features were obtained,
    time to first token. Mirrored in `counts` for /iris/stats, which also counts the image work
    the ingress itself starts: `media_fetched` (items whose bytes it loaded: a data: URL decoded
    or an http(s) URL fetched) and `preprocess_calls` (items it sent to Preprocess)."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.requests = metrics.Counter("iris_requests", description="Chat requests by outcome", tag_keys=("outcome",))
        self.items = metrics.Counter(
            "iris_images",
            description="Images and videos by how their features were "
            "obtained (cached: feature-cache hit; computed: preprocess + encoder ran)",
            tag_keys=("source",),
        )
        self.ttft = latency_histogram("iris_ttft_seconds", "Seconds from request arrival to the first token")

    def outcome(self, outcome: str) -> None:
        self.counts[f"requests_{outcome}"] += 1
        self.requests.inc(tags={"outcome": outcome})

    def error(self, status_code: int, code: str | None) -> None:
        self.outcome(
            "cache_miss" if code == "mm_cache_miss" else "client_error" if status_code < 500 else "server_error"
        )

    def fetched(self, items: int) -> None:
        self.counts["media_fetched"] += items

    def preprocess_called(self) -> None:
        self.counts["preprocess_calls"] += 1

    def media(self, cached: int, computed: int) -> None:
        for source, n in (("cached", cached), ("computed", computed)):
            if n:
                self.items.inc(n, tags={"source": source})
                self.counts[f"images_{source}"] += n


class TenantMetrics:
    """Requests per tenant, by outcome. Tenants are tagged by pipeline.tenancy.tenant.metric_tenant (a
    hash), never by name or key; a 401's key names no tenant, so 401s are tagged `none`."""

    def __init__(self, counts: Counter[str]):
        self.counts = counts  # RequestMetrics.counts: totals for /iris/stats
        self.requests = metrics.Counter(
            "iris_tenant_requests",
            description="Chat and completion requests per tenant (hashed) and outcome: "
            "admitted (past the key check and the tenant's limits), rate_limited (429); and 401s (no or a wrong "
            "key, on any route but /health) as tenant `none`, outcome unauthorized",
            tag_keys=("tenant", "outcome"),
        )
        self.limited = metrics.Counter(
            "iris_tenant_rate_limited",
            description="429s per tenant (hashed) and the limit refused: concurrency, images, prompt_tokens",
            tag_keys=("tenant", "limit"),
        )
        self.prompt_tokens = metrics.Counter(
            "iris_tenant_prompt_tokens",
            description="Prompt tokens charged per tenant (hashed), from answers' usage",
            tag_keys=("tenant",),
        )

    def _outcome(self, tag: str, outcome: str) -> None:
        self.counts[f"tenant_{outcome}"] += 1
        self.requests.inc(tags={"tenant": tag, "outcome": outcome})

    def unauthorized(self) -> None:
        self._outcome("none", "unauthorized")

    def admitted(self, tenant: str) -> None:
        self._outcome(metric_tenant(tenant), "admitted")

    def rate_limited(self, tenant: str, limit: str) -> None:
        self._outcome(metric_tenant(tenant), "rate_limited")
        self.limited.inc(tags={"tenant": metric_tenant(tenant), "limit": limit})

    def charged(self, tenant: str, prompt_tokens: int) -> None:
        if prompt_tokens > 0:
            self.prompt_tokens.inc(prompt_tokens, tags={"tenant": metric_tenant(tenant)})
