"""Iris's OpenAI surface against `vllm serve` with the same flags on the same checkpoint (issue 41).

Both serve the built-in tiny Qwen3-VL (its tokenizer has `<tool_call>`, `</tool_call>`,
`<think>`, `</think>` as single tokens; its chat template renders tools, tool calls, tool
results and the `enable_thinking` switch) with `--enable-auto-tool-choice --tool-call-parser
hermes --reasoning-parser qwen3` and a random-weight LoRA adapter the project builds
(pipeline/model/builtin/lora.py) in `--lora-modules`. Each case goes to both, greedy, and must
get the same status and the same body but for what differs by construction (ids, timestamps):
every field name, the content, tool calls and reasoning, token counts, logprobs within 1e-4,
and a refusal's whole error object (message, type, param, code). A stream is compared by what
it reassembles to and by the set of its chunks' field names (Iris may merge chunks:
deployments/decode.py's stream interval).
"""

from __future__ import annotations

import json
import math
import re
import time

import httpx
import pytest
from tokenizers import pre_tokenizers

from tests.support.apps import beside, reference_args
from tests.support.images import data_url, png_bytes
from tests.support.sse import sse_chunks, sse_events

NAME = "bench"  # both systems' served model name (bench/harness/systems.py SERVED_NAME)
ADAPTER = "surface-lora"
LOGPROB_TOL = 1e-4
# Values that differ between two servers by construction: ids, timestamps.
VOLATILE = {"id", "created", "created_at", "completed_at", "item_id", "call_id", "system_fingerprint"}
IMG = data_url(png_bytes("square"))
IMG2 = data_url(png_bytes("wide"))


def flags(adapter: str) -> dict:
    """The `vllm serve` flags both systems run with (Iris: engine_args)."""
    return {
        "enable_auto_tool_choice": True,
        "tool_call_parser": "hermes",
        "reasoning_parser": "qwen3",
        "enable_lora": True,
        "lora_modules": [f"{ADAPTER}={adapter}"],
        "max_lora_rank": 8,
        "max_model_len": 2048,
        "enforce_eager": True,
        "enable_prompt_tokens_details": True,
    }  # Iris's default, so vllm serve's too


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3_vl")


@pytest.fixture(scope="module")
def adapter(checkpoint, tmp_path_factory):
    from pipeline.model.builtin.lora import build_lora

    return str(build_lora(checkpoint, tmp_path_factory.mktemp("lora") / ADAPTER))


@pytest.fixture(scope="module")
def systems(iris_apps, checkpoint, adapter, tmp_path_factory):
    """(Iris base URL, vLLM base URL): one app and one `vllm serve` for the module, started at once."""
    from bench.harness.systems import EngineSettings, _start_vllm
    from deployments.vllm_args import argv

    engine_flags = flags(adapter)
    engine = EngineSettings(
        checkpoint,
        "float32",
        2048,
        2,
        0,
        ("--seed", "0", *argv({k: v for k, v in engine_flags.items() if k not in ("max_model_len",)})),
    )
    args = reference_args(checkpoint, "float32", NAME)
    args["engine_args"] = engine_flags
    args["max_videos_per_prompt"] = 0
    with beside(
        lambda: _start_vllm(1, engine, tmp_path_factory.mktemp("vllm"), time.monotonic(), 600),
        iris_apps.use("iris-surface", args, route_prefix="/surface"),
    ) as (app, vllm):
        try:
            yield app.url, vllm.base_urls[0]
        finally:
            vllm.stop()


# --------------------------------------------------------------------------- requests

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
for _tool in TOOLS:  # the arguments a required or named call is constrained to are the parameters' schema
    _tool["function"]["strict"] = True
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# No whitespace tokens (the byte-level tokens of " ", "\t", "\n", "\r"): where JSON a grammar
# constrains allows whitespace, a random-weight model fills it forever, and a required or named
# tool call's arguments would never end (vLLM's disable_any_whitespace leaves its structural tags'
# JSON alone). Where the grammar requires a space, it is still the one token allowed.
NO_WHITESPACE = {
    "logit_bias": {
        str(sorted(pre_tokenizers.ByteLevel.alphabet()).index(symbol)): -100
        for symbol in ("\u0120", "\u0109", "\u010a", "\u010d")
    }
}


