"""Answers rendered from DecodeChunks with vLLM's response models (no engine needed)."""

import json

import pytest

from pipeline.api import openai_format
from pipeline.errors import bad_request
from pipeline.stage_io import DecodeChunk


async def _chunks(*chunks):
    for c in chunks:
        yield c


def test_sse_event_is_one_line_whatever_unicode_line_breaks_the_text_holds():
    """U+0085, U+2028 and U+2029 are raw in JSON strings, but str.splitlines (httpx's
    iter_lines) breaks lines on them: one event must stay one data line."""
    text = "a\x85b\u2028c\u2029d"
    event = openai_format.sse({"text": text})
    assert event.endswith("\n\n") and len(event.rstrip("\n").splitlines()) == 1
    assert json.loads(event.removeprefix("data: "))["text"] == text


def _events(messages: list[str]) -> list[dict | str]:
    """The server-sent events in the stream's messages: JSON bodies, and "[DONE]"."""
    data = [e.removeprefix("data: ") for m in messages for e in m.split("\n\n") if e]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


async def test_chat_stream_events_role_deltas_usage_done_one_message_per_chunk():
    messages = [e async for e in openai_format.chat_events(_chunks(
        DecodeChunk(text="Hel"),
        DecodeChunk(text="lo\u2028", finish_reason="stop", done=True, prompt_tokens=5, completion_tokens=2,
                    cached_tokens=1, system_fingerprint="fp-1")), "chatcmpl-1", "m", 1, include_usage=True)]
    # One message per chunk (Serve's proxy sends each as a message of its own): the role with the
    # first delta; the last delta, the usage and [DONE] together.
    assert [len(_events([m])) for m in messages] == [2, 3]
    *bodies, done = _events(messages)
    assert done == "[DONE]"
    assert [b["object"] for b in bodies] == ["chat.completion.chunk"] * 4
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(b["choices"][0]["delta"].get("content", "") for b in bodies[1:3]) == "Hello\u2028"
    assert bodies[2]["choices"][0]["finish_reason"] == "stop" and "system_fingerprint" not in bodies[2]
    assert bodies[3]["choices"] == [] and bodies[3]["system_fingerprint"] == "fp-1"
    assert bodies[3]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                                  "prompt_tokens_details": {"cached_tokens": 1}}


async def test_streams_end_with_done_also_when_the_last_chunk_never_came():
    chat = [e async for e in openai_format.chat_events(_chunks(DecodeChunk(text="a")), "c", "m", 2, False)]
    assert [b if isinstance(b, str) else b["choices"][0]["delta"] for b in _events(chat)] == [
        {"role": "assistant", "content": ""}, {"role": "assistant", "content": ""}, {"content": "a"}, "[DONE]"]
    assert len(chat) == 2 and chat[-1] == openai_format.DONE
    text = [e async for e in openai_format.text_events(_chunks(DecodeChunk(text="a"), DecodeChunk(text="b")),
                                                       "t", "m", True)]
    assert [b if isinstance(b, str) else b["choices"][0]["text"] for b in _events(text)] == ["a", "b", "[DONE]"]
    assert len(text) == 3
    with pytest.raises(type(bad_request("x"))):
        [e async for e in openai_format.text_events(_chunks(DecodeChunk(error=bad_request("no"))), "t", "m", True)]


async def test_whole_answer_joins_choices_and_raises_the_engines_error():
    answer = await openai_format.Answer.gather(_chunks(
        DecodeChunk(text="a", index=1), DecodeChunk(text="b", index=0, finish_reason="length"),
        DecodeChunk(text="c", index=1, finish_reason="stop", done=True, prompt_tokens=3, completion_tokens=3)))
    body = json.loads(answer.chat("chatcmpl-2", "m").model_dump_json())
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "b", "length"), (1, "ac", "stop")]
    assert body["usage"]["total_tokens"] == 6
    with pytest.raises(type(bad_request("x"))) as raised:
        await openai_format.Answer.gather(_chunks(DecodeChunk(text="a"), DecodeChunk(error=bad_request("no", code="x"))))
    assert raised.value.code == "x" and raised.value.status_code == 400
