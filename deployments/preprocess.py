"""Preprocess (CPU only): decode, convert and resize/normalise images, then hand
the pixels straight to the VisionEncoder, so they never travel back through the ingress."""

from __future__ import annotations

import asyncio
import time

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import IrisConfig
from deployments.metrics import latency_histogram
from pipeline.errors import IrisError, bad_request
from pipeline.families import adapter_for
from pipeline.media import decode_image
from pipeline.models.source import resolve_model
from pipeline.stage_io import EncodedImage, ImageJob


@serve.deployment(ray_actor_options={"num_cpus": 1})
class Preprocess:
    def __init__(self, config: IrisConfig, encoder: DeploymentHandle):
        self.adapter = adapter_for(resolve_model(config.model))  # configs only: no weights here
        self.adapter.load_preprocessing()  # imports + warm-up now, not racing in the first burst
        self.limits = config.media
        self.encoder = encoder
        self.seconds = latency_histogram("iris_preprocess_seconds", "Seconds to decode and preprocess one image")
        self.images_preprocessed = 0

    def _pixels(self, job: ImageJob):
        param = f"image[{job.index}]"
        image = decode_image(job.data, self.limits, param=param)
        try:
            return self.adapter.preprocess(image)
        except ValueError as err:  # e.g. Qwen2-VL refuses aspect ratios above 200
            raise bad_request(f"image cannot be preprocessed for this model: {err}", param=param,
                              code="invalid_image") from err

    async def _one(self, job: ImageJob, inline: bool) -> EncodedImage:
        start = time.perf_counter()
        pixels = await asyncio.to_thread(self._pixels, job)
        self.seconds.observe(time.perf_counter() - start)
        self.images_preprocessed += 1
        encoded = await self.encoder.encode.remote(job.key, pixels, inline)
        encoded.index = job.index
        return encoded

    async def encode_images(self, jobs: list[ImageJob], inline: bool = False) -> list[EncodedImage] | IrisError:
        """Encode all jobs; a client error (bad image) is returned, not raised, for the ingress to send."""
        try:
            return list(await asyncio.gather(*(self._one(job, inline) for job in jobs)))
        except IrisError as err:
            return err

    def stats(self) -> dict:
        return {"images_preprocessed": self.images_preprocessed}
