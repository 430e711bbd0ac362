"""A rollout under load (issue 34): the running app is updated in place, as `serve deploy` of a
changed serve_config.yaml updates it (Serve's in-place update of an application: serve.run of
the same application name with new args), while clients keep sending chat requests.

Two changes, one after the other, on test_serving's Qwen2-VL app (conftest runs this module right
after it; the app is deleted when this module is done, as the next app's start would have):
  1. another checkpoint of the same family, shapes alike: a copy of the tiny Qwen2-VL whose
     weights (tower, projector, language model) are perturbed, so a stale feature would fit;
  2. a preprocessing setting that changes the fingerprint: engine_args.mm_processor_kwargs
     max_pixels, which makes each test image fewer feature tokens.

The updated app runs two Ingress replicas (docs/operations.md: with one, Serve stops it before
its successor starts, and requests fail); the other stages keep one, so requests wait at the
Ingress for their successors, and an old Ingress meets new stages and the other way round.

Every request must succeed (200), every answer must be the old model's or the new model's
greedy answer for its input (a feature of one model decoded by the other would be neither),
requests sent after the update must get the new model's, and the new model must have
computed each image's features once (its VisionEncoder, its keys in Redis).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from ray import serve

from bench.harness.systems import SERVED_NAME as NAME
from tests.support.apps import reference_args, run_on_fresh_loop, running_app
from tests.support.images import data_url, unique_png

CLIENTS = 3
INGRESS_REPLICAS = 2
MAX_TOKENS = 8
IMAGES_PER_ROLL = 6  # distinct images, each sent again and again during the roll
IMAGE_SIZE = (112, 84)  # 12 feature tokens at the checkpoint's settings, 2 at MAX_PIXELS
MAX_PIXELS = 3136
TEXTS = ["Say something about the sea.", "Count to three."]
AFTER_ROLL_S = 3.0  # load kept up after the update is done
LOAD_CAP_S = 420.0  # a bound on the load, whatever the update does


@pytest.fixture(scope="module")
def app(iris_apps, tiny_checkpoint):
    """test_serving's Qwen2-VL app (the same args: the pool hands over the running one)."""
    with iris_apps.use(
        "iris-qwen2_vl", reference_args(tiny_checkpoint("qwen2_vl"), "float32", NAME), route_prefix="/qwen2_vl"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def perturbed_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny Qwen2-VL with every weight moved by seeded noise: same shapes, other features
    and other answers."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    target = tmp_path_factory.mktemp("ckpt") / "tiny-qwen2-vl-perturbed"
    shutil.copytree(tiny_checkpoint("qwen2_vl"), target)
    weights = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(34)
    for name, w in weights.items():
        if w.is_floating_point() and w.numel() > 1:
            noise = torch.randn(w.shape, generator=generator, dtype=torch.float32).to(w.dtype)
            weights[name] = w + 0.5 * w.float().std().to(w.dtype) * noise
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return str(target)


@dataclass
class Sent:
    what: str  # the input's name
    started: float
    status: int
    answer: str | None


def _body(what: str, images: dict[str, bytes]) -> dict:
    if what in images:
        content = [
            {"type": "image_url", "image_url": {"url": data_url(images[what])}},
            {"type": "text", "text": "Describe it."},
        ]
    else:
        content = what
    return {
        "model": NAME,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }


async def _ask(client: httpx.AsyncClient, url: str, what: str, images: dict[str, bytes]) -> Sent:
    started = time.monotonic()
    try:
        r = await client.post(f"{url}/v1/chat/completions", json=_body(what, images))
    except httpx.HTTPError as err:  # a dropped connection is a failed request too
        return Sent(what, started, 0, repr(err))
    answer = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text[:300]
    return Sent(what, started, r.status_code, answer)


async def _answers(url: str, inputs: list[str], images: dict[str, bytes]) -> dict[str, str]:
    """Each input's answer, asked CLIENTS at a time; all must succeed."""
    async with httpx.AsyncClient(timeout=120) as client:
        gate = asyncio.Semaphore(CLIENTS)

        async def one(what):
            async with gate:
                return await _ask(client, url, what, images)

        sent = await asyncio.gather(*(one(w) for w in inputs))
    assert all(s.status == 200 for s in sent), [(s.what, s.status, s.answer) for s in sent if s.status != 200]
    return {s.what: s.answer for s in sent}


async def _load_during(roll, url: str, inputs: list[str], images: dict[str, bytes]) -> tuple[list[Sent], float]:
    """CLIENTS clients sending `inputs` in turn while `roll()` runs in a thread, and AFTER_ROLL_S
    after it returns. Returns what they got and when the roll was done."""
    done = threading.Event()
    results: list[Sent] = []
    turn = iter(range(10**9))

    async def client_loop(client):
        deadline = time.monotonic() + LOAD_CAP_S
        while time.monotonic() < deadline and not done.is_set():
            results.append(await _ask(client, url, inputs[next(turn) % len(inputs)], images))

    async with httpx.AsyncClient(timeout=LOAD_CAP_S) as client:
        clients = [asyncio.create_task(client_loop(client)) for _ in range(CLIENTS)]
        await asyncio.sleep(1.0)  # the load is on before the update starts
        await asyncio.to_thread(roll)
        rolled = time.monotonic()
        await asyncio.sleep(AFTER_ROLL_S)
        done.set()
        await asyncio.gather(*clients)
    return results, rolled


def _fingerprint(url: str) -> str:
    return httpx.get(f"{url}/iris/stats", timeout=30).json()["model"]["fingerprint"]


def _keys_of(namespace: str, fingerprint: str) -> list[str]:
    import redis

    from cache_service.keys import fingerprint_of
    from tests.support.namespaces import SHARED_REDIS_URL

    client = redis.Redis.from_url(SHARED_REDIS_URL)
    try:
        return [
            k.decode()
            for k in client.scan_iter(match=f"{namespace}:*", count=1000)
            if fingerprint_of(k.decode()) == fingerprint
        ]
    finally:
        client.close()


def _roll_under_load(app, new_args: dict, seed: int) -> dict:
    """Update `app` in place to `new_args` under load; checks every answer and the new model's
    encoder work. Returns numbers for the report."""
    from deployments.app import iris_application
    from deployments.config import IrisConfig

    url, prefix = app.url, "/" + app.url.split("/", 3)[3]  # {serve_url}{route_prefix}
    images = {f"image-{seed}-{i}": unique_png(seed * 100 + i, IMAGE_SIZE) for i in range(IMAGES_PER_ROLL)}
    inputs = list(images) + TEXTS
    old_fingerprint = _fingerprint(url)
    old = run_on_fresh_loop(_answers(url, inputs, images))  # the old model's answers (its features now cached)

    def roll():
        # Two Ingress replicas, so that one serves while Serve replaces the other (one replica
        # is stopped before its successor starts). The first roll also grows it from one to two:
        # Serve starts the new replica before stopping the old one then.
        serve.run(
            iris_application(IrisConfig.model_validate(new_args), num_replicas=INGRESS_REPLICAS),
            name=app.name,
            route_prefix=prefix,
        )  # returns once the app runs again

    started = time.monotonic()
    sent, rolled = run_on_fresh_loop(_load_during(roll, url, inputs, images))
    roll_s = rolled - started
    new_fingerprint = _fingerprint(url)
    new = run_on_fresh_loop(_answers(url, inputs, images))

    failed = [(s.what, s.status, s.answer) for s in sent if s.status != 200]
    assert not failed, f"{len(failed)} of {len(sent)} requests failed during the update: {failed[:5]}"
    assert new_fingerprint != old_fingerprint
    # The test can tell the models apart: every image has another answer under each.
    assert all(old[w] != new[w] for w in images), {w: (old[w], new[w]) for w in images}
    mixed = [(s.what, s.answer, old[s.what], new[s.what]) for s in sent if s.answer not in (old[s.what], new[s.what])]
    assert not mixed, f"answers of neither model (features of one decoded by the other?): {mixed[:5]}"
    stale = [(s.what, s.answer) for s in sent if s.started > rolled and s.answer != new[s.what]]
    assert not stale, f"the old model answered after the update: {stale[:5]}"
    # The new model computed each image's features once, however many requests sent it.
    assert app.stats("VisionEncoder", timeout_s=30)["images_encoded"] == len(images)
    deadline = time.monotonic() + 10  # the encoder writes to Redis behind its answer
    while len(_keys_of(app.namespace, new_fingerprint)) < len(images) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_keys_of(app.namespace, new_fingerprint)) == len(images)
    served_new = sum(1 for s in sent if s.answer == new[s.what] and s.what in images)
    return {"requests": len(sent), "roll_s": round(roll_s, 1), "image_requests_by_new_model": served_new}


def test_rollout_to_another_checkpoint_under_load(app, perturbed_checkpoint):
    """Every request of a load across the update succeeds, with the old or the new weights'
    answer, never a mix; the new weights' features are computed once per image."""
    args = copy.deepcopy(running_app(app.name).args)
    args["model"] = perturbed_checkpoint
    report = _roll_under_load(app, args, seed=341)
    print(f"rollout to another checkpoint: {report}")
    app.args.update(args)  # dataclass is frozen, its dict is not: the next roll starts from here


def test_rollout_of_a_preprocessing_setting_under_load(app):
    """The same for a Preprocess setting that changes what an image's features are (and the
    fingerprint): an old Preprocess's pixels never reach the new encoder as its own."""
    args = copy.deepcopy(app.args)
    args["engine_args"] = {**args["engine_args"], "mm_processor_kwargs": {"max_pixels": MAX_PIXELS}}
    report = _roll_under_load(app, args, seed=342)
    print(f"rollout of a preprocessing setting: {report}")