def user(text: str, *images: str) -> dict:
    return {
        "role": "user",
        "content": [*({"type": "image_url", "image_url": {"url": u}} for u in images), {"type": "text", "text": text}],
    }


def chat(*messages: dict, **params) -> dict:
    return {
        "model": NAME,
        "messages": list(messages) or [user("What is the weather in Paris?", IMG)],
        "max_tokens": 16,
        "temperature": 0,
        **params,
    }


MULTI_TURN = [
    {"role": "system", "content": "You are a weather assistant."},
    user("What is the weather where this picture was taken, Paris?", IMG),
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
]

# (name, path, body, headers): answered 200 by both.
CASES = [
    ("tools-auto", "/v1/chat/completions", chat(tools=TOOLS, tool_choice="auto", **NO_THINKING), None),
    (
        "tools-auto-stream",
        "/v1/chat/completions",
        chat(tools=TOOLS, tool_choice="auto", stream=True, **NO_THINKING),
        None,
    ),
    (
        "tools-required",
        "/v1/chat/completions",
        chat(tools=TOOLS, tool_choice="required", max_tokens=80, **NO_WHITESPACE, **NO_THINKING),
        None,
    ),
    (
        "tools-required-stream",
        "/v1/chat/completions",
        chat(tools=TOOLS, tool_choice="required", max_tokens=80, stream=True, **NO_WHITESPACE, **NO_THINKING),
        None,
    ),
    (
        "tools-named",
        "/v1/chat/completions",
        chat(
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=60,
            **NO_WHITESPACE,
            **NO_THINKING,
        ),
        None,
    ),
    (
        "tools-named-stream",
        "/v1/chat/completions",
        chat(
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=60,
            **NO_WHITESPACE,
            stream=True,
            **NO_THINKING,
        ),
        None,
    ),
    ("tools-multi-turn", "/v1/chat/completions", chat(*MULTI_TURN, tools=TOOLS, **NO_THINKING), None),
    (
        "tools-multi-turn-stream",
        "/v1/chat/completions",
        chat(*MULTI_TURN, tools=TOOLS, stream=True, **NO_THINKING),
        None,
    ),
    ("thinking-on", "/v1/chat/completions", chat(chat_template_kwargs={"enable_thinking": True}), None),
    (
        "thinking-on-stream",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"enable_thinking": True}, stream=True),
        None,
    ),
    ("thinking-off", "/v1/chat/completions", chat(**NO_THINKING), None),
    ("thinking-off-stream", "/v1/chat/completions", chat(stream=True, **NO_THINKING), None),
    (
        "responses",
        "/v1/responses",
        {
            "model": NAME,
            "max_output_tokens": 16,
            "temperature": 0,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": IMG},
                        {"type": "input_text", "text": "What is in it?"},
                    ],
                }
            ],
        },
        None,
    ),
    (
        "responses-stream",
        "/v1/responses",
        {
            "model": NAME,
            "max_output_tokens": 16,
            "temperature": 0,
            "stream": True,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": IMG2},
                        {"type": "input_text", "text": "And this one?"},
                    ],
                }
            ],
        },
        None,
    ),
    (
        "completions-echo-prompt-logprobs",
        "/v1/completions",
        {
            "model": NAME,
            "prompt": "The weather in Paris is",
            "max_tokens": 8,
            "temperature": 0,
            "echo": True,
            "logprobs": 2,
            "prompt_logprobs": 2,
        },
        None,
    ),
    (
        "completions-token-ids",
        "/v1/completions",
        {"model": NAME, "prompt": [84, 104, 101, 32, 119], "max_tokens": 8, "temperature": 0, "logprobs": 1},
        None,
    ),
    (
        "completions-token-ids-echo-stream",
        "/v1/completions",
        {
            "model": NAME,
            "prompt": [84, 104, 101, 32, 119],
            "max_tokens": 8,
            "temperature": 0,
            "echo": True,
            "stream": True,
        },
        None,
    ),
    ("lora-chat", "/v1/chat/completions", chat(model=ADAPTER, **NO_THINKING), None),
    (
        "lora-completions",
        "/v1/completions",
        {"model": ADAPTER, "prompt": "The weather in Paris is", "max_tokens": 8, "temperature": 0},
        None,
    ),
    ("request-id-body", "/v1/chat/completions", chat(request_id="surface-body-1", **NO_THINKING), None),
    ("request-id-header", "/v1/chat/completions", chat(**NO_THINKING), {"X-Request-Id": "surface-header-1"}),
    (
        "request-id-header-completions",
        "/v1/completions",
        {"model": NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        {"X-Request-Id": "surface-header-2"},
    ),
    ("priority-zero", "/v1/chat/completions", chat(priority=0, **NO_THINKING), None),
    # Without --scheduling-policy priority, vllm serve takes (and ignores) a non-zero priority.
    ("priority-nonzero-fcfs", "/v1/chat/completions", chat(priority=5, **NO_THINKING), None),
    (
        "continuous-usage-stream",
        "/v1/chat/completions",
        chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **NO_THINKING),
        None,
    ),
]
# Cases whose response id carries the request id: compared as is, not dropped as volatile.
ID_CASES = {"request-id-body", "request-id-header", "request-id-header-completions"}

