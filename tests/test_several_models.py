"""Several models behind one endpoint (`models:` in the app's args): two VLMs and a text-only
model, deployed from a Serve config as `serve deploy` deploys serve_config.yaml, with options for
deployments named `<Stage>:<model>`. One Ingress routes each request by its `model`; each model
has its own stages (none but LLMDecode for the text model) and its own feature keys; a name no
model has is vLLM's 404; tenant limits set in one entry bind that model alone. Costs three vLLM
engines (~12 GB), so the app lives in this module only."""

from __future__ import annotations

import httpx
import pytest

from tests.support.images import REFERENCE_TEXT, data_url, image_part, unique_png

APP = "iris-models"
TEXT_MODEL = "builtin:tiny-llama"
MODELS = {  # served name -> its entry
    "llava": {"model": "builtin:tiny-llava", "served_model_name": "llava"},
    "qwen": {
        "model": "builtin:tiny-qwen2-vl",
        "served_model_name": "qwen",
        # one request in flight per tenant, for this model only
        "tenant_limits": {"default": {"max_concurrent_requests": 1}},
    },
    "text": {"model": TEXT_MODEL, "served_model_name": "text"},
}
SMALL = {"num_cpus": 0.1}


@pytest.fixture(scope="module")
def models_app(iris_apps):
    entries = [
        {**entry, "max_images_per_prompt": 2, "engine_args": {"max_model_len": 2048, "enforce_eager": True}}
        for entry in MODELS.values()
    ]
    deployments = [{"name": "Ingress", "ray_actor_options": SMALL}] + [
        {"name": f"{stage}:{name}", "ray_actor_options": SMALL, "num_replicas": 1}
        for name, entry in MODELS.items()
        for stage in (("LLMDecode",) if entry["model"] == TEXT_MODEL else ("Preprocess", "VisionEncoder", "LLMDecode"))
    ]
    config = {"import_path": "deployments.app:build_app", "deployments": deployments}
    args = {"models": entries, "cache": {"ttl_s": 3600}}
    with iris_apps.use(APP, args, route_prefix="/models", config=config) as app:
        yield app


def chat(app, model: str | None, *parts: dict, status: int = 200, max_tokens: int = 4) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": REFERENCE_TEXT}]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if model is not None:
        body["model"] = model
    r = httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == status, r.text
    return r


def test_each_model_has_its_own_stages(models_app):
    from ray import serve

    deployments = set(serve.status().applications[APP].deployments)
    assert deployments == {
        "Ingress",
        "Preprocess:llava",
        "VisionEncoder:llava",
        "LLMDecode:llava",
        "Preprocess:qwen",
        "VisionEncoder:qwen",
        "LLMDecode:qwen",
        "LLMDecode:text",
    }


def test_models_lists_every_model(models_app):
    cards = httpx.get(f"{models_app.url}/v1/models", timeout=60).json()
    assert cards["object"] == "list"
    assert [card["id"] for card in cards["data"]] == list(MODELS)


def test_each_model_answers_by_its_name(models_app):
    """vLLM's serving layer answers only the names its engine serves: a request routed to the wrong
    model's LLMDecode would be its 404."""
    png = unique_png()
    for name in ("llava", "qwen"):
        r = chat(models_app, name, image_part(data_url(png)))
        assert r.json()["model"] == name and r.headers["x-iris-images"] == "cached=0,computed=1"
    r = chat(models_app, "text")
    assert r.json()["model"] == "text" and r.json()["usage"]["completion_tokens"] == 4
    assert "x-iris-images" not in r.headers
    # No model named: the first, as `vllm serve` answers a request without one.
    assert chat(models_app, None, image_part(data_url(png))).json()["model"] == "llava"


def test_caches_are_apart_by_model(models_app):
    """One image sent to both VLMs is computed once for each (its keys carry each encoder's
    fingerprint), then cached for each."""
    png = unique_png()
    for name in ("llava", "qwen"):
        assert chat(models_app, name, image_part(data_url(png))).headers["x-iris-images"] == "cached=0,computed=1"
    for name in ("llava", "qwen"):
        assert chat(models_app, name, image_part(data_url(png))).headers["x-iris-images"] == "cached=1,computed=0"
    stats = httpx.get(f"{models_app.url}/iris/stats", timeout=60).json()
    fingerprints = {name: stats["models"][name]["model"]["fingerprint"] for name in MODELS}
    assert fingerprints["llava"] != fingerprints["qwen"] and None not in (fingerprints["llava"], fingerprints["qwen"])
    assert fingerprints["text"] is None and stats["models"]["text"]["model"]["features_to_decoder"] == {}


def test_an_unknown_model_is_vllms_404(models_app):
    r = chat(models_app, "gpt-4o", status=404)
    assert r.json() == {
        "error": {
            "message": "The model `gpt-4o` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_an_image_for_the_text_model_is_a_400(models_app):
    r = chat(models_app, "text", image_part(data_url(unique_png())), status=400)
    error = r.json()["error"]
    assert error["code"] == "unsupported_image" and "text only" in error["message"], error


def test_tokenize_is_routed_by_model(models_app):
    """The same chat through each model's chat template: LLaVA's `USER: ... ASSISTANT:` and
    Qwen2-VL's `<|im_start|>` turns give other tokens (their byte-level vocabularies agree)."""
    body = {"messages": [{"role": "user", "content": "hello"}]}
    tokens = {
        name: httpx.post(f"{models_app.url}/tokenize", json={**body, "model": name}, timeout=60).json()["tokens"]
        for name in ("llava", "qwen")
    }
    assert tokens["llava"] != tokens["qwen"], tokens
    r = httpx.post(f"{models_app.url}/tokenize", json={**body, "model": "nobody"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_tenant_limits_of_one_model_bind_it_alone(models_app):
    """`qwen` allows one request in flight per tenant; llava has no limits. Two streams held open
    at once: the second to qwen is a 429, to llava it starts."""

    def open_stream(client: httpx.Client, model: str) -> httpx.Response:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": REFERENCE_TEXT}],
            "max_tokens": 1000,  # held open until closed here
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        return client.send(
            client.build_request("POST", f"{models_app.url}/v1/chat/completions", json=body), stream=True
        )

    with httpx.Client(timeout=300) as client:
        for model, second_status in (("qwen", 429), ("llava", 200)):
            first = open_stream(client, model)
            try:
                assert first.status_code == 200
                second = open_stream(client, model)
                try:
                    assert second.status_code == second_status, second.read()
                finally:
                    second.close()
            finally:
                first.close()


def test_the_text_models_decode_refuses_media_keys_itself(models_app):
    """Behind the Ingress's own 400: a call with media keys that reached the text model's LLMDecode
    anyway is a 400 there, and the replica serves on."""
    from pipeline.stage_io import DecodeCall, DecodeOpened

    decode = models_app.handle("LLMDecode:text").options(stream=True)
    first = next(iter(decode.generate.remote(DecodeCall("chat", None, ["iris:forged"], ["image"]))))
    assert isinstance(first, DecodeOpened) and first.error is not None
    assert first.error.status_code == 400 and "text-only" in first.error.message, first.error
    assert chat(models_app, "text").json()["model"] == "text"
