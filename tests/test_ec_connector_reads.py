"""The EC connector's read paths (pipeline/model/ec_connector.py) never raise inside vLLM's
engine and honour only identifiers a client chose on purpose. The connector is built as vLLM
builds it, with a stand-in for the engine's config (dtype, extra config) and real vLLM
placeholder ranges; values come from the real Redis or a staging folder. No engine starts."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.multimodal.inputs import PlaceholderRange

from cache_service.codec import encode
from cache_service.features import Features
from cache_service.keys import content_hash, uuid_key
from pipeline.model.ec_connector import IrisECConnector, IrisECMetadata
from pipeline.model.ec_staging import staged_name
from tests.cache_fixtures import SHARED_REDIS_URL, free_port
from tests.test_cache_hostile import FP, HIDDEN, HOSTILE, META, TOKENS

# Values the connector may use although Iris's own readers refuse them: its check is what the
# engine needs (rows = the placeholder's, dtype, width, finite), not the meta's token count.
USABLE_BY_THE_ENGINE = {"shape_num_tokens_mismatch", "missing_num_tokens"}


def connector(role=ECConnectorRole.SCHEDULER, **extra) -> IrisECConnector:
    ec = SimpleNamespace(
        is_ec_producer=False, is_ec_consumer=True, ec_connector_extra_config=extra, mm_encoder_output_widths={}
    )
    return IrisECConnector(
        SimpleNamespace(ec_transfer_config=ec, model_config=SimpleNamespace(dtype=torch.bfloat16)), role
    )


def plane(namespace: str, url: str = SHARED_REDIS_URL) -> IrisECConnector:
    return connector(
        redis_url=url, namespace=namespace, fingerprint=FP, tenant="default", redis_timeout_s=0.2, backoff_initial_s=5
    )


def request(identifier: str, modality: str = "image"):
    feature = SimpleNamespace(identifier=identifier, modality=modality, mm_position=PlaceholderRange(3, TOKENS))
    return SimpleNamespace(request_id=uuid.uuid4().hex, mm_features=[feature])


def schedule(conn: IrisECConnector, identifier: str) -> bool:
    """Whether the connector claims the item (its features loaded, the tower skipped)."""
    req = request(identifier)
    assert conn.ensure_cache_available(req, 0) is True
    claimed = conn.has_cache_item(identifier)
    conn.update_state_after_alloc(req, 0)
    conn.request_finished(req)
    return claimed


def honest() -> bytes:
    return bytes(encode(Features({"image_embeds": torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)}, META)))


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_value_in_redis_is_refused_never_raised(case, namespace, raw_redis):
    conn = plane(namespace)
    raw_redis.set(uuid_key(FP, "default", case, namespace), HOSTILE[case][0])
    if case in USABLE_BY_THE_ENGINE:
        assert schedule(conn, f"iris:{case}") and conn.totals["loaded"] == 1
        return
    assert not schedule(conn, f"iris:{case}")  # the engine's own tower runs on it
    assert conn.totals == {"loaded": 0, "encoded": 1, "refused": 1}
    assert raw_redis.exists(uuid_key(FP, "default", case, namespace))  # this reader writes nothing


@pytest.mark.parametrize("case", ["meta_empty_list", "meta_nested_50000", "gigantic_shape_no_bytes", "nan_values"])
def test_a_hostile_staged_file_is_refused_never_raised(case, tmp_path):
    conn = connector(staging_dir=str(tmp_path))
    (tmp_path / staged_name("k")).write_bytes(HOSTILE[case][0])
    assert not schedule(conn, "k") and conn.totals["refused"] == 1


def test_an_unreadable_staged_file_is_refused(tmp_path):
    conn = connector(staging_dir=str(tmp_path))
    (tmp_path / staged_name("k")).mkdir()  # reading it raises IsADirectoryError, not FileNotFoundError
    assert not schedule(conn, "k") and conn.totals["refused"] == 1


def test_only_identifiers_with_the_iris_prefix_are_looked_up(namespace, raw_redis):
    """vLLM's identifier of an item sent without a uuid is the blake3 of model id and bytes:
    anyone with the image computes it. Stored under that text as a uuid, it must not be served;
    neither must any uuid a client sent without the `iris:` prefix."""
    conn = plane(namespace)
    image_hash = content_hash(b"model id and the image's bytes")
    for uuid_ in (image_hash, "photo-1"):
        raw_redis.set(uuid_key(FP, "default", uuid_, namespace), honest())
    assert not schedule(conn, image_hash)
    assert not schedule(conn, "photo-1")
    assert conn.totals == {"loaded": 0, "encoded": 2, "refused": 0}
    assert schedule(conn, "iris:photo-1")  # the client chose Iris's features on purpose
    assert not schedule(conn, "iris:")  # an empty uuid is no uuid
    assert conn.totals["loaded"] == 1


def test_the_iris_apps_own_keys_still_reach_its_engine_through_staging(tmp_path):
    """LLMDecode names items by their cache keys (any namespace, `iris:` or not) and stages
    them; its engine's connector has no feature plane, so no prefix applies there."""
    from pipeline.model.ec_staging import FeatureStaging

    staging = FeatureStaging(tmp_path)
    key = uuid_key(FP, "acme", "photo-1", "prod")
    staging.stage(key, Features({"image_embeds": torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)}, META))
    conn = connector(staging_dir=str(staging.dir))
    assert schedule(conn, key) and conn.totals["loaded"] == 1
    staging.close()


def test_a_dead_redis_costs_the_scheduler_one_try_per_backoff():
    conn = plane("iris-test-dead", url=f"redis://127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    assert not any(schedule(conn, f"iris:u{i}") for i in range(100))
    assert time.monotonic() - started < 1.0 and conn.totals["encoded"] == 100


def test_the_worker_side_skips_what_is_not_a_tensor():
    conn = connector(role=ECConnectorRole.WORKER, staging_dir="/nonexistent")
    values = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)
    conn.bind_connector_metadata(IrisECMetadata({"good": values, "bad": [1, 2]}))  # type: ignore[dict-item]
    cache: dict = {}
    conn.start_load_caches(cache)
    assert set(cache) == {"good"} and torch.equal(cache["good"], values)
