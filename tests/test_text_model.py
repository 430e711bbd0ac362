"""A text-only model (`builtin:tiny-llama`) on LLMDecode alone: no VisionModel, no Preprocess, no
VisionEncoder (issue 44: a text model beside a VLM behind one endpoint). LLMDecode runs in Serve
with it and answers chat (whole and streamed), tokenize, models, health, limits and stats; its
greedy tokens are vLLM's own engine's on the same folder; a call that carries media keys anyway
gets a clean 400, not a crash."""

from __future__ import annotations

import gc
import json

import pytest
from ray import serve

from pipeline.stage_io import DecodeCall, DecodeDone, DecodeOpened

APP = "iris-text-decode"
NAME = "tiny-text"
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "about cats."}]},
]
MAX_TOKENS = 16
ENGINE_ARGS = {"max_model_len": 2048, "enforce_eager": True}


@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def reference(folder) -> tuple[list[int], list[int], str]:
    """vLLM's own engine on the same folder (in this process, before the app starts): the chat's
    prompt tokens as vLLM renders them (it joins a message's text parts with newlines), its greedy
    answer's tokens and their text (vLLM's detokenizer holds back an incomplete UTF-8 character at the end)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, dtype="auto", enable_prefix_caching=True, **ENGINE_ARGS)
    (out,) = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return list(out.prompt_token_ids), list(out.outputs[0].token_ids), out.outputs[0].text


@pytest.fixture(scope="module")
def decode(reference, serve_instance):
    from deployments.config import IrisConfig
    from deployments.decode import LLMDecode

    config = IrisConfig(model="builtin:tiny-llama", served_model_name=NAME, engine_args=ENGINE_ARGS)
    assert not config.takes_media()
    yield serve.run(LLMDecode.bind(config), name=APP, route_prefix=None)
    serve.delete(APP)


def _chat(stream: bool = False, **fields):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(
        model=NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=stream, **fields
    )


async def _messages(decode, call: DecodeCall) -> list:
    return [m async for m in decode.options(stream=True).generate.remote(call)]


async def test_greedy_answer_is_vllms(decode, reference):
    prompt_ids, tokens, text = reference
    opened, done = await _messages(decode, DecodeCall("chat", _chat(return_token_ids=True)))
    assert isinstance(opened, DecodeOpened) and opened.status == 200 and opened.error is None, opened
    answer = json.loads(opened.body)
    assert answer["model"] == NAME
    assert answer["prompt_token_ids"] == prompt_ids  # the checkpoint's chat template, as vLLM renders it
    choice = answer["choices"][0]
    assert choice["token_ids"] == tokens and len(tokens) == MAX_TOKENS
    assert choice["message"]["content"] == text
    assert isinstance(done, DecodeDone)
    assert (done.prompt_tokens, done.completion_tokens) == (len(prompt_ids), len(tokens))


async def test_streamed_answer_is_the_same(decode, reference):
    _, tokens, reference_text = reference
    messages = await _messages(decode, DecodeCall("chat", _chat(stream=True)))
    assert isinstance(messages[0], DecodeOpened) and messages[0].body is None and messages[0].error is None
    (done,) = [m for m in messages if isinstance(m, DecodeDone)]  # just before the client's [DONE]
    assert done.completion_tokens == len(tokens)
    events = "".join(m for m in messages if isinstance(m, str))
    assert events.rstrip().endswith("data: [DONE]")
    text = ""
    for line in events.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    assert text == reference_text


async def test_media_keys_are_refused_cleanly(decode):
    """The ingress never sends a text-only model media; a call that has some gets a 400, not a crash."""
    call = DecodeCall("chat", _chat(), media_keys=["0123abcd:image:feed"], modalities=["image"])
    (opened,) = await _messages(decode, call)
    assert opened.error is not None
    assert opened.error.status_code == 400 and opened.error.code == "media_not_supported"
    assert "text-only" in opened.error.message
    await decode.health.remote()  # and the replica serves on


async def test_text_routes_models_health_limits_stats(decode, folder):
    from transformers import AutoTokenizer
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeCompletionRequest

    opened = await decode.text.remote("tokenize", TokenizeCompletionRequest(model=NAME, prompt="Hello, cat"))
    assert opened.status == 200
    assert json.loads(opened.body)["tokens"] == AutoTokenizer.from_pretrained(folder)("Hello, cat")["input_ids"]
    models = json.loads(await decode.models.remote())
    assert [m["id"] for m in models["data"]] == [NAME]
    await decode.health.remote()
    assert await decode.limits.remote() == {"max_model_len": ENGINE_ARGS["max_model_len"]}
    stats = await decode.stats.remote()
    assert "ec_connector" not in stats and stats["generating"] == 0
