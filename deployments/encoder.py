"""VisionEncoder: vLLM's model class for the checkpoint with the tower and projector
only (`mm_encoder_only`), batched across requests (pipeline/model/vision_model.py).

Computes each image's features through the cache's single-flight (one
computation per key cluster-wide), puts them in Ray's object store for the
decoder and returns a reference; the Redis write runs behind (write_behind),
off the request's time to first token.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import ray
import torch
from ray import serve
from ray.serve import metrics

from cache_service.feature_cache import FeatureCache
from cache_service.keys import fingerprint_of
from cache_service.validation import ValueCheck, stamp_fingerprint
from deployments import tracing
from deployments.config import IrisConfig
from deployments.metrics import CacheMetrics, StageQueueMetrics, latency_histogram
from deployments.stage_trace import mark
from pipeline.errors import IrisError, model_changed
from pipeline.model.vision_model import PixelInputs
from pipeline.stage_io import EncodedMedia
from pipeline.tenancy.fair_gate import FairGate

GPU_BATCH_SIZE = 8  # encoder_batch_size "auto" on a GPU


@dataclass
class _Queued:
    pixels: PixelInputs
    cost: int  # in the batch's budget units (see __init__)
    forward: tuple | None = None  # with tracing on: (start ns, end ns, batch size, batch number) of its forward pass


@serve.deployment(ray_actor_options={"num_cpus": 1})
class VisionEncoder:
    def __init__(self, config: IrisConfig):
        on_gpu = torch.cuda.is_available()
        if not on_gpu and config.encoder_cpu_threads:
            torch.set_num_threads(config.encoder_cpu_threads)
        tracing.setup(config.tracing, "encoder")
        self.vision = config.vision_model()
        self.vision.load_encoder()
        self.fingerprint = self.vision.fingerprint()
        # Values read from Redis must carry our fingerprint and look like our features.
        self.cache = FeatureCache(config.cache, check=ValueCheck(self.vision.feature_problem))
        self.cache_metrics = CacheMetrics(self.cache)
        # Batch cost units make one limit do two jobs: with a token budget T and a
        # count N, an image costs max(min(tokens, T) * N, T) of N * T, so a batch
        # holds at most N images and about T tokens (an image above T runs alone).
        self.max_tokens = config.encoder_batch_max_tokens
        self.max_images = config.encoder_batch_size
        if self.max_images == "auto":
            self.max_images = GPU_BATCH_SIZE if on_gpu else 1
        self._forward.set_max_batch_size(self.max_images * (self.max_tokens or 1))
        self._forward.set_batch_wait_timeout_s(config.encoder_batch_wait_s)
        # Items queued for or in the forward pass; the rest wait for their tenant's turn.
        slots = config.fair_sharing.encoder_slots
        self.gate = FairGate(2 * self.max_images if slots == "auto" else slots, config.fair_sharing.enabled,
                             config.fair_sharing.tenant_weights)
        self.queue_seconds = StageQueueMetrics("encoder")
        self.batch_size = metrics.Histogram("iris_encoder_batch_size", description="Images per vision-encoder "
                                            "forward pass", boundaries=[1, 2, 4, 8, 16, 32, 64, 128])
        self.batch_seconds = latency_histogram("iris_encoder_batch_seconds", "Seconds per vision-encoder forward pass")
        self.images_encoded = 0
        self.batches = 0
        self.encoding = 0  # encode() calls in progress

    def get_fingerprint(self) -> str:
        return self.fingerprint

    def get_modalities(self) -> dict[str, str]:
        """What this model serves ("image", and "video" where vLLM's processor takes videos),
        each with how its features reach the decoder: "embeddings" or "connector"."""
        return {m: self.vision.forms[m].delivery for m in self.vision.modalities}

    async def encode(self, key: str, pixels: PixelInputs | IrisError, tenant: str = "default",
                     trace: dict[str, str] | None = None) -> EncodedMedia | IrisError:
        """Features for `key` as an object-store reference. `pixels` is Preprocess's result
        (Serve resolves the pending response the ingress passed); its client error passes through.
        `trace`: the request's trace context (deployments/tracing.py)."""
        mark("encoder.start", key)
        if isinstance(pixels, IrisError):
            return pixels
        self.encoding += 1
        try:
            with tracing.span("encoder", trace) as span:
                encoded = await self._encode(key, pixels, tenant)
                if span.is_recording() and isinstance(encoded, EncodedMedia):
                    span.set_attribute("iris.num_tokens", encoded.num_tokens)  # no encoder.forward child: found cached
                return encoded
        finally:
            self.encoding -= 1

    async def _encode(self, key: str, pixels: PixelInputs, tenant: str) -> EncodedMedia | IrisError:
        if fingerprint_of(key) != self.fingerprint:
            # A rolling update: the ingress keyed this image for other weights. Never store
            # our features under another model's key; the ingress refetches the fingerprint.
            return model_changed()
        if pixels.processed_with != self.vision.processing_id():
            # A rolling update of a Preprocess setting: pixels made for other features; same answer.
            return model_changed()

        if self.max_tokens is None:
            cost = 1
        else:
            cost = max(min(pixels.num_tokens, self.max_tokens) * self.max_images, self.max_tokens)

        async def compute(_indexes: list[int]):
            # Large images weigh more in the tenant's share: the forward pass costs by tokens.
            async with self.gate.slot(tenant, pixels.num_tokens) as waited:
                self.queue_seconds.observe(waited, tenant)
                queued = _Queued(pixels, cost)
                features = await self._forward(queued)
            if queued.forward is not None:  # the batch this image rode in, inside this request's trace
                start_ns, end_ns, size, number = queued.forward
                tracing.ended_span("encoder.forward", start_ns, end_ns,
                                   {"iris.encoder.batch_size": size, "iris.encoder.batch": number,
                                    "iris.queue_seconds": waited})
            # The fingerprint in the value lets every reader check it against the key's.
            return [stamp_fingerprint(features, self.fingerprint)]

        (result,) = await self.cache.get_or_compute_many([key], compute, write_behind=True)
        self.cache_metrics.export()
        features = result.features.cpu()
        encoded = EncodedMedia(key, features.num_tokens or pixels.num_tokens, ray.put(features))
        mark("encoder.end", key)
        return encoded

    # Batch size and wait come from the config, set per replica in __init__.
    @serve.batch(batch_size_fn=lambda q: sum(i.cost for i in q))
    async def _forward(self, batch: list[_Queued]):
        start = time.perf_counter()
        mark("encoder.forward_start")
        features = await asyncio.to_thread(self.vision.encode, [q.pixels for q in batch])
        mark("encoder.forward_end")
        self.batch_seconds.observe(time.perf_counter() - start)
        self.batch_size.observe(len(batch))
        self.images_encoded += len(batch)
        self.batches += 1
        if tracing.enabled():
            end_ns = time.time_ns()
            start_ns = end_ns - int((time.perf_counter() - start) * 1e9)
            for q in batch:
                q.forward = (start_ns, end_ns, len(batch), self.batches)
        return features

    def stats(self) -> dict:
        return {"images_encoded": self.images_encoded, "batches": self.batches, "encoding": self.encoding,
                "waiting": self.gate.waiting, "cache": self.cache.stats()}
