"""Iris's feature cache as the encoder tier of a plain `vllm serve`: the same EC connector
LLMDecode's engines use (pipeline/model/ec_connector.py), pointed at the feature plane, lets a
monolithic `vllm serve --ec-transfer-config ...` take the features Iris computed for a
client's uuid instead of running its own tower, when the client sends that uuid as `iris:<uuid>`
(a bare identifier is never looked up: the server serves one tenant). Its counters are read from the server's own
Prometheus metrics (vLLM's EC connector stats), not from its logs."""

from __future__ import annotations

import json
import re
import time
import uuid

import httpx
import pytest

from bench.harness.systems import SERVED_NAME as NAME
from pipeline.model.ec_connector import CONNECTOR_NAME, MODULE_PATH, UUID_PREFIX
from tests.support.apps import reference_args
from tests.support.images import REFERENCE_TEXT, data_url, png_bytes
from tests.support.namespaces import SHARED_REDIS_URL

COUNTER = re.compile(r"^vllm:iris_ec_(loaded|encoded|refused)_items_total\{[^}]*\} ([0-9.e+]+)$", re.M)


@pytest.fixture(scope="module")
def iris(iris_apps, tiny_checkpoint):
    """The LLaVA reference app (test_api_parity's and test_families', handed on: conftest's order)."""
    with iris_apps.use(
        "iris-fam-llava-float32", reference_args(tiny_checkpoint("llava"), "float32", NAME), keep=True
    ) as app:
        yield app


@pytest.fixture(scope="module")
def plain_vllm(iris, tiny_checkpoint, tmp_path_factory):
    """`vllm serve` on the same checkpoint, its EC connector reading Iris's Redis by uuid."""
    from bench.harness.systems import EngineSettings, _start_vllm

    model = httpx.get(f"{iris.url}/iris/stats", timeout=30).json()["model"]
    ec = {
        "ec_connector": CONNECTOR_NAME,
        "ec_connector_module_path": MODULE_PATH,
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {
            "redis_url": SHARED_REDIS_URL,
            "namespace": iris.namespace,
            "fingerprint": model["fingerprint"],
            "tenant": "default",
        },
    }
    engine = EngineSettings(
        tiny_checkpoint("llava"),
        "float32",
        2048,
        2,
        0,
        ("--seed", "0", "--enforce-eager", "--ec-transfer-config", json.dumps(ec)),
    )
    system = _start_vllm(1, engine, tmp_path_factory.mktemp("vllm-ec"), time.monotonic(), 600)
    try:
        yield system.base_urls[0]
    finally:
        system.stop()


def _chat(base: str, image: str, uuid_: str | None) -> dict:
    part = {"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}}
    if uuid_:
        part["uuid"] = uuid_
    body = {
        "model": NAME,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": REFERENCE_TEXT}]}],
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(reply: dict) -> list:
    return [(t["token"], t["bytes"]) for t in reply["choices"][0]["logprobs"]["content"]]


def _counters(base: str) -> dict[str, float]:
    counts = {"loaded": 0.0, "encoded": 0.0, "refused": 0.0}
    for name, value in COUNTER.findall(httpx.get(f"{base}/metrics", timeout=30).text):
        counts[name] += float(value)
    return counts


def _counted(base: str, before: dict[str, float], items: int) -> dict[str, float]:
    """The counters' change once `items` items were counted (vLLM's stat loggers run after the answer)."""
    deadline = time.monotonic() + 30
    while True:
        now = _counters(base)
        change = {k: now[k] - before[k] for k in now}
        if sum(change.values()) >= items or time.monotonic() > deadline:
            return change
        time.sleep(0.2)


def test_plain_vllm_serve_takes_the_features_iris_computed(iris, plain_vllm, raw_redis, vllm_server):
    from cache_service.keys import uuid_key

    model = httpx.get(f"{iris.url}/iris/stats", timeout=30).json()["model"]
    marker = f"plain-{uuid.uuid4().hex[:8]}"
    ours = _chat(iris.url, "wide", marker)
    key = uuid_key(model["fingerprint"], "default", marker, iris.namespace)
    deadline = time.monotonic() + 30
    while not raw_redis.exists(key):  # the encoder writes behind its answer
        assert time.monotonic() < deadline, "Iris's features never reached Redis"
        time.sleep(0.1)

    before = _counters(plain_vllm)
    bare = _chat(plain_vllm, "wide", marker)  # without the prefix: not looked up, its tower runs
    assert _counted(plain_vllm, before, 1) == {"loaded": 0, "encoded": 1, "refused": 0}
    before = _counters(plain_vllm)
    theirs = _chat(plain_vllm, "wide", f"{UUID_PREFIX}{marker}")
    assert _counted(plain_vllm, before, 1) == {"loaded": 1, "encoded": 0, "refused": 0}  # its tower did not run
    assert _tokens(theirs) == _tokens(ours) == _tokens(bare)
    reference, _ = vllm_server("llava")  # `vllm serve` without a connector
    assert _tokens(theirs) == _tokens(_chat(reference, "wide", None))


def test_a_uuid_iris_never_saw_is_encoded_by_the_server_itself(plain_vllm, vllm_server):
    """The counter can tell: an item missing from the feature plane runs the server's own tower,
    with the same answer."""
    before = _counters(plain_vllm)
    theirs = _chat(plain_vllm, "tall", f"{UUID_PREFIX}never-sent-{uuid.uuid4().hex[:8]}")
    assert _counted(plain_vllm, before, 1) == {"loaded": 0, "encoded": 1, "refused": 0}
    reference, _ = vllm_server("llava")
    assert _tokens(theirs) == _tokens(_chat(reference, "tall", None))
