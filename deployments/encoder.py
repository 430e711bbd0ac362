"""VisionEncoder: vLLM's model class for the checkpoint with the tower and projector
only (`mm_encoder_only`), batched across requests (pipeline/model/vision_model.py).

Computes each image's features through the cache's single-flight (one computation per
key cluster-wide, its lock taken once the tenant's turn at the encoder has come, so the
lock covers the forward pass, not the queue), puts them in Ray's object store for the
decoder and returns a reference; the Redis write runs behind (write_behind), off the
request's time to first token.

The decoder borrows that reference through the ingress. The encoder keeps its own until
the value is in Redis, or, where it never gets there, for `request_timeout_s` (past the
deadline of the request it was computed for); a decoder that cannot fetch it (Ray's
reference counting under load, a replica gone) reads Redis instead. On graceful shutdown
the Redis writes still running finish first (within FLUSH_ON_SHUTDOWN_S).

A batch whose forward pass raises is encoded again item by item, so an item the tower
refuses fails alone: a 400 naming it while the tower still encodes its probe image, a 503
where the probe fails too. `check_health` runs the probe when no forward pass has shown
the tower working lately.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import ray
import torch
from ray import serve
from ray.serve import metrics

from cache_service.feature_cache import FeatureCache
from cache_service.features import Features
from cache_service.keys import fingerprint_of
from cache_service.single_flight import ComputeResult
from cache_service.validation import ValueCheck, stamp_fingerprint
from deployments import tracing
from deployments.config import IrisConfig
from deployments.metrics import CacheMetrics, StageQueueMetrics, latency_histogram
from deployments.stage_trace import mark
from pipeline.errors import IrisError, bad_request, model_changed, server_error
from pipeline.model.samples import sample_image_bytes
from pipeline.model.vision_model import PixelInputs
from pipeline.stage_io import EncodedMedia
from pipeline.tenancy.fair_gate import FairGate

logger = logging.getLogger("ray.serve")

GPU_BATCH_SIZE = 8  # encoder_batch_size "auto" on a GPU
HEALTH_PROBE_S = 60.0  # check_health runs the probe image when no forward pass succeeded for this long
FLUSH_ON_SHUTDOWN_S = 10.0  # pending Redis writes at shutdown; within Serve's graceful_shutdown_timeout_s (20 s)
ERROR_TEXT_CHARS = 300  # of the tower's exception, in a refused item's message


@dataclass
class _Queued:
    pixels: PixelInputs
    cost: int  # in the batch's budget units (see __init__)
    name: str = "image"  # how the request names it ("image[0]"), for its error
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
        self.gate = FairGate(
            2 * self.max_images if slots == "auto" else slots,
            config.fair_sharing.enabled,
            config.fair_sharing.tenant_weights,
        )
        self.queue_seconds = StageQueueMetrics("encoder")
        self.batch_size = metrics.Histogram(
            "iris_encoder_batch_size",
            description="Images per vision-encoder forward pass",
            boundaries=[1, 2, 4, 8, 16, 32, 64, 128],
        )
        self.batch_seconds = latency_histogram("iris_encoder_batch_seconds", "Seconds per vision-encoder forward pass")
        self.images_encoded = 0
        self.batches = 0
        self.encoding = 0  # encode() calls in progress
        self.items_refused = 0  # items the tower raised on alone while it encoded others (400s)
        self.refused_total = metrics.Counter(
            "iris_encoder_items_refused",
            description="Images and videos the vision tower raised on while it encoded others (answered 400)",
        )
        self.request_timeout_s = config.request_timeout_s
        # One forward pass at a time on the device: batches, their items one by one, the probe.
        self.device = asyncio.Lock()
        # The probe: a small image, encoded when nothing else shows whether the tower works.
        self.probe = (
            self.vision.preprocess(self.vision.load_image(sample_image_bytes()), "image")
            if "image" in self.vision.modalities
            else None
        )
        self.last_good_forward = time.monotonic()  # load_encoder's warm-up was one
        self.tower_fault: str | None = None  # why the probe failed, until a forward pass succeeds
        self.held: dict[ray.ObjectRef, asyncio.TimerHandle] = {}  # features kept reachable (_hold)

    def get_fingerprint(self) -> str:
        return self.fingerprint

    def get_modalities(self) -> dict[str, str]:
        """What this model serves ("image", and "video" where vLLM's processor takes videos),
        each with how its features reach the decoder: "embeddings" or "connector"."""
        return {m: self.vision.forms[m].delivery for m in self.vision.modalities}

    async def encode(
        self,
        key: str,
        pixels: PixelInputs | IrisError,
        tenant: str = "default",
        trace: dict[str, str] | None = None,
        name: str = "image",
    ) -> EncodedMedia | IrisError:
        """Features for `key` as an object-store reference. `pixels` is Preprocess's result
        (Serve resolves the pending response the ingress passed); its client error passes through,
        and so does the error of an item the tower refuses (named `name`, e.g. "image[0]").
        `trace`: the request's trace context (deployments/tracing.py)."""
        mark("encoder.start", key)
        if isinstance(pixels, IrisError):
            return pixels
        self.encoding += 1
        try:
            with tracing.span("encoder", trace) as span:
                encoded = await self._encode(key, pixels, tenant, name)
                if span.is_recording() and isinstance(encoded, EncodedMedia):
                    span.set_attribute("iris.num_tokens", encoded.num_tokens)  # no encoder.forward child: found cached
                return encoded
        finally:
            self.encoding -= 1

    async def _encode(self, key: str, pixels: PixelInputs, tenant: str, name: str) -> EncodedMedia | IrisError:
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

        waited = 0.0

        @asynccontextmanager
        async def turn():
            # The tenant's turn at a slot, taken before the key's lock (see get_or_compute_many). Large
            # images weigh more in the tenant's share: the forward pass costs by tokens.
            nonlocal waited
            async with self.gate.slot(tenant, pixels.num_tokens) as waited:
                self.queue_seconds.observe(waited, tenant)
                yield

        async def compute(_indexes: list[int]):
            queued = _Queued(pixels, cost, name)
            features = await self._forward(queued)
            if isinstance(features, IrisError):
                raise features  # this item's own; callers that joined its computation compute for themselves
            if queued.forward is not None:  # the batch this image rode in, inside this request's trace
                start_ns, end_ns, size, number = queued.forward
                tracing.ended_span(
                    "encoder.forward",
                    start_ns,
                    end_ns,
                    {"iris.encoder.batch_size": size, "iris.encoder.batch": number, "iris.queue_seconds": waited},
                )
            # The fingerprint in the value lets every reader check it against the key's.
            return [stamp_fingerprint(features, self.fingerprint)]

        try:
            (result,) = await self.cache.get_or_compute_many([key], compute, write_behind=True, admit=turn)
        except IrisError as err:
            return err
        finally:
            self.cache_metrics.export()
        features = result.features.cpu()
        ref = ray.put(features)
        self._hold(ref, result)
        encoded = EncodedMedia(key, features.num_tokens or pixels.num_tokens, ref)
        mark("encoder.end", key)
        return encoded

    def _hold(self, ref: ray.ObjectRef, result: ComputeResult) -> None:
        """Keep our reference to the features (the decoder borrows it) until the value is in Redis,
        where a decoder that cannot fetch the reference finds it; where it does not get there, for
        request_timeout_s, past the deadline of the request it was computed for."""
        if result.shared:
            return  # in Redis already
        self.held[ref] = asyncio.get_running_loop().call_later(self.request_timeout_s, self.held.pop, ref, None)
        if result.stored is not None:
            result.stored.add_done_callback(
                lambda stored: stored.cancelled() or not stored.result() or self._release(ref)
            )

    def _release(self, ref: ray.ObjectRef) -> None:
        timer = self.held.pop(ref, None)
        if timer is not None:
            timer.cancel()

    # Batch size and wait come from the config, set per replica in __init__.
    @serve.batch(batch_size_fn=lambda q: sum(i.cost for i in q))
    async def _forward(self, batch: list[_Queued]) -> list[Features | IrisError]:
        """Each item's features, or the error of an item the tower refuses: a batch whose forward
        pass raises is encoded again item by item, so that item fails alone, not its batch (other
        tenants' items included)."""
        start = time.perf_counter()
        mark("encoder.forward_start")
        try:
            features = await self._run([q.pixels for q in batch])
        except Exception as err:
            features = await self._one_by_one(batch, err)
        mark("encoder.forward_end")
        self.batch_seconds.observe(time.perf_counter() - start)
        self.batch_size.observe(len(batch))
        self.images_encoded += sum(not isinstance(f, IrisError) for f in features)
        self.batches += 1
        if tracing.enabled():
            end_ns = time.time_ns()
            start_ns = end_ns - int((time.perf_counter() - start) * 1e9)
            for q in batch:
                q.forward = (start_ns, end_ns, len(batch), self.batches)
        return features

    async def _run(self, batch: list[PixelInputs]) -> list[Features]:
        async with self.device:
            features = await asyncio.to_thread(self.vision.encode, batch)
        self.last_good_forward = time.monotonic()
        self.tower_fault = None
        return features

    async def _one_by_one(self, batch: list[_Queued], err: Exception) -> list[Features | IrisError]:
        """The items of a batch whose forward pass raised `err`, each encoded alone."""
        results: list[Features | Exception] = [err]
        if len(batch) > 1:
            results = []
            for item in batch:
                try:
                    results.extend(await self._run([item.pixels]))
                except Exception as item_err:
                    results.append(item_err)
        # An item fails by its own fault where the tower encodes others: its batch mates, else the probe.
        tower_works = any(not isinstance(r, Exception) for r in results) or await self._probe_works()
        return [
            self._refused(item, r, tower_works) if isinstance(r, Exception) else r for item, r in zip(batch, results)
        ]

    def _refused(self, item: _Queued, err: Exception, tower_works: bool) -> IrisError:
        modality = item.pixels.modality
        if tower_works and not isinstance(err, torch.cuda.OutOfMemoryError):
            self.items_refused += 1
            self.refused_total.inc()
            logger.warning(
                "the vision tower refused %s (%s: %s)", item.name, type(err).__name__, str(err)[:ERROR_TEXT_CHARS]
            )
            return bad_request(
                f"the vision encoder cannot encode this {modality}: "
                f"{type(err).__name__}: {str(err)[:ERROR_TEXT_CHARS]}",
                param=item.name,
                code=f"invalid_{modality}",
            )
        logger.error("forward pass failed for %s", item.name, exc_info=err)
        return server_error(
            f"the vision encoder failed ({type(err).__name__}); retry", code="encoder_unavailable", status_code=503
        )

    async def _probe_works(self) -> bool:
        """Whether the tower encodes the probe image now."""
        if self.probe is None:
            return False
        try:
            await self._run([self.probe])
        except Exception as err:
            self.tower_fault = f"{type(err).__name__}: {str(err)[:ERROR_TEXT_CHARS]}"
            logger.error("the vision tower fails on its probe image", exc_info=err)
            return False
        return True

    async def check_health(self) -> None:
        """Serve's health check: the tower encodes. Free while forward passes succeed; the probe image
        (one small forward pass) once none has for HEALTH_PROBE_S, or while the probe failed last."""
        if self.tower_fault is None and time.monotonic() - self.last_good_forward < HEALTH_PROBE_S:
            return
        if not await self._probe_works():
            raise RuntimeError(f"the vision tower fails on its probe image: {self.tower_fault}")

    def stats(self) -> dict:
        return {
            "images_encoded": self.images_encoded,
            "batches": self.batches,
            "encoding": self.encoding,
            "waiting": self.gate.waiting,
            "refused": self.items_refused,
            "held": len(self.held),
            "cache": self.cache.stats(),
        }

    async def __del__(self):
        # Serve calls this on graceful shutdown, once requests have drained: the Redis writes still
        # running behind responses finish first (bounded), so features computed here stay reachable
        # when the replica and its object-store references are gone.
        for timer in getattr(self, "held", {}).values():
            timer.cancel()
        if getattr(self, "cache", None) is not None:
            await self.cache.close(timeout_s=FLUSH_ON_SHUTDOWN_S)
