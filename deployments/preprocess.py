"""Preprocess (CPU only): decode, convert and resize/normalise one image, or decode
and sample one video's frames (vLLM's video loader) and process them.

The ingress passes this call's pending response straight into the
VisionEncoder's call (Serve model composition), so the pixels go to the encoder
through the object store and this replica is free as soon as they are ready,
whatever the encoder's queue."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time

import ray
import torch
from PIL import Image
from ray import serve

from deployments import tracing
from deployments.config import IrisConfig
from deployments.metrics import StageQueueMetrics, latency_histogram
from deployments.stage_trace import mark
from pipeline.errors import IrisError, bad_request
from pipeline.media.decode import check_video, decode_image
from pipeline.model.vision_model import PixelInputs
from pipeline.stage_io import MediaJob
from pipeline.tenancy.fair_gate import FairGate


@serve.deployment(ray_actor_options={"num_cpus": 1})
class Preprocess:
    def __init__(self, config: IrisConfig):
        if config.preprocess_cpu_threads:
            torch.set_num_threads(config.preprocess_cpu_threads)
        tracing.setup(config.tracing, "preprocess")
        # vLLM's processor only: no weights here.
        self.vision = config.vision_model()
        self.vision.preprocess(Image.new("RGB", (64, 64)))  # lazy imports now, not racing in the first burst
        self.limits = config.media
        # Decodes at once; further items wait for their tenant's turn, not in arrival order.
        slots = config.fair_sharing.preprocess_slots
        if slots == "auto":
            slots = max(1, math.ceil(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
        self.gate = FairGate(slots, config.fair_sharing.enabled, config.fair_sharing.tenant_weights)
        self.queue_seconds = StageQueueMetrics("preprocess")
        self.seconds = latency_histogram(
            "iris_preprocess_seconds", "Seconds to decode and preprocess one image or video"
        )
        self.images_preprocessed = 0
        self.abandoned = 0  # calls whose caller left while they were working
        self.preprocessing = 0  # pixels() calls in progress (waiting for a slot or working)

    def _pixels(self, job: MediaJob, cancelled: threading.Event):
        m = job.modality  # one the model takes: the ingress refused the others
        if m == "video":
            check_video(job.data, self.limits, param=job.name)  # from the header: nothing decoded yet
            try:
                media = self.vision.load_video(job.data)
            except Exception as err:  # any decoder failure on untrusted bytes is the client's problem
                raise bad_request(f"could not decode video: {err}", param=job.name, code="invalid_video") from None
        else:
            media = decode_image(job.data, self.limits, self.vision.image_io, param=job.name)
        mark("preprocess.decoded", job.key)
        if cancelled.is_set():  # the caller left while the bytes were decoded: skip the processor
            raise asyncio.CancelledError
        try:
            pixels = self.vision.preprocess(media, m)
        except ValueError as err:  # e.g. Qwen2-VL refuses aspect ratios above 200
            raise bad_request(
                f"{m} cannot be preprocessed for this model: {err}", param=job.name, code=f"invalid_{m}"
            ) from err
        if job.keep_source:
            pixels.source = job.data
        return pixels

    async def pixels(self, job: MediaJob) -> PixelInputs | IrisError:
        """A client error (bad image) is returned, not raised: it reaches the ingress as a value."""
        mark("preprocess.queued", job.key)
        self.preprocessing += 1
        try:
            with tracing.span("preprocess", job.trace) as span:
                async with self.gate.slot(job.tenant) as waited:
                    self.queue_seconds.observe(waited, job.tenant)
                    if span.is_recording():
                        span.set_attributes(
                            {"iris.modality": job.modality, "iris.bytes": len(job.data), "iris.queue_seconds": waited}
                        )
                    return await self._preprocess(job)
        finally:
            self.preprocessing -= 1

    async def _preprocess(self, job: MediaJob) -> PixelInputs | IrisError:
        start = time.perf_counter()
        mark("preprocess.start", job.key)
        cancelled = threading.Event()
        work = asyncio.ensure_future(asyncio.to_thread(self._pixels, job, cancelled))
        try:
            # A thread cannot be interrupted: when the caller leaves, the decode in progress
            # finishes, the steps after it are skipped, and the replica counts as busy until then.
            pixels = await asyncio.shield(work)
        except IrisError as err:
            return err
        except asyncio.CancelledError:
            cancelled.set()
            self.abandoned += 1
            with contextlib.suppress(BaseException):
                await work
            raise
        self.seconds.observe(time.perf_counter() - start)
        self.images_preprocessed += 1
        mark("preprocess.end", job.key)
        return pixels

    def stats(self) -> dict:
        return {
            "images_preprocessed": self.images_preprocessed,
            "preprocessing": self.preprocessing,
            "abandoned": self.abandoned,
            "waiting": self.gate.waiting,
            "torch_threads": torch.get_num_threads(),
        }
