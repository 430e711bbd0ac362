"""An encode lost with its replica (issue 42): the ingress's MediaFeatures over real Serve handles,
to stand-in stages (no model: the loss, not the features, is what is tested). A VisionEncoder
replica that dies under a request's encode (kill -9, OOM, its node lost) fails that encode with
EncodeLost, not with Ray's error, and `encode_again` computes it on a replica that lives; the
ingress does that once per request (deployments/ingress.py `_open`)."""

from __future__ import annotations

import os
import signal

import pytest
import ray
from ray import serve

from deployments.config import IrisConfig
from deployments.media_features import EncodeLost, MediaFeatures
from deployments.metrics import RequestMetrics
from pipeline.api.media_parts import MediaItem
from pipeline.stage_io import EncodedMedia
from tests.cache_fixtures import SHARED_REDIS_URL
from tests.support.images import data_url, unique_png

APP = "iris-encode-lost"


@serve.deployment
class Pixels:
    def pixels(self, job) -> str:
        return job.key


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0})
class DyingEncoder:
    """The first encode across both replicas ends its process, as kill -9 would; the rest answer."""

    def __init__(self, marker: str):
        self.marker = marker

    def get_fingerprint(self) -> str:
        return "f" * 16

    def get_modalities(self) -> dict[str, str]:
        return {"image": "embeddings"}

    def encode(self, key, pixels, tenant="default", trace=None, name="image") -> EncodedMedia:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return EncodedMedia(key, 1, ray.put(f"features of {pixels}"))
        os.kill(os.getpid(), signal.SIGKILL)  # the replica dies with the encode in hand


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Stages:
    """The app that holds both stand-ins (its ingress, as it were)."""

    def __init__(self, preprocess, encoder):
        self.preprocess, self.encoder = preprocess, encoder


@pytest.fixture
def stages(serve_instance, tmp_path):
    serve.run(Stages.bind(Pixels.bind(), DyingEncoder.bind(str(tmp_path / "died"))), name=APP, route_prefix=None)
    yield serve.get_deployment_handle("Pixels", app_name=APP), serve.get_deployment_handle("DyingEncoder", APP)
    serve.delete(APP)


async def test_an_encode_lost_with_its_replica_is_computed_again(stages, namespace):
    preprocess, encoder = stages
    config = IrisConfig(model="builtin:tiny-llava", cache={"redis_url": SHARED_REDIS_URL, "namespace": namespace})
    features = MediaFeatures(config, preprocess, encoder, RequestMetrics())
    part = {"type": "image_url", "image_url": {"url": data_url(unique_png())}}
    item = MediaItem(0, "image", 0, part["image_url"]["url"], None, part, "messages[0].content[0]")

    media = await features.resolve([item], "default")
    assert media.computed == 1
    with pytest.raises(EncodeLost) as lost:
        await media.take_encodes()
    assert lost.value.key == item.key
    assert any(isinstance(e, ray.exceptions.RayActorError) for e in _causes(lost.value))

    await features.encode_again(media)
    [encoded] = await media.take_encodes()
    assert isinstance(encoded, EncodedMedia) and encoded.key == item.key
    assert await media.delivered[item.key] == encoded  # what LLMDecode is handed: the live replica's answer
    assert await encoded.features_ref == f"features of {item.key}"
    await features.cache.close()


def _causes(err):
    while err is not None:
        yield err
        err = err.__cause__ or getattr(err, "cause", None)
