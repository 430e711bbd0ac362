"""ImageAffinityRouter inside Serve's own routing loop (probes, ranks, queue-length
cache), with Ray's in-memory FakeRunningReplica instead of replica actors: no
cluster needed. Uses Serve's private test helpers, as Serve's own router tests do."""

import dataclasses
import uuid
from collections import Counter

import pytest
from ray.serve._private.common import DeploymentHandleSource, RequestMetadata
from ray.serve._private.test_utils import FAKE_REPLICA_DEPLOYMENT_ID, FakeRunningReplica
from ray.serve.request_router import PendingRequest

from deployments.decode_stream import session_of
from deployments.image_affinity_router import ImageAffinityRouter
from pipeline.stage_io import DecodeCall

MAX_ONGOING = 4


def _router(num_replicas=3, **kwargs):
    router = ImageAffinityRouter(
        deployment_id=FAKE_REPLICA_DEPLOYMENT_ID,
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**kwargs)
    replicas = [FakeRunningReplica(f"r{i}", max_ongoing_requests=MAX_ONGOING) for i in range(num_replicas)]
    for replica in replicas:
        replica.set_queue_len_response(0)
    router.update_replicas(replicas)
    return router, replicas


def _decode_request(image_keys):
    """A real DecodeCall, whatever its other fields are today."""
    values = {
        f.name: None
        for f in dataclasses.fields(DecodeCall)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    return DecodeCall(**{**values, "media_keys": image_keys})


async def _route(router, image_keys):
    """As the ingress calls the decoder: the request's routing key in Serve's `session_id`."""
    rid, request = uuid.uuid4().hex, _decode_request(image_keys)
    pending = PendingRequest(
        args=[request],
        kwargs={},
        metadata=RequestMetadata(request_id=rid, internal_request_id=rid, session_id=session_of(request)),
    )
    replica = await router._choose_replica_for_request(pending)
    return replica.replica_id.unique_id


async def test_same_image_same_replica_from_every_caller():
    """Two routers stand for two ingress processes: they agree with no shared state."""
    first, _ = _router()
    second, _ = _router()
    owners = set()
    for i in range(30):
        key = f"img-{i}"
        picks = {await _route(first, [key, "other"]) for _ in range(3)} | {await _route(second, [key])}
        assert len(picks) == 1, (key, picks)
        owners |= picks
    assert len(owners) == 3  # and the images are spread over all replicas


async def test_saturated_replica_spills_over():
    router, replicas = _router()
    key = "img-hot"
    owner = await _route(router, [key])
    busy = next(r for r in replicas if r.replica_id.unique_id == owner)
    busy.set_queue_len_response(MAX_ONGOING)  # what its probe answers now
    router.replica_queue_len_cache.update(busy.replica_id, MAX_ONGOING)
    assert await _route(router, [key]) != owner
    busy.set_queue_len_response(0)
    router.replica_queue_len_cache.update(busy.replica_id, 0)
    assert await _route(router, [key]) == owner


async def test_load_bound_moves_a_hot_image_off_its_replica():
    router, replicas = _router(num_replicas=2, max_load_factor=1.0)
    owner = await _route(router, ["img-hot"])
    other = next(r for r in replicas if r.replica_id.unique_id != owner)
    by_id = {r.replica_id.unique_id: r for r in replicas}
    # owner runs 2, the other 0: with factor 1.0 the cap is ceil(3 / 2) = 2, owner would hold 3
    router.replica_queue_len_cache.update(by_id[owner].replica_id, 2)
    router.replica_queue_len_cache.update(other.replica_id, 0)
    assert await _route(router, ["img-hot"]) == other.replica_id.unique_id


async def test_text_only_requests_are_spread():
    router, _ = _router()
    counts = Counter([await _route(router, []) for _ in range(150)])
    assert set(counts) == {"r0", "r1", "r2"}
    assert min(counts.values()) > 20, counts


def test_the_session_is_the_first_image_key():
    assert session_of(_decode_request(["a", "b"])) == "a"
    assert session_of(_decode_request(["", "b"])) == "b"
    assert session_of(_decode_request([])) == ""


@pytest.mark.parametrize("kwargs", [{"max_load_factor": 0.5}, {"max_load_factor": "1.5"}, {"imbalance": 3}])
def test_bad_kwargs_are_rejected(kwargs):
    with pytest.raises(ValueError, match="ImageAffinityRouter"):
        _router(**kwargs)
