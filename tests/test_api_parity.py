"""Iris against `vllm serve` on the same tiny LLaVA checkpoint: the same corpus of
requests to both, the same answers expected (issue 10).

Statuses must match for every request; greedy and seeded requests must give the
same text, token counts and finish reasons; logprobs agree within 1e-4;
structured outputs parse and validate in both. Canaries check on Iris that each
parameter family changes the answer, so a parameter silently dropped fails here.
"""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.support.apps import beside, reference_args
from tests.support.images import REFERENCE_TEXT, data_url, format_corpus, png_bytes
from tests.support.sse import sse_chunks

NAME = "bench"  # the served model name of both systems (no ':' for the peer)
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llava")


@pytest.fixture(scope="module")
def systems(iris_apps, checkpoint, vllm_server):
    """(Iris base URL, vLLM base URL), started at once. The Iris app is kept running for
    tests/test_families.py, which compares the same app (its llava-float32 case) with vLLM."""
    with beside(
        lambda: vllm_server("llava", "float32"),
        iris_apps.use("iris-parity", reference_args(checkpoint, "float32", NAME), route_prefix="/parity", keep=True),
    ) as (app, (vllm, _)):
        yield app.url, vllm


@pytest.fixture(scope="module")
def vllm_base(systems):
    return systems[1]


@pytest.fixture(scope="module")
def iris_base(systems):
    return systems[0]


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


# --------------------------------------------------------------------------- requests


IMG = data_url(png_bytes("square"))
IMG2 = data_url(png_bytes("wide"))


def chat(text: str = REFERENCE_TEXT, images: tuple[str, ...] = (), **params) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in images] + [{"type": "text", "text": text}]
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 12, **params}


GREEDY = {"temperature": 0}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def corpus(tok) -> list[tuple[str, str, dict]]:
    """(name, kind, body); kind: "same" (deterministic: compare answers), "schema", "error" (status only)."""
    a = tok.encode("a", add_special_tokens=False)[0]
    eos = tok.eos_token_id
    return [
        ("greedy-text", "same", chat(**GREEDY)),
        ("greedy-image", "same", chat(images=(IMG,), **GREEDY)),
        ("greedy-two-images", "same", chat("Compare them.", images=(IMG, IMG2), **GREEDY)),
        ("greedy-stream", "same", chat(images=(IMG,), stream=True, stream_options={"include_usage": True}, **GREEDY)),
        ("max-completion-tokens", "same", chat(max_completion_tokens=5, **GREEDY)),
        ("presence-penalty", "same", chat(presence_penalty=1.5, **GREEDY)),
        ("frequency-penalty", "same", chat(frequency_penalty=1.5, **GREEDY)),
        ("repetition-penalty", "same", chat(images=(IMG,), repetition_penalty=1.5, **GREEDY)),
        ("seed", "same", chat(temperature=1.0, seed=42)),
        ("seed-image", "same", chat(images=(IMG,), temperature=0.9, seed=7)),
        ("top-k", "same", chat(temperature=1.0, top_k=3, seed=1)),
        ("top-p", "same", chat(temperature=1.0, top_p=0.3, seed=2)),
        ("min-p", "same", chat(temperature=1.0, min_p=0.2, seed=3)),
        ("logit-bias", "same", chat(logit_bias={str(a): 100}, **GREEDY)),
        ("eos-biased", "same", chat(logit_bias={str(eos): 100}, **GREEDY)),
        ("min-tokens", "same", chat(logit_bias={str(eos): 100}, min_tokens=4, **GREEDY)),
        ("ignore-eos", "same", chat(logit_bias={str(eos): 100}, ignore_eos=True, max_tokens=6, **GREEDY)),
        ("allowed-token-ids", "same", chat(allowed_token_ids=[a, a + 1], **GREEDY)),
        ("skip-special-false", "same", chat(skip_special_tokens=False, **GREEDY)),
        ("logprobs", "same", chat(images=(IMG,), logprobs=True, top_logprobs=3, **GREEDY)),
        ("logprobs-stream", "same", chat(logprobs=True, top_logprobs=2, stream=True, **GREEDY)),
        ("n2-seed", "same", chat(n=2, temperature=1.0, seed=11)),
        ("n2-seed-logprobs", "same", chat(n=2, temperature=1.0, seed=12, logprobs=True, top_logprobs=1)),
        (
            "json-schema",
            "schema",
            chat(
                "Answer in JSON.",
                max_tokens=40,
                temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
            ),
        ),
        ("structured-choice", "same", chat(structured_outputs={"choice": ["yes", "no"]}, **GREEDY)),
        ("structured-regex", "same", chat(structured_outputs={"regex": "[a-c]{4}"}, **GREEDY)),
        # a bad value for each kind of parameter
        ("bad-temperature-type", "error", chat(temperature="hot")),
        ("bad-top-p-range", "error", chat(top_p=1.5)),
        ("bad-n", "error", chat(n=0)),
        ("bad-max-tokens", "error", chat(max_tokens=0)),
        ("bad-seed-type", "error", chat(seed="x")),
        ("bad-stop-type", "error", chat(stop=5)),
        ("bad-top-logprobs-negative", "error", chat(logprobs=True, top_logprobs=-3)),
        ("bad-top-logprobs-large", "error", chat(logprobs=True, top_logprobs=50)),
        ("bad-top-logprobs-without-logprobs", "error", chat(top_logprobs=2)),
        ("bad-presence-penalty", "error", chat(presence_penalty=5)),
        ("bad-repetition-penalty", "error", chat(repetition_penalty=0)),
        ("bad-min-p", "error", chat(min_p=2)),
        ("bad-top-k", "error", chat(top_k=-5)),
        ("bad-logit-bias-token", "error", chat(logit_bias={"99999999": 5})),
        ("bad-response-format", "error", chat(response_format={"type": "xml"})),
        ("bad-json-schema", "error", chat(response_format={"type": "json_schema", "json_schema": {"name": "r"}})),
        (
            "tools-without-parser",
            "error",
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ),
        ("no-messages", "error", {"model": NAME, "max_tokens": 4}),
        ("wrong-model", "error", chat(model="nope", **GREEDY)),
    ]


