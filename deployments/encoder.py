"""VisionEncoder: the vision tower + projector only, batched across requests.

Writes each image's features into the cache through single-flight (one
computation per key cluster-wide) and returns keys and metadata, not tensors.
"""

from __future__ import annotations

import asyncio
import time

import torch
from ray import serve
from ray.serve import metrics

from cache_service.feature_cache import FeatureCache
from deployments.config import IrisConfig
from deployments.metrics import CacheMetrics, latency_histogram
from pipeline.families import PixelInputs, adapter_for
from pipeline.fingerprint import model_fingerprint
from pipeline.models.source import resolve_model
from pipeline.stage_io import EncodedImage


@serve.deployment(ray_actor_options={"num_cpus": 1})
class VisionEncoder:
    def __init__(self, config: IrisConfig):
        self.adapter = adapter_for(resolve_model(config.model))
        device = config.encoder_device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and config.encoder_cpu_threads:
            torch.set_num_threads(config.encoder_cpu_threads)
        dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
        self.adapter.load_vision(device=device, dtype=dtype)
        dtype_name = str(next(self.adapter.vision.parameters()).dtype)
        self.fingerprint = model_fingerprint(self.adapter, {"dtype": dtype_name})
        self.cache = FeatureCache(config.cache)
        self.cache_metrics = CacheMetrics(self.cache)
        self._forward.set_max_batch_size(config.encoder_batch_size)
        self._forward.set_batch_wait_timeout_s(config.encoder_batch_wait_s)
        self.batch_size = metrics.Histogram("iris_encoder_batch_size", description="Images per vision-encoder "
                                            "forward pass", boundaries=[1, 2, 4, 8, 16, 32, 64, 128])
        self.batch_seconds = latency_histogram("iris_encoder_batch_seconds", "Seconds per vision-encoder forward pass")
        self.images_encoded = 0
        self.batches = 0

    def get_fingerprint(self) -> str:
        return self.fingerprint

    async def encode(self, key: str, pixels: PixelInputs, inline: bool = False) -> EncodedImage:
        """Features for `key`, computed at most once cluster-wide; the tensors come back
        only when `inline` or when they could not be shared through Redis."""
        async def compute(_indexes: list[int]):
            return [await self._forward(pixels)]

        (result,) = await self.cache.get_or_compute_many([key], compute)
        self.cache_metrics.export()
        send = inline or not result.shared
        return EncodedImage(index=-1, key=key, num_tokens=int(result.features.meta.get("num_tokens", pixels.num_tokens)),
                            features=result.features.cpu() if send else None)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def _forward(self, batch: list[PixelInputs]):
        start = time.perf_counter()
        features = await asyncio.to_thread(self.adapter.encode, batch)
        self.batch_seconds.observe(time.perf_counter() - start)
        self.batch_size.observe(len(batch))
        self.images_encoded += len(batch)
        self.batches += 1
        return features

    def stats(self) -> dict:
        return {"images_encoded": self.images_encoded, "batches": self.batches, "cache": self.cache.stats()}