LONG_PROMPT = "word " * 500  # 2500 byte-level tokens: over max_model_len 2048
# (name, path, body): refused by both, with the same status and error object.
MALFORMED = [
    ("bad-temperature-type", "/v1/chat/completions", chat(temperature="hot")),
    ("unknown-model", "/v1/chat/completions", chat(model="nope")),
    ("too-many-tokens", "/v1/chat/completions", chat(max_tokens=100_000)),
    (
        "bad-tool-schema",
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]),
    ),
    (
        "tool-choice-unknown-function",
        "/v1/chat/completions",
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
    ),
    ("tool-choice-required-no-tools", "/v1/chat/completions", chat(tool_choice="required")),
    ("bad-chat-template-kwargs", "/v1/chat/completions", chat(chat_template_kwargs="yes")),
    ("empty-messages", "/v1/chat/completions", {"model": NAME, "messages": [], "max_tokens": 4}),
    ("n-zero", "/v1/chat/completions", chat(n=0)),
    ("negative-temperature", "/v1/chat/completions", chat(temperature=-1)),
    ("bad-response-format", "/v1/chat/completions", chat(response_format={"type": "xml"})),
    ("prompt-too-long", "/v1/chat/completions", chat(user(LONG_PROMPT))),
    ("top-logprobs-too-high", "/v1/chat/completions", chat(logprobs=True, top_logprobs=50)),
    ("completions-logprobs-too-high", "/v1/completions", {"model": NAME, "prompt": "Hi", "logprobs": 50}),
    ("completions-token-out-of-vocab", "/v1/completions", {"model": NAME, "prompt": [10**8], "max_tokens": 2}),
    ("completions-prompt-too-long", "/v1/completions", {"model": NAME, "prompt": LONG_PROMPT, "max_tokens": 2}),
    ("responses-bad-input", "/v1/responses", {"model": NAME, "input": 5}),
]


# Where Iris answers otherwise than vllm serve today (none is one of Iris's documented codes):
# expected to fail, strictly, so that the fix (in the reason) makes them pass and be unmarked.
KNOWN_DIFFERENCES = {
    "too-many-tokens": "Iris's max_tokens_limit (4096 by default) refuses first, in Iris's error shape "
    "(type invalid_request_error, code invalid_value); vllm serve's check against "
    "max_model_len answers type BadRequestError, code 400",
}


# Seen to differ once, not understood yet (2026-12-05): the Responses stream's text and events agreed, its
# usage.output_tokens_details.reasoning_tokens did not (Iris 11, vllm serve 9). vLLM counts reasoning tokens
# per streamed delta; how the engine's deltas group depends on timing, so it is not marked strict.
UNEXPLAINED = {"responses-stream": "reasoning_tokens of a streamed Response: 11 on Iris, 9 on vllm serve once"}


