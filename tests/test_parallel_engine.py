"""LLMDecode over several vLLM ranks on vLLM's CPU backend: tensor_parallel_size 2 and
pipeline_parallel_size 2, one core per rank, on the tiny LLaVA.

- Engine level (tests/support/family_engine.py, one process per setting): Iris's features, fed as
  LLMDecode feeds them, give the greedy tokens of the engine running its own tower under the same
  parallel setting (what `vllm serve --tensor-parallel-size 2` computes), for one image, another
  size and two images, with the features as embeddings (LLaVA) and through Iris's EC connector
  (Idefics3: each image loaded once, the tower never run); and the chat route answers as the engine
  does. Pipeline parallelism fails
  inside vLLM's CPU engine on the first request (PP_FAILURE): that failure is what is checked.
- App level: an Iris app whose decode replica has tensor_parallel_size 2 (its placement group of
  CPU bundles from deployments/placement.py, vLLM's multiprocessing executor, a core per rank)
  answers a chat with an image, then the same image upload-free, token for token as vLLM's own
  chat at TP=2.

vLLM's Ray executor does not run on its CPU backend (docs/deployment.md: On CPU nodes), so
pipeline stages across the two test nodes are not run here; deployments/placement.py refuses them
on CPU and tests/test_placement.py covers the groups without an engine.
Cost on the 2-core machine (2026-12-05, shared with other work): 168 s for the module, about 25 s per
engine (LLaVA TP=2, Idefics3 TP=2, the PP=2 failure), the TP=2 app ~50 s to start and ~33 s to stop.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from deployments.cpu_binding import rank_binds
from pipeline.model.builtin import BUILDERS
from pipeline.model.embedding_form import CONNECTOR
from tests.support.family_engine import CASES
from tests.support.images import REFERENCE_TEXT, data_url, png_bytes
from tests.test_families import FEATURE_RTOL

TIMEOUT_S = 600
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
# setting -> (family, vLLM's parallel settings): LLaVA's features go in as embeddings, Idefics3's through
# Iris's EC connector (whose scheduler side hands them to every rank in the step's metadata).
PARALLEL = {
    "tp2": ("llava", TP2),
    "tp2-connector": ("idefics3", TP2),
    "pp2": ("llava", {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}),
}
# vLLM 0.32's CPU backend fails pipeline parallelism on the first request: its scheduler finds no
# output for the request (vllm/v1/core/sched/scheduler.py, update_from_output,
# `model_runner_output.req_id_to_index[req_id]` -> KeyError), from step_with_batch_queue.
PP_FAILURE = "req_id_to_index[req_id]"


def _engine(checkpoint: str, dtype: str, parallel: dict) -> dict:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": rank_binds(list(os.sched_getaffinity(0)), 2),
    }  # as LLMDecode sets it
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.family_engine", checkpoint, dtype, json.dumps(parallel)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    # The JSON line; vLLM's workers log to stdout as they shut down.
    return json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    """engines(setting) -> that engine's results, run once per module (a setting that fails
    fails only its own tests)."""
    results: dict[str, dict | AssertionError] = {}

    def get(setting: str) -> dict:
        if setting not in results:
            try:
                family, parallel = PARALLEL[setting]
                results[setting] = _engine(tiny_checkpoint(family), BUILDERS[family].specs["tiny"].dtype, parallel)
            except (AssertionError, subprocess.TimeoutExpired, ValueError) as err:  # once, not once per test
                results[setting] = AssertionError(f"{setting}: {err}")
        if isinstance(results[setting], AssertionError):
            raise results[setting]
        return results[setting]

    return get


@pytest.mark.parametrize("setting", ["tp2", "tp2-connector"])
@pytest.mark.parametrize("case", list(CASES))
def test_iris_features_give_the_engines_tokens_over_two_ranks(engines, setting, case):
    result = engines(setting)
    if case not in result["cases"]:  # more images than vLLM takes in one prompt for this model
        assert result["image_limit"] < len(CASES[case]), (setting, case)
        return
    engine, iris = result["cases"][case]["engine"], result["cases"][case]["iris"]
    assert iris["tokens"] == engine["tokens"] and len(engine["tokens"]) > 0, (setting, case)
    if result["delivery"] == CONNECTOR:  # every image from the connector, once; the engine's tower never ran
        assert (iris["loaded"], iris["encoded"]) == (len(set(CASES[case])), 0), (case, iris)
        assert engine["encoded"] > 0 and engine["loaded"] == 0, (case, engine)
    for f in result["features"].values():  # Iris's features are rank 0's encoder output
        assert f["scale"] > 0 and f["max_diff"] <= FEATURE_RTOL * f["scale"], (setting, f)


@pytest.mark.parametrize("setting", ["tp2", "tp2-connector"])
def test_the_chat_route_answers_as_the_engine_over_two_ranks(engines, setting):
    result = engines(setting)
    assert result["chat"] == result["cases"]["one image"]["engine"]["tokens"][: len(result["chat"])], setting


def test_pipeline_parallelism_still_fails_in_vllms_cpu_scheduler(engines):
    """Where vLLM 0.32's CPU backend stands with pipeline_parallel_size 2 (docs/deployment.md: On CPU
    nodes). When a vLLM upgrade makes it run, this fails: then compare pp2's tokens as tp2's."""
    with pytest.raises(AssertionError, match=re.escape(PP_FAILURE)):
        engines("pp2")


@pytest.fixture(scope="module")
def tp2_app(iris_apps, tiny_checkpoint):
    args = {
        "model": tiny_checkpoint("llava"),
        "served_model_name": "tp2",
        "dtype": "float32",
        "engine_args": {"max_model_len": 2048, "enforce_eager": True, "tensor_parallel_size": 2},
        "decode_placement": {"device": "CPU"},
    }
    with iris_apps.use("tp2", args) as app:
        yield app


def _chat(app, part: dict) -> dict:
    body = {
        "model": "tp2",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": REFERENCE_TEXT}]}],
    }
    r = httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_tp2_decode_replica_answers_as_vllm_at_tp2(tp2_app, engines):
    """The replica's group and its ranks as Serve placed them; its answers vLLM's own chat's at TP=2."""
    from ray.util import placement_group_table

    uuid = "tp2-square"
    image = {"type": "image_url", "uuid": uuid, "image_url": {"url": data_url(png_bytes("square"))}}
    first = _chat(tp2_app, image)
    again = _chat(tp2_app, {"type": "image_url", "uuid": uuid, "image_url": None})  # upload-free
    for reply in (first, again):
        assert reply["choices"][0]["message"]["content"] == engines("tp2")["chat_text"]
        assert reply["usage"]["completion_tokens"] == len(engines("tp2")["chat"])
    groups = [
        g
        for g in placement_group_table().values()
        if g["state"] == "CREATED" and g["bundles"] and list(g["bundles"].values()) == [{"CPU": 2.0}, {"CPU": 1.0}]
    ]
    assert groups and all(g["strategy"] == "STRICT_PACK" for g in groups), placement_group_table()