# --------------------------------------------------------------------------- answers


def post(base: str, path: str, body: dict) -> tuple[int, dict | list[dict] | str]:
    """(status, answer): the JSON body; a stream's JSON chunks (none an error); or the first 400
    characters of a refusal."""
    r = httpx.post(f"{base}{path}", json=body, timeout=300)
    if r.status_code != 200:
        return r.status_code, r.text[:400]
    if not body.get("stream"):
        return 200, r.json()
    chunks = sse_chunks(r.text)
    for j in chunks:
        assert "error" not in j, j
    return 200, chunks


def ask(base: str, body: dict) -> tuple[int, dict]:
    """(status, normalised answer): choices by index with text, finish_reason and logprobs; usage."""
    status, answer = post(base, "/v1/chat/completions", body)
    if status != 200:
        return status, {"error": answer}
    if not body.get("stream"):
        return 200, {
            "choices": {
                c["index"]: {
                    "text": c["message"]["content"],
                    "finish": c["finish_reason"],
                    "logprobs": (c.get("logprobs") or {}).get("content"),
                }
                for c in answer["choices"]
            },
            "usage": answer["usage"],
        }
    choices, usage = {}, None
    for j in answer:
        usage = j.get("usage") or usage
        for c in j["choices"]:
            ch = choices.setdefault(c["index"], {"text": "", "finish": None, "logprobs": None})
            ch["text"] += c["delta"].get("content") or ""
            ch["finish"] = c["finish_reason"] or ch["finish"]
            if c.get("logprobs"):
                ch["logprobs"] = (ch["logprobs"] or []) + c["logprobs"]["content"]
    return 200, {"choices": choices, "usage": usage}


