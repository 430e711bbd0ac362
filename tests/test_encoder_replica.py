"""VisionEncoder replicas in this process, without Serve (Ray for its object store only), on the
tiny LLaVA and the shared Redis (issue 42, the encoder's part): an item the tower refuses fails
alone in its batch, the health check, features kept reachable until they are in Redis, pending
Redis writes flushed on graceful shutdown, and one forward pass per key across two replicas when
one of them has a backlog longer than the single-flight wait."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import threading
import time
from types import SimpleNamespace

import pytest
import redis
import torch
from ray import serve

from cache_service.keys import item_key
from deployments.config import IrisConfig
from deployments.encoder import HEALTH_PROBE_S, VisionEncoder
from pipeline.errors import IrisError
from pipeline.stage_io import EncodedMedia
from tests.cache_fixtures import SHARED_REDIS_URL, assert_same_features, private_redis
from tests.support.apps import metrics_text
from tests.support.images import unique_png


@pytest.fixture
async def make_encoder(ray_cluster, tiny_checkpoint, namespace, monkeypatch):
    """Factory of VisionEncoders (each a replica of its own: model, cache; Serve's batch queue is the
    class's, one per process as in a replica) in this test's namespace; shut down at teardown as Serve does."""
    # What Serve's batching asks of the replica it runs in (its max_ongoing_requests, Serve's default).
    replica = SimpleNamespace(_deployment_config=SimpleNamespace(max_ongoing_requests=5))
    monkeypatch.setattr(serve, "get_replica_context", lambda: replica)
    made: list[VisionEncoder] = []

    def make(cache: dict | None = None, **settings) -> VisionEncoder:
        config = IrisConfig(
            model=tiny_checkpoint("llava"),
            **settings,
            cache={"redis_url": SHARED_REDIS_URL, "namespace": namespace, **(cache or {})},
        )
        encoder = VisionEncoder.func_or_class(config)
        made.append(encoder)
        return encoder

    yield make
    for encoder in made:
        await shut_down(encoder)
        await encoder.cache.close()
    # The batch queue this process made lives in the class's `_forward` wrapper, holding this loop's
    # futures: dropped, or a later serve.run from this process could not pickle the deployment.
    VisionEncoder.func_or_class._forward.set_max_batch_size.__self__._queue = None


async def shut_down(encoder: VisionEncoder) -> None:
    """What Serve's replica does on graceful shutdown, once requests have drained (call_destructor)."""
    destructor = getattr(encoder, "__del__", None)
    if destructor is not None:
        result = destructor()
        if inspect.iscoroutine(result):
            await result


class ForwardPasses:
    """Counts the tower's forward passes (VisionModel.encode calls) and may run `before` first."""

    def __init__(self, encoder: VisionEncoder, before=None):
        self.encode, self.before, self.calls = encoder.vision.encode, before, []
        encoder.vision.encode = self

    def __call__(self, batch):
        self.calls.append(len(batch))
        if self.before is not None:
            self.before()
        return self.encode(batch)


class BrokenDevice(torch.nn.Module):
    """A vision tower on a device that stopped working."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def pixels_of(encoder: VisionEncoder, data: bytes):
    return encoder.vision.preprocess(encoder.vision.load_image(data))


def key_of(encoder: VisionEncoder, tenant: str, data: bytes) -> str:
    return item_key(
        encoder.fingerprint, tenant, None, data, namespace=encoder.cache.config.namespace, content_owner=tenant
    )


def refused_by_the_tower(pixels):
    """Pixels of the item's own form that LLaVA's tower refuses: two colour channels, not three."""
    item = type(pixels.item)(dict(pixels.item))
    values = item["pixel_values"]
    item["pixel_values"] = dataclasses.replace(values, data=values.data[:2].clone())
    return dataclasses.replace(pixels, item=item)


async def test_an_item_the_tower_refuses_fails_alone_in_its_batch(make_encoder):
    encoder = make_encoder(encoder_batch_size=2, encoder_batch_wait_s=1.0)
    good_data, bad_data = unique_png(1), unique_png(2)
    good = pixels_of(encoder, good_data)
    bad = refused_by_the_tower(pixels_of(encoder, bad_data))
    refused, encoded = await asyncio.gather(
        encoder.encode(key_of(encoder, "tenant-a", bad_data), bad, "tenant-a", None, "image[1]"),
        encoder.encode(key_of(encoder, "tenant-b", good_data), good, "tenant-b", None, "image[0]"),
        return_exceptions=True,
    )
    assert isinstance(encoded, EncodedMedia), encoded
    assert encoder.batches == 1  # one batch held both
    [alone] = encoder.vision.encode([good])
    assert torch.equal((await encoded.features_ref).tensors["image_embeds"], alone.tensors["image_embeds"])
    assert isinstance(refused, IrisError), refused
    assert (refused.status_code, refused.code, refused.param) == (400, "invalid_image", "image[1]")
    assert "cannot encode this image" in refused.message
    assert encoder.stats()["refused"] == 1 and encoder.images_encoded == 1

    # Alone in its batch: the probe image says the tower works, so the item is at fault.
    lone = await encoder.encode(key_of(encoder, "tenant-a", bad_data), bad, "tenant-a", None, "image[0]")
    assert isinstance(lone, IrisError) and lone.status_code == 400 and encoder.stats()["refused"] == 2
    await encoder.check_health()
    # Also a Prometheus counter (this process's metrics reach the node's exporter within seconds).
    deadline = time.monotonic() + 60
    while "iris_encoder_items_refused" not in metrics_text():
        assert time.monotonic() < deadline, "iris_encoder_items_refused not exported"
        await asyncio.sleep(1)


async def test_health_check_probes_the_tower_only_when_nothing_shows_it_works(make_encoder):
    encoder = make_encoder()
    passes = ForwardPasses(encoder)
    await encoder.check_health()
    assert passes.calls == []  # the load-time warm-up was a forward pass a moment ago
    encoder.last_good_forward -= HEALTH_PROBE_S + 1  # idle since
    await encoder.check_health()
    assert passes.calls == [1]  # the probe image
    await encoder.check_health()
    assert passes.calls == [1]

    tower = encoder.vision.model.vision_tower
    encoder.vision.model.vision_tower = BrokenDevice()
    data = unique_png(3)
    failed = await encoder.encode(key_of(encoder, "t", data), pixels_of(encoder, data), "t", None, "image[0]")
    assert isinstance(failed, IrisError), failed
    assert (failed.status_code, failed.code) == (503, "encoder_unavailable")  # not the image's fault
    with pytest.raises(RuntimeError, match="illegal memory access"):
        await encoder.check_health()
    encoder.vision.model.vision_tower = tower
    await encoder.check_health()  # the probe passes again
    assert isinstance(await encoder.encode(key_of(encoder, "t", data), pixels_of(encoder, data), "t"), EncodedMedia)


async def test_features_stay_referenced_until_they_are_in_redis(make_encoder, raw_redis):
    encoder = make_encoder()
    data = unique_png(4)
    key = key_of(encoder, "t", data)
    encoded = await encoder.encode(key, pixels_of(encoder, data), "t")
    assert isinstance(encoded, EncodedMedia)
    for _ in range(100):  # the write behind the response
        if not encoder.held:
            break
        await asyncio.sleep(0.05)
    assert not encoder.held and raw_redis.exists(key)  # Redis has them now; the reference is a shortcut

    # No Redis: the reference is all there is, kept past the request's deadline (request_timeout_s).
    alone = make_encoder(cache={"redis_url": "redis://127.0.0.1:1"}, request_timeout_s=1.0)
    encoded = await alone.encode(key, pixels_of(alone, data), "t")
    assert list(alone.held) == [encoded.features_ref]
    await asyncio.sleep(0.5)
    assert list(alone.held) == [encoded.features_ref]
    await asyncio.sleep(0.8)
    assert not alone.held


async def test_graceful_shutdown_flushes_the_redis_writes_behind_responses(make_encoder):
    with private_redis("--enable-debug-command", "yes") as slow:
        client = redis.Redis.from_url(slow.url)
        # Redis busy as the forward pass runs: the response comes back before the write.
        busy = threading.Thread(target=lambda: client.execute_command("DEBUG", "SLEEP", "1.0"))
        encoder = make_encoder(cache={"redis_url": slow.url, "redis_timeout_s": 5})
        assert await encoder.cache.ping()
        ForwardPasses(encoder, before=lambda: (busy.start(), time.sleep(0.1)))
        data = unique_png(5)
        key = key_of(encoder, "t", data)
        assert isinstance(await encoder.encode(key, pixels_of(encoder, data), "t"), EncodedMedia)
        assert encoder.cache.stats()["l2_bytes_written"] == 0  # the write waits for Redis
        await shut_down(encoder)
        assert encoder.cache.stats()["l2_bytes_written"] > 0
        assert client.exists(key)
        busy.join()


async def test_a_backlogged_replica_does_not_encode_again_what_another_replica_encoded(make_encoder):
    """Replica `busy` has every slot taken for longer than the single-flight wait and the lock's TTL; a
    request for the same image on `idle` is encoded there, and `busy` finds it once its turn comes."""
    settings = {
        "cache": {"single_flight_wait_s": 0.3, "single_flight_poll_s": 0.02, "lock_ttl_s": 0.6},
        "encoder_batch_wait_s": 0.01,
    }
    busy, idle = make_encoder(**settings), make_encoder(**settings)
    data = unique_png(6)
    key, pixels = key_of(busy, "t", data), pixels_of(busy, data)

    async def backlog():
        async with contextlib.AsyncExitStack() as slots:
            for _ in range(busy.gate.capacity):
                await slots.enter_async_context(busy.gate.slot("others"))
            await asyncio.sleep(1.5)

    holding = asyncio.ensure_future(backlog())
    await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(busy.encode(key, pixels, "t"))
    await asyncio.sleep(0.1)
    from_idle = await idle.encode(key, pixels, "t")
    from_busy = await queued
    await holding
    assert isinstance(from_idle, EncodedMedia) and isinstance(from_busy, EncodedMedia)
    assert (busy.images_encoded, idle.images_encoded) == (0, 1)
    assert_same_features(await from_idle.features_ref, await from_busy.features_ref)