def cases(table: list[tuple]) -> list:
    def marks(name: str) -> list:
        if name in KNOWN_DIFFERENCES:
            return [pytest.mark.xfail(strict=True, reason=KNOWN_DIFFERENCES[name])]
        if name in UNEXPLAINED:
            return [pytest.mark.xfail(strict=False, reason=UNEXPLAINED[name])]
        return []

    return [pytest.param(*case, id=case[0], marks=marks(case[0])) for case in table]


# --------------------------------------------------------------------------- answers


def send(base: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, object]:
    """(status, the JSON body, or a stream's JSON events without [DONE]; a body that is not JSON as text)."""
    r = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=300)
    if body.get("stream") and r.status_code == 200:
        if path == "/v1/responses":  # named events: an `event:` line before each `data:` line
            lines = re.split(r"\r\n|\r|\n", r.text)
            return 200, [
                {"event": "[DONE]"} if line == "data: [DONE]" else json.loads(line[len("data:") :])
                for line in lines
                if line.startswith("data:")
            ] + [{"event_lines": sorted({line for line in lines if line.startswith("event:")})}]
        events = sse_events(r.text)
        assert events and events[-1] == "[DONE]", events[-3:]
        return 200, sse_chunks(r.text)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def field_names(value, prefix: str = "") -> set[str]:
    """Every field's path in a JSON value (list items as [])."""
    out = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(prefix + k)
            out |= field_names(v, f"{prefix}{k}.")
    elif isinstance(value, list):
        for v in value:
            out |= field_names(v, prefix.rstrip(".") + "[].")
    return out


