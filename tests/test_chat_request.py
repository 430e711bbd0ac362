"""parse_chat_request: the valid shapes we serve, and every 400 path."""

from __future__ import annotations

import copy

import pytest

from pipeline.api.chat_request import (
    ChatMessage,
    MediaInput,
    MediaPlaceholder,
    TextPart,
    parse_chat_request,
)
from pipeline.errors import IrisError, bad_request

IMG_A = "data:image/png;base64,iVBORw0KGgo="
IMG_B = "https://example.invalid/b.jpg"  # never fetched: parsing only


def user(*parts):
    return {"role": "user", "content": list(parts)}


def text(t):
    return {"type": "text", "text": t}


def image(url=None, uuid=None, detail=None):
    part = {"type": "image_url"}
    if url is not None or detail is not None:
        part["image_url"] = {"url": url}
        if detail is not None:
            part["image_url"]["detail"] = detail
    if uuid is not None:
        part["uuid"] = uuid
    return part


def body(messages=None, **kw):
    b = {"model": "tiny-llava", "messages": messages or [user(text("hi"))]}
    b.update(kw)
    return b


def fail(b, max_images=4, max_videos=0) -> IrisError:
    with pytest.raises(IrisError) as ei:
        parse_chat_request(b, max_images=max_images, max_videos=max_videos)
    err = ei.value
    assert err.status_code == 400
    assert err.to_dict()["error"]["type"] == "invalid_request_error"
    return err


# --------------------------------------------------------------------------- valid


def test_full_multi_image_multi_message_request():
    b = {
        "model": "tiny-llava",
        "messages": [
            {"role": "system", "content": "You are terse."},
            user(text("Compare"), image(IMG_A, detail="low"), text("with"), image(IMG_B, uuid="img-b")),
            {"role": "assistant", "content": [text("They differ.")]},
            user(image(uuid="img-b"), text("and this one again?")),  # upload-free
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["\n\n", "END"],
        "n": 1,
        "user": "alice",
        "logprobs": False,
        "frequency_penalty": 0.5,
        "not_a_field": 1,  # unknown to vLLM's model too: ignored, as vLLM does
    }
    p = parse_chat_request(b, max_images=3)
    assert p.model == "tiny-llava"
    assert p.stream is True and p.include_usage is True
    s = p.sampling.to_sampling_params(64, {})  # vLLM's own conversion
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, s.n) == (64, 0.2, 0.9, 7, ["\n\n", "END"], 1)
    assert s.frequency_penalty == 0.5 and s.logprobs is None
    assert p.media == [
        MediaInput(0, IMG_A, None, "image", 0),
        MediaInput(1, IMG_B, "img-b", "image", 1),
        MediaInput(2, None, "img-b", "image", 2),
    ]
    assert p.messages == [
        ChatMessage("system", [TextPart("You are terse.")]),
        ChatMessage("user", [TextPart("Compare"), MediaPlaceholder(0), TextPart("with"), MediaPlaceholder(1)]),
        ChatMessage("assistant", [TextPart("They differ.")]),
        ChatMessage("user", [MediaPlaceholder(2), TextPart("and this one again?")]),
    ]


def test_defaults():
    p = parse_chat_request({"messages": [{"role": "user", "content": "hello"}]}, max_images=0)
    assert p.model is None
    assert p.stream is False and p.include_usage is False
    assert p.sampling.max_tokens is None and p.sampling.seed is None and p.sampling.n == 1
    assert p.media == []
    assert p.messages == [ChatMessage("user", [TextPart("hello")])]


def test_stop_string_nulls_and_developer_role():
    p = parse_chat_request(
        body(
            [{"role": "developer", "content": "rules"}, user(text("x"))],
            stop="###",
            temperature=None,
            top_p=None,
            stream=None,
            max_tokens=5,
            temperature_extra=3,
        ),
        max_images=1,
    )
    s = p.sampling.to_sampling_params(5, {})
    assert s.stop == ["###"] and s.temperature == 1.0 and s.top_p == 1.0 and s.max_tokens == 5
    assert p.messages[0].role == "system"