def differences(iris: dict, vllm: dict) -> list[str]:
    out = []
    if iris.keys() != vllm.keys() or iris["choices"].keys() != vllm["choices"].keys():
        return [f"shape: {list(iris['choices'])} vs {list(vllm['choices'])}"]
    for i, a in iris["choices"].items():
        b = vllm["choices"][i]
        for field in ("text", "finish"):
            if a[field] != b[field]:
                out.append(f"choices[{i}].{field}: {a[field]!r} != {b[field]!r}")
        if (a["logprobs"] is None) != (b["logprobs"] is None):
            out.append(f"choices[{i}].logprobs present in one answer only")
        elif a["logprobs"] is not None:
            out += logprob_differences(i, a["logprobs"], b["logprobs"])
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        ui, uv = iris["usage"] or {}, vllm["usage"] or {}
        if ui.get(key) != uv.get(key):
            out.append(f"usage.{key}: {ui.get(key)} != {uv.get(key)}")
    return out


def logprob_differences(i: int, a: list, b: list) -> list[str]:
    if len(a) != len(b):
        return [f"choices[{i}].logprobs: {len(a)} tokens != {len(b)}"]
    out = []
    for t, (x, y) in enumerate(zip(a, b)):
        pairs = [(x, y)] + list(zip(x.get("top_logprobs", []), y.get("top_logprobs", [])))
        if x["token"] != y["token"] or len(x.get("top_logprobs", [])) != len(y.get("top_logprobs", [])):
            out.append(f"choices[{i}].logprobs[{t}]: {x} != {y}")
        for p, q in pairs:
            if p["token"] != q["token"] or abs(p["logprob"] - q["logprob"]) > LOGPROB_TOL:
                out.append(
                    f"choices[{i}].logprobs[{t}]: {p['token']!r} {p['logprob']} != {q['token']!r} {q['logprob']}"
                )
    return out


def test_parity_corpus(iris_base, vllm_base, tokenizer):
    from jsonschema import validate

    cases = corpus(tokenizer)
    assert len(cases) >= 30
    failures, counts = [], {"same": 0, "schema": 0, "error": 0}
    for name, kind, body in cases:
        si, ai = ask(iris_base, body)
        sv, av = ask(vllm_base, body)
        problems = [f"status {si} != {sv}"] if si != sv else []
        if not problems and kind == "error" and si == 200:
            problems.append("a bad request was answered 200 by both")
        if not problems and si == 200 and kind == "same":
            problems += differences(ai, av)
        if not problems and si == 200 and kind == "schema":
            for who, ans in (("iris", ai), ("vllm", av)):
                try:
                    validate(json.loads(ans["choices"][0]["text"]), SCHEMA)
                except Exception as err:  # noqa: BLE001  (reported with both answers)
                    problems.append(f"{who}: structured output invalid: {err}")
        if problems:
            failures.append(
                f"--- {name}\nrequest: {json.dumps(body)[:600]}\nproblems: {problems}\n"
                f"iris ({si}): {json.dumps(ai)[:1500]}\nvllm ({sv}): {json.dumps(av)[:1500]}"
            )
        else:
            counts[kind] += 1
    print(f"parity: {len(cases) - len(failures)}/{len(cases)} agree {counts}")
    assert not failures, "\n".join(failures)


