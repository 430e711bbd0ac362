"""Two LLMDecode replicas behind ImageAffinityRouter, deployed from serve_config.yaml
itself (so the router is loaded from its `request_router_class` string): every
repeat of an image reaches the replica that prefilled it (prefix-cache hit).

The stages are placed on the session's two Ray nodes by the config alone, as on a cluster of
CPU and GPU nodes: Ingress and Preprocess on the CPU node, VisionEncoder and LLMDecode on the
accelerator node (custom resources standing for the GPUs), so pixels and features cross nodes
through the object store and Redis. The checkpoint ships its own code (its config class:
tests/support/remote_code.py) and runs with `trust_remote_code`: every stage on both nodes loads
it, or the app would not start. Costs two vLLM engines (~9 GB); kept in its own module so the app
lives only here."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray import serve

from tests.support.apps import ACCELERATOR_NODE, CPU_NODE, running_app
from tests.support.images import REFERENCE_TEXT, data_url, unique_png
from tests.support.remote_code import remote_code_llava

ROOT = Path(__file__).resolve().parent.parent
APP = "iris-affinity"
PLACEMENT = {
    "Ingress": CPU_NODE,
    "Preprocess": CPU_NODE,
    "VisionEncoder": ACCELERATOR_NODE,
    "LLMDecode": ACCELERATOR_NODE,
}


@pytest.fixture(scope="module")
def affinity_app(iris_apps, tiny_checkpoint, tmp_path_factory):
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    args = config.pop("args")
    args.update(
        model=str(remote_code_llava(tiny_checkpoint("llava"), tmp_path_factory.mktemp("affinity") / "llava")),
        engine_args={"max_model_len": 2048, "enforce_eager": True, "trust_remote_code": True},
        cache={**args["cache"], "ttl_s": 3600},
    )
    decode = next(d for d in config["deployments"] if d["name"] == "LLMDecode")
    assert decode["request_router_config"]["request_router_class"].endswith(":ImageAffinityRouter")
    del decode["autoscaling_config"]
    decode["num_replicas"] = 2
    for deployment in config["deployments"]:
        node = PLACEMENT[deployment["name"]]
        deployment["ray_actor_options"] = {**deployment.get("ray_actor_options", {}), "resources": {node: 1}}
    with iris_apps.use(APP, args, route_prefix="/affinity", config=config) as app:
        yield app.url


def _chat(base: str, url: str | None, uuid: str | None = None, status: int = 200) -> dict:
    part = {"type": "image_url", "image_url": None if url is None else {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    body = {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": REFERENCE_TEXT}]}],
        "max_tokens": 4,
        "temperature": 0,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()["usage"] if status == 200 else r.json()


def test_stages_run_on_the_nodes_the_config_names(affinity_app, ray_dashboard):
    """Serve's own replica details (the dashboard's Serve API) say where each replica runs: the
    config's resources alone put the CPU stages and the accelerator stages on different nodes."""
    nodes = {
        resource: next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])
        for resource in (CPU_NODE, ACCELERATOR_NODE)
    }
    assert nodes[CPU_NODE] != nodes[ACCELERATOR_NODE]
    details = httpx.get(f"{ray_dashboard}/api/serve/applications/", timeout=60).json()
    deployments = details["applications"][APP]["deployments"]
    for name, resource in PLACEMENT.items():
        replicas = [r for r in deployments[name]["replicas"] if r["state"] == "RUNNING"]
        assert len(replicas) == 2 if name == "LLMDecode" else replicas, (name, deployments[name]["replicas"])
        assert {r["node_id"] for r in replicas} == {nodes[resource]}, name


def test_preprocess_runs_the_torch_threads_the_shipped_config_gives_it(affinity_app):
    """Ray gives a fractional-CPU actor one thread; serve_config.yaml's preprocess_cpu_threads
    gives vLLM's processor more (a 24-frame clip: ~35 ms instead of ~60)."""
    wanted = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    assert wanted["preprocess_cpu_threads"] > 1
    assert running_app(APP).stats("Preprocess")["torch_threads"] == wanted["preprocess_cpu_threads"]


def test_new_repeated_and_upload_free_images_across_the_nodes(affinity_app):
    """Pixels go from the CPU node to the encoder on the accelerator node, features through
    Redis and the object store to the decode replicas, and an upload-free request finds them."""
    url, uuid = data_url(unique_png()), f"two-nodes-{time.time_ns()}"
    first = _chat(affinity_app, url, uuid)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    again = _chat(affinity_app, None, uuid)  # upload-free: the uuid only
    assert again["prompt_tokens"] == first["prompt_tokens"] and again["prompt_tokens_details"]["cached_tokens"] > 0
    missing = _chat(affinity_app, None, f"{uuid}-never-sent", status=409)
    assert missing["error"]["code"] == "mm_cache_miss"


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