def test_max_completion_tokens_wins_over_max_tokens():
    from pipeline.api.sampling import max_tokens_of

    p = parse_chat_request(body(max_tokens=10, max_completion_tokens=20), max_images=1)
    assert max_tokens_of(p.sampling) == 20


def test_vllm_sampling_fields_pass_through_with_vllm_meaning():
    p = parse_chat_request(body(n=2, seed=3, top_k=5, min_p=0.1, repetition_penalty=1.2, logit_bias={"7": 2},
                                min_tokens=2, ignore_eos=True, stop_token_ids=[9], logprobs=True, top_logprobs=3,
                                include_stop_str_in_output=True, skip_special_tokens=False,
                                response_format={"type": "json_object"}), max_images=1)
    s = p.sampling.to_sampling_params(8, {})
    assert (s.n, s.seed, s.top_k, s.min_p, s.repetition_penalty, s.logit_bias) == (2, 3, 5, 0.1, 1.2, {7: 2})
    assert (s.min_tokens, s.ignore_eos, s.stop_token_ids, s.logprobs) == (2, True, [9], 3)
    assert s.include_stop_str_in_output and not s.skip_special_tokens
    assert s.structured_outputs is not None and s.structured_outputs.json_object


def test_sampling_request_survives_pickle():
    import pickle

    p = parse_chat_request(body(n=2, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {}}}),
                           max_images=1)
    assert pickle.loads(pickle.dumps(p.sampling)).to_sampling_params(4, {}).n == 2