def test_image_format_corpus_parity(iris_base, vllm_base):
    """Each format and mode (16-bit grey and RGB, alpha, palette transparency, CMYK, EXIF
    orientations, WebP, animated GIF, grey, 1-bit) gets vLLM's greedy tokens and logprobs: Iris
    decodes with vLLM's ImageMediaIO. A 16-bit grey PNG once got Iris's own rescaling."""

    def body(data: bytes, mime: str) -> dict:
        return chat(images=(data_url(data, mime),), logprobs=True, top_logprobs=2, **GREEDY)

    mimes = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "gif": "image/gif"}
    failures, answers = [], {}
    for name, data in format_corpus().items():
        (si, ai), (sv, av) = (ask(base, body(data, mimes[name.split("-")[0]])) for base in (iris_base, vllm_base))
        problems = [f"status {si}, {sv}"] if (si, sv) != (200, 200) else differences(ai, av)
        if problems:
            failures.append(
                f"--- {name}: {problems}\niris ({si}): {json.dumps(ai)[:800]}\nvllm ({sv}): {json.dumps(av)[:800]}"
            )
        answers[name] = av
    assert not failures, "\n".join(failures)
    # The corpus is sensitive to the pixels: different images, different answers ...
    kinds: list[str] = []
    for name in answers:
        if all(differences(answers[name], answers[k]) for k in kinds):
            kinds.append(name)
    print(f"image formats: {len(answers)} cases agree, {len(kinds)} distinct answers")
    assert len(kinds) >= 2, kinds
    # ... and the old decoder's 16-bit rule (v * 255 // 65535, not vLLM's clipping) would fail here:
    # those pixels as an 8-bit grey PNG, which both decode alike, get another answer from vLLM.
    v = np.asarray(Image.open(io.BytesIO(format_corpus()["png-gray16"]))).astype(np.int64)
    buf = io.BytesIO()
    Image.fromarray((v * 255 // 65535).astype(np.uint8)).save(buf, "PNG")
    status, rescaled = ask(vllm_base, body(buf.getvalue(), "image/png"))
    assert status == 200 and differences(rescaled, answers["png-gray16"]), rescaled


# --------------------------------------------------------------------------- canaries (Iris only)


def _answer(base: str, body: dict) -> dict:
    status, ans = ask(base, body)
    assert status == 200, ans
    return ans


def test_canaries_each_parameter_family_changes_the_answer(iris_base, tokenizer):
    base = chat(images=(IMG,), max_tokens=16, **GREEDY)
    plain = _answer(iris_base, base)
    text = plain["choices"][0]["text"]
    assert len(text) >= 4, plain
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    eos = tokenizer.eos_token_id
    variants = {
        "penalties": {"repetition_penalty": 2.0, "frequency_penalty": 2.0, "presence_penalty": 2.0},
        "logit_bias": {"logit_bias": {str(a): 100}},
        "allowed_token_ids": {"allowed_token_ids": [a]},
        "stop": {"stop": [text[2:4]]},
        # every byte token: the first token generated ends the answer
        "stop_token_ids": {"stop_token_ids": list(range(tokenizer.vocab_size))},
        "max_tokens": {"max_tokens": 3},
        "min_tokens/eos": {"logit_bias": {str(eos): 100}},
        "structured_outputs": {"structured_outputs": {"regex": "[a-c]{4}"}},
        "response_format": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
            "max_tokens": 40,
        },
        "sampling": {"temperature": 1.0, "seed": 5, "top_k": 50, "min_p": 0.0},
    }
    same = [k for k, v in variants.items() if _answer(iris_base, {**base, **v})["choices"][0]["text"] == text]
    assert not same, f"these parameters did not change Iris's answer: {same}"
    # min_tokens and ignore_eos: honoured only when EOS would come first.
    eos_first = {**base, "logit_bias": {str(eos): 100}}
    short = _answer(iris_base, eos_first)["usage"]["completion_tokens"]
    assert _answer(iris_base, {**eos_first, "min_tokens": 5})["usage"]["completion_tokens"] >= 5 > short
    assert _answer(iris_base, {**eos_first, "ignore_eos": True})["usage"]["completion_tokens"] == 16
    # include_stop_str_in_output
    stop = text[2:4]
    kept = _answer(iris_base, {**base, "stop": [stop], "include_stop_str_in_output": True})["choices"][0]["text"]
    assert kept.endswith(stop) and kept != _answer(iris_base, {**base, "stop": [stop]})["choices"][0]["text"]
    # logprobs, n, seeds
    lp = _answer(iris_base, {**base, "logprobs": True, "top_logprobs": 2})["choices"][0]["logprobs"]
    assert lp and len(lp[0]["top_logprobs"]) == 2
    two = _answer(iris_base, {**base, "n": 2, "temperature": 1.0, "seed": 3})
    assert sorted(two["choices"]) == [0, 1] and two["usage"]["completion_tokens"] > 16
    seeded = [_answer(iris_base, {**base, "temperature": 1.0, "seed": s})["choices"][0]["text"] for s in (1, 1, 2)]
    assert seeded[0] == seeded[1] != seeded[2]


def test_parameters_iris_once_refused_answer_as_vllm_serve(iris_base, vllm_base):
    """Beam search, echo, prompt logprobs and tools (without a tool parser: vLLM's own 400) reach
    vLLM's serving layer: the same status and body as `vllm serve`'s, less ids and times."""

    def strip(answer: dict) -> dict:
        # ec_transfer_params: the peer runs Iris's EC connector and names the image's items by its hash.
        return {
            k: v for k, v in answer.items() if k not in ("id", "created", "system_fingerprint", "ec_transfer_params")
        }

    for field, value in (
        ("use_beam_search", True),
        ("echo", True),
        ("prompt_logprobs", 1),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ):
        body = chat(images=(IMG,), **GREEDY, **{field: value})
        iris = httpx.post(f"{iris_base}/v1/chat/completions", json=body, timeout=120)
        peer = httpx.post(f"{vllm_base}/v1/chat/completions", json=body, timeout=120)
        assert iris.status_code == peer.status_code, (field, iris.text, peer.text)
        assert strip(iris.json()) == strip(peer.json()), field


def test_models_lists_vllm_fields(iris_base, vllm_base):
    iris = httpx.get(f"{iris_base}/v1/models").json()["data"][0]
    peer = httpx.get(f"{vllm_base}/v1/models").json()["data"][0]
    assert set(peer) <= set(iris), set(peer) - set(iris)
    for key in ("id", "object", "owned_by", "root", "max_model_len"):
        assert iris[key] == peer[key] or key == "root", (key, iris[key], peer[key])


def test_responses_have_vllm_serve_fields(iris_base, vllm_base):
    """Iris answers with vLLM's response models: the same fields as `vllm serve`, whole
    answers and stream chunks, chat and completions."""

    def fields(base, path, body):
        whole = httpx.post(f"{base}{path}", json=body, timeout=300).json()
        chunks = sse_chunks(httpx.post(f"{base}{path}", json={**body, "stream": True}, timeout=300).text)
        choice = whole["choices"][0]
        # Chunks by kind, not by position: a server may send several tokens in one chunk
        # (Iris does when the reader falls behind), so the first chunk can be the last.
        shapes = {}
        for c in chunks:
            kind = (
                "usage"
                if not c["choices"]
                else "finish"
                if any(ch.get("finish_reason") for ch in c["choices"])
                else "role"
                if any("role" in (ch.get("delta") or {}) for ch in c["choices"])
                else "delta"
            )
            shapes[kind] = (sorted(c), [sorted(ch) for ch in c["choices"]])
        return (
            {k: sorted(v) if isinstance(v, dict) else None for k, v in whole.items()},
            sorted(choice),
            sorted(choice.get("message") or {}),
            shapes,
        )

    chat_body = {"model": NAME, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
    text_body = {"model": NAME, "prompt": "Say hi", "max_tokens": 4, "temperature": 0}
    for path, body in (("/v1/chat/completions", chat_body), ("/v1/completions", text_body)):
        iris, peer = fields(iris_base, path, body), fields(vllm_base, path, body)
        assert iris[:3] == peer[:3], (path, iris[:3], peer[:3])
        assert "finish" in iris[3], (path, iris[3])
        for kind in iris[3]:
            assert iris[3][kind] == peer[3].get(kind), (path, kind, iris[3][kind], peer[3].get(kind))


def ask_text(base: str, body: dict) -> tuple[int, dict]:
    """(status, normalised answer): per choice index (text, finish_reason, logprobs); usage."""
    status, answer = post(base, "/v1/completions", body)
    if status != 200:
        return status, {"error": answer}
    if not body.get("stream"):
        return 200, {
            "choices": {c["index"]: (c["text"], c["finish_reason"], c["logprobs"]) for c in answer["choices"]},
            "usage": {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens")},
        }
    choices, usage = {}, None
    for j in answer:
        usage = j.get("usage") or usage
        for c in j["choices"]:
            text, finish, logprobs = choices.get(c["index"], ("", None, None))
            if c["logprobs"] is not None:  # deltas' lists, joined
                logprobs = {k: (logprobs or {}).get(k, []) + v for k, v in c["logprobs"].items()}
            choices[c["index"]] = (text + c["text"], c["finish_reason"] or finish, logprobs)
    return 200, {"choices": choices, "usage": usage and {k: usage[k] for k in ("prompt_tokens", "completion_tokens")}}


def text_differences(iris: dict, vllm: dict) -> list[str]:
    """Everything equal but logprob values, which may differ by LOGPROB_TOL."""
    if iris["usage"] != vllm["usage"] or iris["choices"].keys() != vllm["choices"].keys():
        return [f"usage or choices: {iris['usage']} {list(iris['choices'])} != {vllm['usage']} {list(vllm['choices'])}"]
    out = []
    for i, (text, finish, lp) in iris["choices"].items():
        text_v, finish_v, lp_v = vllm["choices"][i]
        if (text, finish) != (text_v, finish_v):
            out.append(f"choices[{i}]: {(text, finish)!r} != {(text_v, finish_v)!r}")
        if (lp is None) != (lp_v is None):
            out.append(f"choices[{i}].logprobs present in one answer only")
        elif lp is not None:
            if (lp["tokens"], lp["text_offset"]) != (lp_v["tokens"], lp_v["text_offset"]):
                out.append(f"choices[{i}].logprobs tokens/text_offset: {lp} != {lp_v}")
            pairs = list(zip(lp["token_logprobs"], lp_v["token_logprobs"]))
            for top, top_v in zip(lp["top_logprobs"], lp_v["top_logprobs"]):
                if (top is None) != (top_v is None) or (top is not None and top.keys() != top_v.keys()):
                    out.append(f"choices[{i}].logprobs.top_logprobs: {top} != {top_v}")
                elif top is not None:
                    pairs += [(top[k], top_v[k]) for k in top]
            if any((a is None) != (b is None) or (a is not None and abs(a - b) > LOGPROB_TOL) for a, b in pairs):
                out.append(f"choices[{i}].logprobs values: {lp} != {lp_v}")
    return out


def test_completions_parity(iris_base, vllm_base):
    prompt = "The quick brown fox"
    cases = [
        {"prompt": prompt, "max_tokens": 10, "temperature": 0},
        {"prompt": [prompt], "max_tokens": 10, "temperature": 0, "repetition_penalty": 1.5},
        {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 4, "n": 2},
        {
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        {"prompt": prompt, "max_tokens": 8, "top_p": 7},
        {"max_tokens": 8},
        # logprobs: completions' own shape (tokens, token_logprobs, top_logprobs, text_offset)
        {"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2},
        {
            "prompt": prompt,
            "max_tokens": 10,
            "temperature": 0,
            "logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0},
        {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 9, "n": 2, "logprobs": 1, "stream": True},
        {"prompt": prompt, "max_tokens": 6, "logprobs": 50},  # above the engine's max_logprobs (20)
        {"prompt": prompt, "max_tokens": 6, "logprobs": -3},
    ]
    # Stop strings from the greedy answer: one that starts with its first character (that text is
    # held back while its tokens are reported, so streamed text lags the logprobs' offsets) and
    # never completes, and its last character, which ends the answer.
    greedy = ask_text(vllm_base, {"model": NAME, **cases[0]})[1]["choices"][0][0]
    assert len(greedy) >= 2 and "\ufffd" not in greedy[0] + greedy[-1], greedy
    cases.append(
        {
            "prompt": prompt,
            "max_tokens": 10,
            "temperature": 0,
            "logprobs": 1,
            "stream": True,
            "stop": [greedy[0] + "\u2603", greedy[-1]],
        }
    )
    failures = []
    for body in cases:
        body = {"model": NAME, **body}
        si, ai = ask_text(iris_base, body)
        sv, av = ask_text(vllm_base, body)
        problems = [f"status {si} != {sv}"] if si != sv else text_differences(ai, av) if si == 200 else []
        if problems:
            failures.append(f"request: {body}\nproblems: {problems}\niris ({si}): {ai}\nvllm ({sv}): {av}")
    print(f"completions parity: {len(cases) - len(failures)}/{len(cases)} agree")
    assert not failures, "\n".join(failures)
    # What Iris once refused, answered by vLLM's serving layer: echo, prompt logprobs, token ids, batches.
    for extra in (
        {"prompt": prompt, "echo": True, "logprobs": 1},
        {"prompt": prompt, "prompt_logprobs": 2},
        {"prompt": [64, 65, 66]},
        {"prompt": [prompt, "Hello"]},
        {"prompt": [[1, 2], [3, 4, 5]]},
    ):
        body = {"model": NAME, "max_tokens": 4, "temperature": 0, **extra}
        iris, peer = (httpx.post(f"{base}/v1/completions", json=body, timeout=120) for base in (iris_base, vllm_base))
        assert iris.status_code == peer.status_code == 200, (extra, iris.text, peer.text)
        strip = ("id", "created", "system_fingerprint")
        assert {k: v for k, v in iris.json().items() if k not in strip} == {
            k: v for k, v in peer.json().items() if k not in strip
        }, extra


def test_tokenize_detokenize_parity(iris_base, vllm_base, tokenizer):
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello"},
    ]
    tokenize = [
        {"prompt": "The quick brown fox"},
        {"prompt": "The quick brown fox", "add_special_tokens": False, "return_token_strs": True},
        {"prompt": ""},
        {"messages": [{"role": "user", "content": "Hi there"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "you"}]}]},
        {"messages": turns, "add_generation_prompt": False, "return_token_strs": True},
        {"messages": turns, "add_generation_prompt": False, "continue_final_message": True},
        {"messages": turns, "add_special_tokens": True},
        {"messages": turns, "continue_final_message": True},  # the generation prompt is on by default
        {"messages": turns, "continue_final_message": True, "add_generation_prompt": True},
        {"model": "nope", "prompt": "x"},
        {"prompt": 5},
        {"max_tokens": 3},
    ]
    detokenize = [
        {"tokens": tokenizer.encode("The quick brown fox")},
        {"tokens": [tokenizer.bos_token_id, *tokenizer.encode("a b", add_special_tokens=False)]},
        {"tokens": []},
        {"tokens": [tokenizer.vocab_size + 1000]},  # no such token
        {"tokens": [-1]},
        {"tokens": "abc"},
        {"model": "nope", "tokens": [1]},
    ]
    failures, statuses = [], []
    for path, bodies in (("tokenize", tokenize), ("detokenize", detokenize)):
        for body in bodies:
            ri = httpx.post(f"{iris_base}/{path}", json=body, timeout=60)
            rv = httpx.post(f"{vllm_base}/{path}", json=body, timeout=60)
            statuses.append(rv.status_code)
            if ri.status_code != rv.status_code or (rv.status_code == 200 and ri.json() != rv.json()):
                failures.append(
                    f"/{path} {body}\niris ({ri.status_code}): {ri.text[:800]}\n"
                    f"vllm ({rv.status_code}): {rv.text[:800]}"
                )
            elif rv.status_code >= 400 and "error" not in ri.json():
                failures.append(f"/{path} {body}: not OpenAI's error shape: {ri.text[:400]}")
    print(
        f"tokenize parity: {len(tokenize) + len(detokenize) - len(failures)}/{len(tokenize) + len(detokenize)} agree, "
        f"vLLM's statuses {statuses}"
    )
    assert not failures, "\n".join(failures)
    # The count is the prompt a chat completion of the same messages is charged for.
    messages = [{"role": "user", "content": "Count me"}]
    count = httpx.post(f"{iris_base}/tokenize", json={"messages": messages}).json()["count"]
    usage = httpx.post(
        f"{iris_base}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=120
    ).json()["usage"]
    assert count == usage["prompt_tokens"], (count, usage)


def test_tokenize_refuses_images_by_name(iris_base, vllm_base):
    """vLLM counts an image's expanded tokens; Iris refuses images in /tokenize with a 400 naming them
    (its decode replicas fetch no media: the ingress does, for generation requests)."""
    body = {"messages": chat("What is this?", images=(IMG,))["messages"]}
    assert httpx.post(f"{vllm_base}/tokenize", json=body, timeout=60).status_code == 200
    r = httpx.post(f"{iris_base}/tokenize", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_url", r.text
    assert "image" in r.json()["error"]["message"], r.text
