"""Every family Iris serves, end to end, against `vllm serve` on the same tiny checkpoint.

For each built-in family tested through an app (BUILDERS' `tested`; the others:
tests/test_family_engines.py) one Iris app and one vLLM OpenAI server run side by side.
Families vLLM takes no image embeddings for (read from vLLM's source) get their features
through Iris's EC connector, and their app runs two decode replicas: an upload-free request
is answered from the feature cache whichever replica takes it, and no decode engine's tower
ever runs (the connector's counters; also for LLaVA-NeXT and InternVL, whose embedding input
takes no images of other sizes in one prompt, so they go through the connector too). The server
is monolithic (its own processor and tower) and also writes its encoder's output per image
through vLLM's `ECExampleConnector` (`ec_role: ec_both`), so one engine gives both references:
- greedy tokens: one image, two image sizes, two images in one prompt; one video, and a
  video with an image, for the families whose built-in takes video;
- features: what Iris's VisionEncoder computed for an image against the engine's
  own encoder output for it (max abs difference <= 1e-5).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import ray
import torch
from ray import serve

from bench.harness.systems import (
    SERVED_NAME as NAME,  # the served model name of both systems
)
from pipeline.model.builtin import APP_TESTED_FAMILIES, BUILDERS
from pipeline.model.embedding_form import CONNECTOR
from tests.support.apps import beside, reference_args, running_app
from tests.support.images import REFERENCE_TEXT, data_url, png_bytes
from tests.support.videos import clip_bytes

CASES = {"one image": ["square"], "another size": ["wide"], "two images": ["tall", "wide"]}
# Largest feature difference allowed, relative to the features' largest magnitude: ~30 float32 ulps
# there. The engine's run and Iris's sum in different orders, and which kernels do so depends on the
# CPU: 1e-5 absolute held on earlier machines; one with AVX-512 and AMX differs by up to 2.3e-5 at
# a magnitude of 26 (8.8e-7 of it), while its greedy tokens and logprobs still equal vLLM's.
FEATURE_RTOL = 4e-6
# Each at its checkpoint's dtype: float32, except the families with Qwen3.5's hybrid language
# model (Qwen3.5, MiniCPM-V 4.6), whose linear attention vLLM runs on the CPU in bfloat16 only.
# LLaVA first and Qwen2-VL last: their apps are also test_api_parity's and test_serving's, run just
# before and just after this module (conftest), so each starts once.
VARIANTS = sorted(
    [(family, BUILDERS[family].specs["tiny"].dtype) for family in APP_TESTED_FAMILIES],
    key=lambda v: (v[0] != "llava", v[0] == "qwen2_vl"),
)
# Families whose built-in Iris serves video for: the built-in chat template places videos, and vLLM
# takes their video features back as embeddings (InternVL, in both formats: through the EC connector).
# The others answer a video with a 400.
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl", "internvl_chat")
VIDEO_CASES = {"one video": (["clip"], []), "video and image": (["clip"], ["square"])}
# Families with a hybrid (linear-attention) language model: vLLM 0.32's CPU kernel for their prefill
# raised on a lone 1-token prefill and ended the engine (pipeline/model/vllm_fixes.py fixes it).
HYBRID_FAMILIES = ("qwen3_5", "minicpmv4_6")
# Connector families' apps: deployed as serve_config.yaml is, with two decode replicas behind
# Serve's default router (each request lands on either).
TWO_DECODERS = {"import_path": "deployments.app:build_app", "deployments": [{"name": "LLMDecode", "num_replicas": 2}]}


def takes_image_embeddings(checkpoint: str, arch: str | None = None) -> bool:
    """From vLLM's own source of the checkpoint's architecture (scripts/family_table.py); `arch`: the
    one vLLM resolved, where the checkpoint has no config.json naming it (Mistral's format)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import family_table

    arch = arch or json.loads((Path(checkpoint) / "config.json").read_text())["architectures"][0]
    return family_table.takes_image_embeddings(arch)


@pytest.fixture(scope="module", params=VARIANTS, ids=[f"{f}-{d}" for f, d in VARIANTS])
def systems(request, iris_apps, tiny_checkpoint, vllm_server):
    """(family, dtype, Iris base URL, Iris app name, vLLM base URL, vLLM's encoder-output folder).
    Kept when done: the next module may want the same app (reference_args)."""
    family, dtype = request.param
    config = None if takes_image_embeddings(tiny_checkpoint(family)) else TWO_DECODERS
    with beside(
        lambda: vllm_server(family, dtype),
        iris_apps.use(
            f"iris-fam-{family}-{dtype}",
            reference_args(tiny_checkpoint(family), dtype, NAME, BUILDERS[family].engine_args),
            keep=True,
            config=config,
        ),
    ) as (app, (vllm, ec_dir)):
        # The next variant's reference starts while this one's tests run.
        selected = list(
            dict.fromkeys(
                item.callspec.params["systems"]
                for item in request.session.items
                if item.module is request.module and "systems" in item.callspec.params
            )
        )
        following = selected[selected.index(request.param) + 1 :]
        if following:
            vllm_server.prefetch(*following[0])
        yield family, dtype, app.url, app.name, vllm, ec_dir


def _chat(
    base: str, images: list[str], uuids: list[str] | None = None, videos: tuple[str, ...] = (), status: int = 200
) -> dict:
    parts = [{"type": "video_url", "video_url": {"url": data_url(clip_bytes(name), "video/mp4")}} for name in videos]
    for i, name in enumerate(images):
        part = {"type": "image_url", "image_url": {"url": data_url(png_bytes(name))}}
        if uuids:
            part["uuid"] = uuids[i]
        parts.append(part)
    body = {
        "model": NAME,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "messages": [{"role": "user", "content": parts + [{"type": "text", "text": REFERENCE_TEXT}]}],
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == status, r.text
    return r.json()


def _scored(reply: dict) -> list[tuple[str, float]]:
    return [(t["token"], t["logprob"]) for t in reply["choices"][0]["logprobs"]["content"]]


def _tokens(reply: dict) -> list[tuple[str, list[int]]]:
    return [(t["token"], t["bytes"]) for t in reply["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_vllm_serve(systems, case):
    family, dtype, iris, _, vllm, _ = systems
    ours, theirs = _chat(iris, CASES[case]), _chat(vllm, CASES[case])
    assert _tokens(ours) == _tokens(theirs), (family, dtype, case)
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
    for field in ("prompt_tokens", "completion_tokens"):
        assert ours["usage"][field] == theirs["usage"][field], (family, case, field)


@pytest.mark.parametrize("case", VIDEO_CASES)
def test_video_greedy_tokens_equal_vllm_serve(systems, case):
    family, dtype, iris, _, vllm, _ = systems
    videos, images = VIDEO_CASES[case]
    if family not in VIDEO_FAMILIES:
        # Iris's own 400 (the model takes no video), or vLLM's (its template places none: vLLM's 500, a 400 on Iris).
        assert _chat(iris, images, videos=videos, status=400)["error"]["type"] in (
            "invalid_request_error",
            "BadRequestError",
        )
        return
    ours, theirs = _chat(iris, images, videos=videos), _chat(vllm, images, videos=videos)
    assert _tokens(ours) == _tokens(theirs), (family, dtype, case)
    for field in ("prompt_tokens", "completion_tokens"):
        assert ours["usage"][field] == theirs["usage"][field], (family, case, field)
    assert _scored(ours) != _scored(_chat(iris, images, videos=("other",)))  # the clip matters (logprobs at least)


def test_greedy_output_depends_on_the_image(systems):
    """Otherwise the token comparison above would prove nothing about the features: another
    image changes the tokens or, where the tiny model's greedy tokens coincide, their logprobs."""
    _, _, iris, _, _, _ = systems
    assert _scored(_chat(iris, ["square"])) != _scored(_chat(iris, ["wide"]))


@pytest.mark.parametrize("image", ["square", "wide"])
def test_features_equal_the_engine_encoder_output(systems, image):
    from safetensors.torch import load_file

    from cache_service.keys import content_key
    from pipeline.stage_io import MediaJob

    family, dtype, _, app, vllm, ec_dir = systems
    marker = f"fid-{image}-{uuid.uuid4().hex[:8]}"
    _chat(vllm, [image], uuids=[marker])  # the engine writes its encoder output under the uuid
    engine = load_file(str(ec_dir / marker / "encoder_cache.safetensors"))["ec_cache"]

    encoder = serve.get_deployment_handle("VisionEncoder", app_name=app)
    data = png_bytes(image)
    key = content_key(encoder.get_fingerprint.remote().result(), data, f"fidelity-{uuid.uuid4().hex[:8]}")
    pixels = serve.get_deployment_handle("Preprocess", app_name=app).pixels.remote(MediaJob("image[0]", key, data))
    encoded = encoder.encode.remote(key, pixels).result()
    ours = ray.get(encoded.features_ref).tensors["image_embeds"]

    assert ours.dtype == engine.dtype == getattr(torch, dtype)
    assert ours.shape == engine.shape, (family, image)
    difference = (ours.float() - engine.float()).abs().max().item()
    scale = engine.float().abs().max().item()
    assert scale > 0 and difference <= FEATURE_RTOL * scale, (family, dtype, image, difference, scale)


def test_one_token_prompt_leaves_the_replica_serving(systems):
    """A 1-token prompt, the end of vLLM's engine on hybrid models on a CPU with BF16 instructions
    (its conv1d kernel's stride check, fixed by pipeline/model/vllm_fixes.py): served, on hybrid
    models too, and the replica answers the next request."""
    family, _, iris, _, _, _ = systems
    tokens = httpx.post(f"{iris}/tokenize", json={"model": NAME, "prompt": "a"}, timeout=60).json()["tokens"]
    r = httpx.post(f"{iris}/v1/completions", json={"model": NAME, "prompt": "a", "max_tokens": 2}, timeout=120)
    if family in HYBRID_FAMILIES:
        assert len(tokens) == 1, tokens  # else the case is not the one vLLM failed on
    assert r.status_code == 200, r.text
    assert _chat(iris, ["square"])["choices"][0]["message"]["content"]


def _decoder_stats(app: str, replicas: int) -> dict[str, dict]:
    """replica id -> LLMDecode.stats(), asked until every replica answered (Serve routes each call)."""
    handle = serve.get_deployment_handle("LLMDecode", app_name=app)
    seen: dict[str, dict] = {}
    for _ in range(100):
        stats = handle.stats.remote().result()
        seen[stats["replica"]] = stats
        if len(seen) == replicas:
            return seen
    raise AssertionError(f"{len(seen)} of {replicas} LLMDecode replicas answered")


def test_upload_free_from_features_no_decode_replica_saw(systems, raw_redis):
    """The image's features are computed by Preprocess and the encoder alone, straight into the
    cache; upload-free requests by its uuid are then answered on whichever decode replica takes
    them, each with the tokens `vllm serve` gives the uploaded image. Connector families (two
    decode replicas): both replicas answer some, and no decode engine's tower ever ran, in any
    test of the app (the connector's counters)."""
    from cache_service.keys import uuid_key
    from pipeline.stage_io import MediaJob

    family, _, iris, app, vllm, _ = systems
    encoder = serve.get_deployment_handle("VisionEncoder", app_name=app)
    connector = encoder.get_modalities.remote().result()["image"] == CONNECTOR
    replicas = serve.status().applications[app].deployments["LLMDecode"].replica_states["RUNNING"]
    before = _decoder_stats(app, replicas)
    marker = f"upload-free-{uuid.uuid4().hex[:8]}"
    key = uuid_key(encoder.get_fingerprint.remote().result(), "default", marker, running_app(app).namespace)
    pixels = serve.get_deployment_handle("Preprocess", app_name=app).pixels.remote(
        MediaJob("image[0]", key, png_bytes("tall"), keep_source=connector)
    )
    encoder.encode.remote(key, pixels).result()
    deadline = time.monotonic() + 30
    while not raw_redis.exists(key):  # the encoder writes behind its answer
        assert time.monotonic() < deadline, "the encoder's features never reached Redis"
        time.sleep(0.1)

    expected = _tokens(_chat(vllm, ["tall"]))
    body = {
        "model": NAME,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": None, "uuid": marker},
                    {"type": "text", "text": REFERENCE_TEXT},
                ],
            }
        ],
    }
    for _ in range(16):  # Serve's default router: two replicas both take some (all on one: 2 in 65536)
        r = httpx.post(f"{iris}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers["x-iris-images"] == "cached=1,computed=0"
        assert _tokens(r.json()) == expected, family
    if connector:
        after = _decoder_stats(app, replicas)
        assert set(after) == set(before)
        for replica, stats in after.items():
            loaded = stats["ec_connector"]["loaded"] - before[replica]["ec_connector"]["loaded"]
            assert loaded >= 1, (family, replica, before[replica], stats)  # it took some: from the cache
            assert stats["ec_connector"]["encoded"] == 0, (family, replica, stats)
            assert stats["ec_connector"]["staged"] == 0, (family, replica, stats)  # nothing left behind
