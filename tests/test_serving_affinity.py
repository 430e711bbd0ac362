"""Two LLMDecode replicas behind ImageAffinityRouter, deployed from serve_config.yaml
itself (so the router is loaded from its `request_router_class` string): every
repeat of an image reaches the replica that prefilled it (prefix-cache hit).
Costs two vLLM engines (~9 GB); kept in its own module so the app lives only here."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve

from tests.support.images import REFERENCE_TEXT, data_url, unique_png

ROOT = Path(__file__).resolve().parent.parent
APP = "iris-affinity"


@pytest.fixture(scope="module")
def affinity_app(iris_apps, tiny_checkpoint):
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    args = config.pop("args")
    args.update(model=tiny_checkpoint("llava"), engine_args={"max_model_len": 2048, "enforce_eager": True},
                cache={**args["cache"], "ttl_s": 3600})
    decode = next(d for d in config["deployments"] if d["name"] == "LLMDecode")
    assert decode["request_router_config"]["request_router_class"].endswith(":ImageAffinityRouter")
    del decode["autoscaling_config"]
    decode["num_replicas"] = 2
    with iris_apps.use(APP, args, route_prefix="/affinity", config=config) as app:
        yield app.url


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
    images = [data_url(unique_png()) for _ in range(6)]
    first = [_chat(affinity_app, url) for url in images]
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 0 for u in first), first  # new images
    repeats = [_chat(affinity_app, url) for _ in range(2) for url in images]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in repeats]
    assert all(c > 0 for c in cached), cached
    print(f"prefix hits on repeats: {sum(c > 0 for c in cached)}/{len(cached)}, cached tokens {cached}")