@pytest.mark.parametrize("field,value", [("use_beam_search", True), ("echo", True), ("prompt_logprobs", 2),
                                         ("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("chat_template", "{{x}}"), ("add_generation_prompt", False)])
def test_fields_iris_cannot_honour_are_refused_by_name(field, value):
    err = fail(body(**{field: value}))
    assert err.param == field and "not supported" in err.message


def test_refused_fields_at_their_default_are_accepted():
    parse_chat_request(body(use_beam_search=False, echo=False, tool_choice="none"), max_images=1)


def test_include_usage_false_when_not_requested():
    p = parse_chat_request(body(stream=True, stream_options={"include_usage": False}), max_images=1)
    assert p.stream is True and p.include_usage is False


def test_body_not_mutated():
    b = body([user(text("a"), image(IMG_A))])
    before = copy.deepcopy(b)
    parse_chat_request(b, max_images=1)
    assert b == before


# --------------------------------------------------------------------------- errors: structure


def test_body_not_object():
    err = fail(["not", "a", "dict"])
    assert "JSON object" in err.message


def test_missing_messages():
    err = fail({"model": "m"})
    assert err.param == "messages"
    assert "required" in err.message


def test_no_messages():
    err = fail({"messages": []})
    assert err.param == "messages"
    assert "at least one message" in err.message


def test_unknown_role():
    err = fail(body([{"role": "tool", "content": "x"}]))
    assert err.param == "messages[0].role"
    assert "'tool'" in err.message and "user" in err.message


@pytest.mark.parametrize("content", ["", [], None, [{"type": "text", "text": ""}]])
def test_empty_content(content):
    msgs = [user(text("ok")), {"role": "user", "content": content}]
    err = fail(body(msgs))
    assert err.param == "messages[1].content"
    assert "empty" in err.message


@pytest.mark.parametrize("content", ["", [{"type": "text", "text": ""}]])
def test_empty_assistant_reply_in_history_is_accepted(content):
    chat = parse_chat_request(body([user(text("hi")), {"role": "assistant", "content": content},
                                    user(text("and now?"))]), max_images=1)
    assert [m.role for m in chat.messages] == ["user", "assistant", "user"]
    assert [p.text for p in chat.messages[1].parts] == [""]


def test_content_missing():
    err = fail(body([{"role": "assistant"}]))
    assert err.param == "messages[0].content"


def test_content_wrong_type():
    err = fail(body([{"role": "user", "content": 42}]))
    assert err.param == "messages[0].content"
    assert "string or a list" in err.message


def test_unsupported_part_type():
    err = fail(body([user(text("hi"), {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}})]))
    assert err.param == "messages[0].content[1].type"
    assert "input_audio" in err.message
    assert "only 'text', 'image_url' and 'video_url'" in err.message


def test_videos_and_images_are_counted_apart_in_prompt_order():
    video = lambda url=None, uuid=None: {"type": "video_url", "video_url": {"url": url} if url else None,
                                         **({"uuid": uuid} if uuid else {})}
    p = parse_chat_request(body([user(image(IMG_A), video("data:video/mp4;base64,AA=="), text("and"),
                                      video(uuid="clip-1"), image(IMG_B))]), max_images=2, max_videos=2)
    assert [(m.index, m.modality, m.ordinal, m.name, m.uuid) for m in p.media] == [
        (0, "image", 0, "image[0]", None), (1, "video", 0, "video[0]", None), (2, "video", 1, "video[1]", "clip-1"),
        (3, "image", 1, "image[1]", None)]
    assert p.messages[0].parts[1] == MediaPlaceholder(1, "video")
    err = fail(body([user(video(uuid="a"), video(uuid="b"))]), max_videos=1)
    assert (err.param, err.code) == ("messages[0].content[1]", "too_many_videos")
    assert "At most 1 video(s)" in err.message
    err = fail(body([user(video(uuid="a"))]), max_videos=0)
    assert err.code == "too_many_videos" and "takes no video" in err.message
    err = fail(body([user(video())]), max_videos=1)
    assert err.param == "messages[0].content[0].video_url" and "uuid" in err.message
    err = fail(body([{"role": "assistant", "content": [video(uuid="a")]}]), max_videos=1)
    assert "videos are only allowed in user messages" in err.message


def test_text_part_without_text():
    err = fail(body([user({"type": "text"})]))
    assert err.param == "messages[0].content[0].text"


def test_part_text_wrong_type():
    err = fail(body([user({"type": "text", "text": 5})]))
    assert err.param == "messages[0].content[0].text"
    assert "valid string" in err.message and "integer" in err.message


# --------------------------------------------------------------------------- errors: images


def test_image_part_without_url_or_uuid():
    err = fail(body([user(text("x")), user(text("y"), image())]))
    assert err.param == "messages[1].content[1].image_url"
    assert "uuid" in err.message and "url" in err.message


def test_image_url_null_url_without_uuid():
    err = fail(body([user({"type": "image_url", "image_url": {"url": None}})]))
    assert err.param == "messages[0].content[0].image_url"


def test_image_url_empty_string():
    err = fail(body([user(image(""))]))
    assert err.param == "messages[0].content[0].image_url.url"


def test_image_url_as_bare_string_rejected():
    err = fail(body([user({"type": "image_url", "image_url": IMG_B})]))
    assert err.param == "messages[0].content[0].image_url"
    assert "should be an object (got string)" in err.message


def test_bad_detail():
    err = fail(body([user(image(IMG_A, detail="ultra"))]))
    assert err.param == "messages[0].content[0].image_url.detail"


@pytest.mark.parametrize("uuid", ["", "   "])
def test_uuid_empty(uuid):
    err = fail(body([user(image(uuid=uuid))]))
    assert err.param == "messages[0].content[0].uuid"
    assert "non-empty" in err.message


def test_uuid_not_string():
    err = fail(body([user(image(uuid=123))]))
    assert err.param == "messages[0].content[0].uuid"


def test_uuid_too_long():
    err = fail(body([user(image(uuid="u" * 513))]))
    assert err.param == "messages[0].content[0].uuid"
    assert "512" in err.message
    # exactly at the limit is fine
    p = parse_chat_request(body([user(image(uuid="u" * 512))]), max_images=1)
    assert p.media[0].uuid == "u" * 512


def test_too_many_images():
    msgs = [user(image(IMG_A), image(IMG_A)), user(text("and"), image(uuid="x"))]
    err = fail(body(msgs), max_images=2)
    assert err.code == "too_many_images"
    assert "2" in err.message and "3" in err.message
    assert "limit-mm-per-prompt" in err.message
    assert err.param == "messages[1].content[1]"  # the first image past the limit
    # at the limit it passes
    assert len(parse_chat_request(body(msgs), max_images=3).media) == 3


def test_images_not_allowed_when_limit_zero():
    err = fail(body([user(image(IMG_A))]), max_images=0)
    assert err.code == "too_many_images"


@pytest.mark.parametrize("role", ["system", "assistant", "developer"])
def test_images_only_in_user_messages(role):
    err = fail(body([{"role": role, "content": [text("see"), image(IMG_A)]}, user(text("q"))]))
    assert err.param == "messages[0].content[1]"
    assert "only allowed in user messages" in err.message


# --------------------------------------------------------------------------- errors: sampling and flags


@pytest.mark.parametrize(
    "field,value,needle",
    [  # range and type checks are vLLM's (its request model and SamplingParams), as `vllm serve` answers them
        ("temperature", -0.1, "temperature"),
        ("top_p", 0, "top_p"),
        ("top_p", 1.01, "top_p"),
        ("max_tokens", 0, "max_tokens"),
        ("max_completion_tokens", -3, "max_tokens"),
        ("max_tokens", 5.5, "valid integer"),
        ("temperature", "hot", "valid number"),
        ("seed", "x", "valid integer"),
        ("n", 0, "n must be at least 1"),
        ("top_logprobs", -3, "top_logprobs"),
        ("presence_penalty", 5, "presence_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("min_p", 2, "min_p"),
        ("stream", "true", "valid boolean"),
        ("model", 3, "valid string"),
    ],
)
def test_sampling_and_type_errors(field, value, needle):
    err = fail(body(logprobs=field == "top_logprobs", **{field: value}))
    assert err.status_code == 400
    assert needle in err.message, err.message


def test_stop_wrong_types():
    assert fail(body(stop=7)).param.startswith("stop")


def test_stream_options_without_stream():
    err = fail(body(stream_options={"include_usage": True}))
    assert err.param == "stream_options"


def test_stream_options_bad_type():
    err = fail(body(stream=True, stream_options={"include_usage": "yes"}))
    assert err.param == "stream_options.include_usage"


def test_validation_error_does_not_echo_large_input():
    huge = "x" * 100_000
    err = fail(body([{"role": "user", "content": [{"type": "text", "text": ["not", huge]}]}]))
    assert len(err.message) < 500
    assert err.param == "messages[0].content[0].text"


def test_multiple_validation_errors_counted():
    err = fail(body(stream="a", model=3))
    assert "more error" in err.message


# --------------------------------------------------------------------------- errors module


def test_error_to_dict_shape_and_extra():
    e = IrisError("features evicted", status_code=409, code="mm_cache_miss", extra={"missing": [0, 2]})
    assert e.to_dict() == {
        "error": {
            "message": "features evicted",
            "type": "conflict_error",
            "param": None,
            "code": "mm_cache_miss",
            "missing": [0, 2],
        }
    }
    assert str(e) == "features evicted"
    b = bad_request("nope", param="x", code="c")
    assert (b.status_code, b.type, b.param, b.code) == (400, "invalid_request_error", "x", "c")
    with pytest.raises(ValueError):
        IrisError("x", extra={"message": "override"})


def test_tokenize_takes_text_messages_and_refuses_images_and_videos_by_name():
    from pipeline.api.tokenize import parse_tokenize_request

    job = parse_tokenize_request({"messages": [user(text("hi"))]}, 4)
    assert job.messages == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    for part in (image(IMG_A), {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="}}):
        with pytest.raises(IrisError) as ei:
            parse_tokenize_request({"messages": [user(part)]}, 4)
        assert ei.value.status_code == 400 and ei.value.param == "messages"