def stable(value, keep_ids: bool = False):
    """The value without what differs between servers by construction (VOLATILE keys' values;
    a tool call's id keeps its shape: it is random in vLLM)."""
    if isinstance(value, dict):
        return {
            k: (
                "<volatile>"
                if k in VOLATILE and not (keep_ids and k == "id") and v is not None
                else stable(v, keep_ids and k != "tool_calls")
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [stable(v, keep_ids) for v in value]
    return value


def diff(a, b, path: str = "") -> list[str]:
    """Where two JSON values differ (floats within LOGPROB_TOL)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in {'iris' if k in a else 'vllm'}" for k in sorted(a.keys() ^ b.keys())]
        for k in sorted(a.keys() & b.keys()):
            out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        if math.isclose(a, b, abs_tol=LOGPROB_TOL) or (math.isinf(a) and a == b):
            return []
    return [] if a == b else [f"{path}: iris {a!r} != vllm {b!r}"]


def reassembled_chat(chunks: list[dict]) -> dict:
    """A chat stream as one answer: each choice's content, reasoning, tool calls and finish reason;
    the last usage; the model."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for c in chunk.get("choices", []):
            ch = choices.setdefault(c["index"], {"content": "", "reasoning": "", "tool_calls": {}, "finish": None})
            delta = c.get("delta", {})
            ch["content"] += delta.get("content") or ""
            ch["reasoning"] += delta.get("reasoning") or delta.get("reasoning_content") or ""
            for t in delta.get("tool_calls") or []:
                call = ch["tool_calls"].setdefault(t["index"], {"name": "", "arguments": "", "type": None})
                fn = t.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
                call["type"] = t.get("type") or call["type"]
            ch["finish"] = c.get("finish_reason") or ch["finish"]
            ch["stop_reason"] = c.get("stop_reason", ch.get("stop_reason"))
    return {"model": {c.get("model") for c in chunks} - {None}, "choices": choices, "usage": usage}


def reassembled_completion(chunks: list[dict]) -> dict:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.get("choices", []):
            texts[c["index"]] = texts.get(c["index"], "") + c.get("text", "")
            finish[c["index"]] = c.get("finish_reason") or finish.get(c["index"])
    return {"texts": texts, "finish": finish, "usage": [c.get("usage") for c in chunks if c.get("usage")][-1:]}


def reassembled_responses(events: list[dict]) -> dict:
    """A Responses stream: the completed response, and the text its deltas add up to."""
    done = [e for e in events if e.get("type") == "response.completed"]
    return {
        "completed": done[0]["response"] if done else None,
        "text": "".join(e.get("delta", "") for e in events if e.get("type") == "response.output_text.delta"),
        "reasoning": "".join(e.get("delta", "") for e in events if e.get("type") == "response.reasoning_text.delta"),
        "types": sorted({e.get("type") for e in events} - {None}),
        "framing": [e for e in events if "type" not in e],
    }  # [DONE], the `event:` lines


def comparable(name: str, path: str, body: dict, answer) -> dict:
    """What must be equal: a body without VOLATILE values, or a stream reassembled plus its field names."""
    keep_ids = name in ID_CASES
    if not (body.get("stream") and isinstance(answer, list)):
        return {"body": stable(answer, keep_ids)}
    if path == "/v1/responses":
        whole = reassembled_responses(answer)
    elif path == "/v1/completions":
        whole = reassembled_completion(answer)
    else:
        whole = reassembled_chat(answer)
        whole["model"] = sorted(whole["model"])
    whole["ids"] = sorted({c.get("id") for c in answer} - {None}) if keep_ids else None
    return {"reassembled": stable(whole, keep_ids), "field_names": sorted(field_names(answer))}


@pytest.fixture(scope="module")
def answers(systems):
    """Every case's (status, answer) from both systems, asked once: {name: (iris, vllm)}."""
    iris, vllm = systems
    out = {}
    for name, path, body, headers in CASES:
        out[name] = tuple(_attempt(base, path, body, headers) for base in (iris, vllm))
    return out


def _attempt(base: str, path: str, body: dict, headers: dict | None):
    try:
        return send(base, path, body, headers)
    except Exception as err:  # this case's test reports it
        return -1, repr(err)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name,path,body,headers", cases(CASES))
def test_same_answer(answers, name, path, body, headers):
    (si, ai), (sv, av) = answers[name]
    assert sv == 200, f"vllm serve refused {name}: {av}"
    assert si == sv, f"status: iris {si} ({ai}) != vllm {sv}"
    differences = diff(comparable(name, path, body, ai), comparable(name, path, body, av))
    assert not differences, "\n".join(differences[:30])


def test_cases_exercise_what_they_name(answers):
    """The parity above compares something: tool calls are made, reasoning and content split by
    the thinking switch, the adapter answers otherwise than the base model, the response ids carry
    the request id, every chunk of a continuous-usage stream counts tokens."""

    def msg(name):
        return answers[name][1][1]["choices"][0]["message"]

    for name in ("tools-required", "tools-named"):
        calls = msg(name).get("tool_calls")
        assert calls and calls[0]["function"]["name"] in ("get_weather", "get_time"), (name, msg(name))
    assert msg("tools-named")["tool_calls"][0]["function"]["name"] == "get_time"
    on, off = msg("thinking-on"), msg("thinking-off")
    assert on.get("reasoning") and not off.get("reasoning") and off["content"], (on, off)
    assert msg("lora-chat")["content"] != msg("thinking-off")["content"]
    assert "surface-body-1" in answers["request-id-body"][1][1]["id"]
    assert "surface-header-1" in answers["request-id-header"][1][1]["id"]
    chunks = answers["continuous-usage-stream"][1][1]
    assert all(c.get("usage") for c in chunks if c.get("choices")), chunks[:2]
    prompt_logprobs = answers["completions-echo-prompt-logprobs"][1][1]["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs and prompt_logprobs[0] is None and len(prompt_logprobs) > 3


def test_models_list_the_adapter(systems):
    iris, vllm = (httpx.get(f"{base}/v1/models", timeout=30) for base in systems)
    assert iris.status_code == vllm.status_code == 200
    names = [m["id"] for m in vllm.json()["data"]]
    assert names == [NAME, ADAPTER], names
    assert not diff(stable(iris.json()), stable(vllm.json())), diff(stable(iris.json()), stable(vllm.json()))


@pytest.mark.parametrize("name,path,body", cases(MALFORMED))
def test_same_refusal(systems, name, path, body):
    iris, vllm = systems
    (si, ai), (sv, av) = send(iris, path, body), send(vllm, path, body)
    assert sv >= 400, f"vllm serve answered {name}: {str(av)[:300]}"
    assert si == sv, f"status: iris {si} != vllm {sv}\niris: {json.dumps(ai)[:600]}\nvllm: {json.dumps(av)[:600]}"
    differences = diff(ai, av)
    assert not differences, "\n".join(differences)
