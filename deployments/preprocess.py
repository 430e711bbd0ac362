"""Preprocess (CPU only): decode, convert and resize/normalise one image.

The ingress passes this call's pending response straight into the
VisionEncoder's call (Serve model composition), so the pixels go to the encoder
through the object store and this replica is free as soon as they are ready,
whatever the encoder's queue."""

from __future__ import annotations

import asyncio
import time

from PIL import Image
from ray import serve

from deployments.config import IrisConfig
from deployments.metrics import latency_histogram
from pipeline.errors import IrisError, bad_request
from pipeline.media import decode_image
from pipeline.stage_io import ImageJob
from pipeline.stage_trace import mark
from pipeline.vision_model import PixelInputs


@serve.deployment(ray_actor_options={"num_cpus": 1})
class Preprocess:
    def __init__(self, config: IrisConfig):
        # vLLM's processor only: no weights here.
        self.vision = config.vision_model()
        self.vision.preprocess(Image.new("RGB", (64, 64)))  # lazy imports now, not racing in the first burst
        self.limits = config.media
        self.seconds = latency_histogram("iris_preprocess_seconds", "Seconds to decode and preprocess one image")
        self.images_preprocessed = 0
        self.preprocessing = 0  # pixels() calls in progress

    def _pixels(self, job: ImageJob):
        param = f"image[{job.index}]"
        image = decode_image(job.data, self.limits, param=param)
        try:
            return self.vision.preprocess(image)
        except ValueError as err:  # e.g. Qwen2-VL refuses aspect ratios above 200
            raise bad_request(f"image cannot be preprocessed for this model: {err}", param=param,
                              code="invalid_image") from err

    async def pixels(self, job: ImageJob) -> PixelInputs | IrisError:
        """A client error (bad image) is returned, not raised: it reaches the ingress as a value."""
        start = time.perf_counter()
        mark("preprocess.start", job.key)
        self.preprocessing += 1
        try:
            pixels = await asyncio.to_thread(self._pixels, job)
        except IrisError as err:
            return err
        finally:
            self.preprocessing -= 1
        self.seconds.observe(time.perf_counter() - start)
        self.images_preprocessed += 1
        mark("preprocess.end", job.key)
        return pixels

    def stats(self) -> dict:
        return {"images_preprocessed": self.images_preprocessed, "preprocessing": self.preprocessing}
