"""Counters read from each system's Prometheus endpoint, before and after a load point.

encoder_runs     vision-encoder runs. Iris: keys its VisionEncoder computed
                 (`iris_feature_cache_events{event="computations"}`). vLLM-based peers count no
                 encoder runs; their multimodal processor-cache misses
                 (`vllm:mm_cache_queries - vllm:mm_cache_hits`) are used instead:
                 an image that misses that cache is processed and encoded, and
                 one that hits it is served from the prefix cache or re-encoded
                 only if its KV blocks were evicted (rare at these sizes).
preprocess_runs  Iris only: images through Preprocess.
stage_seconds    Iris only: (sum, count) of its stage histograms, for a mean per
                 stage: preprocess (one image), encoder batch (one forward pass),
                 ttft (ingress arrival to first token, server side).
prefix           per replica, (prompt tokens served from vLLM's prefix cache,
                 prompt tokens looked up). Iris: its own per-replica counters;
                 peers: vLLM's `prefix_cache_hits` / `prefix_cache_queries`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import httpx

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# Labels that name the replica a sample comes from (Ray Serve tags every metric).
_REPLICA_LABELS = ("replica", "ReplicaId", "replica_id")


@dataclass
class Counters:
    encoder_runs: float = 0.0
    preprocess_runs: float | None = None
    prefix: dict[str, list[float]] = field(default_factory=dict)  # replica -> [hit tokens, queried tokens]
    stage_seconds: dict[str, list[float]] = field(default_factory=dict)  # stage -> [sum, count]

    def minus(self, before: Counters) -> Counters:
        prefix = {r: _sub(v, before.prefix.get(r, [0.0, 0.0])) for r, v in self.prefix.items()}
        stages = {s: _sub(v, before.stage_seconds.get(s, [0.0, 0.0])) for s, v in self.stage_seconds.items()}
        pre = None if self.preprocess_runs is None else self.preprocess_runs - (before.preprocess_runs or 0.0)
        return Counters(self.encoder_runs - before.encoder_runs, pre, prefix, stages)

    def stage_means_ms(self) -> dict[str, float]:
        return {s: 1000 * total / n for s, (total, n) in sorted(self.stage_seconds.items()) if n}

    def prefix_hit_rates(self) -> dict[str, float | None]:
        return {r: (h / q if q else None) for r, (h, q) in sorted(self.prefix.items())}

    def pooled_prefix_hit_rate(self) -> float | None:
        """Prefix-cache hit tokens over prompt tokens, all replicas together."""
        queried = sum(q for _, q in self.prefix.values())
        return sum(h for h, _ in self.prefix.values()) / queried if queried else None

    def prompt_token_shares(self) -> dict[str, float]:
        """Each replica's share of the prompt tokens: how the router spread the load."""
        queried = sum(q for _, q in self.prefix.values())
        return {r: q / queried for r, (_, q) in sorted(self.prefix.items())} if queried else {}


def _sub(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b)]


# Iris's stage histograms: stage name -> metric base name.
IRIS_STAGES = {
    "preprocess": "ray_iris_preprocess_seconds",
    "encoder_batch": "ray_iris_encoder_batch_seconds",
    "ttft_server": "ray_iris_ttft_seconds",
}


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            try:
                samples.append((m.group(1), dict(_LABEL.findall(m.group(3) or "")), float(m.group(4))))
            except ValueError:
                continue
    return samples


def _total(samples, name: str) -> float:
    return sum(v for n, _, v in samples if n == name)


def _by_replica(samples, name: str, default: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for n, labels, v in samples:
        if n == name:
            replica = next((labels[k] for k in _REPLICA_LABELS if k in labels), default)
            out[replica] += v
    return out


def _first_present(samples, *names: str) -> str:
    present = {n for n, _, _ in samples}
    return next((n for n in names if n in present), names[0])


def scrape(system: str, urls: list[str]) -> Counters:
    counters = Counters()
    prefix: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for i, url in enumerate(urls):
        samples = parse(httpx.get(url, timeout=10).text)
        if system.startswith("iris"):
            # Keys the VisionEncoder computed (the batch-size histogram's exported sum is not exact).
            counters.encoder_runs += sum(
                v
                for n, labels, v in samples
                if n == "ray_iris_feature_cache_events_total"
                and labels.get("event") == "computations"
                and labels.get("deployment") == "VisionEncoder"
            )
            counters.preprocess_runs = (counters.preprocess_runs or 0.0) + _total(
                samples, "ray_iris_preprocess_seconds_count"
            )
            for stage, base in IRIS_STAGES.items():
                total = counters.stage_seconds.setdefault(stage, [0.0, 0.0])
                total[0] += _total(samples, f"{base}_sum")
                total[1] += _total(samples, f"{base}_count")
            hits_name = _first_present(
                samples, "ray_iris_vllm_prefix_cache_hit_tokens_total", "ray_iris_vllm_prefix_cache_hit_tokens"
            )
            queries_name = _first_present(samples, "ray_iris_vllm_prompt_tokens_total", "ray_iris_vllm_prompt_tokens")
        else:
            prefix_ = "ray_vllm_" if system.startswith("rayllm") else "vllm:"
            queries = _first_present(samples, f"{prefix_}mm_cache_queries_total", f"{prefix_}mm_cache_queries")
            hits = _first_present(samples, f"{prefix_}mm_cache_hits_total", f"{prefix_}mm_cache_hits")
            counters.encoder_runs += _total(samples, queries) - _total(samples, hits)
            hits_name = _first_present(samples, f"{prefix_}prefix_cache_hits_total", f"{prefix_}prefix_cache_hits")
            queries_name = _first_present(
                samples, f"{prefix_}prefix_cache_queries_total", f"{prefix_}prefix_cache_queries"
            )
        for replica, value in _by_replica(samples, hits_name, f"server{i}").items():
            prefix[replica][0] += value
        for replica, value in _by_replica(samples, queries_name, f"server{i}").items():
            prefix[replica][1] += value
    counters.prefix = dict(prefix)
    return counters
