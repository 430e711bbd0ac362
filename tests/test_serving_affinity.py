"""Two LLMDecode replicas behind ImageAffinityRouter, deployed from serve_config.yaml
itself (so the router is loaded from its `request_router_class` string): every
repeat of an image reaches the replica that prefilled it (prefix-cache hit).
Costs two vLLM engines (~9 GB); kept in its own module so the app lives only here."""

from __future__ import annotations

import copy
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve

from tests.support.images import REFERENCE_TEXT
from tests.test_serving import _delete_namespace, _unique_png
from tests.support.images import data_url

ROOT = Path(__file__).resolve().parent.parent
APP = "iris-affinity"


@pytest.fixture(scope="module")
def affinity_app(serve_instance, tiny_checkpoint):
    from ray.serve._private.api import serve_start  # noqa: F401  (Serve is already started by serve_instance)
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = copy.deepcopy(config["applications"][0])
    namespace = f"iris-test-{uuid.uuid4().hex[:12]}"
    app.update(name=APP, route_prefix="/affinity")
    app["args"].update(model=tiny_checkpoint("llava"), engine_args={"max_model_len": 2048, "enforce_eager": True},
                       cache={**app["args"]["cache"], "namespace": namespace, "ttl_s": 3600})
    decode = next(d for d in app["deployments"] if d["name"] == "LLMDecode")
    assert decode["request_router_config"]["request_router_class"].endswith(":ImageAffinityRouter")
    del decode["autoscaling_config"]
    decode["num_replicas"] = 2
    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))
    deadline = time.monotonic() + 600
    while serve.status().applications.get(APP) is None or serve.status().applications[APP].status != "RUNNING":
        status = serve.status().applications.get(APP)
        assert status is None or status.status not in ("DEPLOY_FAILED", "UNHEALTHY"), status
        assert time.monotonic() < deadline, status
        time.sleep(2)
    yield f"{serve_instance}/affinity"
    serve.delete(APP)
    _delete_namespace(namespace)


def _chat(base: str, url: str) -> dict:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": REFERENCE_TEXT}]}],
            "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_two_replicas_both_run(affinity_app):
    replicas = serve.status().applications[APP].deployments["LLMDecode"].replica_states
    assert replicas.get("RUNNING") == 2, replicas


def test_every_repeat_of_an_image_hits_the_prefix_cache(affinity_app):
    """With Serve's default router each repeat would have an even chance of landing
    on the replica that never saw the image (0 cached tokens)."""
    images = [data_url(_unique_png()) for _ in range(6)]
    first = [_chat(affinity_app, url) for url in images]
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 0 for u in first), first  # new images
    repeats = [_chat(affinity_app, url) for _ in range(2) for url in images]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in repeats]
    assert all(c > 0 for c in cached), cached
    print(f"prefix hits on repeats: {sum(c > 0 for c in cached)}/{len(cached)}, cached tokens {cached}")
