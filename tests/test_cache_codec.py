"""Byte form of Features: exact round trips and detection of corrupt values."""

import json
import tempfile

import pytest
import torch

from cache_service.codec import HEADER, CorruptValue, decode, encode
from cache_service.features import Features
from tests.cache_fixtures import assert_same_features, make_features


def all_dtypes_features() -> Features:
    g = torch.Generator().manual_seed(1)
    return Features(
        {
            "bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
            "fp16": torch.randn(3, 4, 2, generator=g).to(torch.float16),
            "fp32": torch.randn(11, generator=g),
            "fp64": torch.randn(2, 2, generator=g, dtype=torch.float64),
            "grid_thw": torch.tensor([[1, 24, 36]], dtype=torch.int64),
            "i32": torch.tensor([-1, 2**31 - 1], dtype=torch.int32),
            "u8": torch.arange(256, dtype=torch.uint8),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.25),
            "empty": torch.empty(0, 4),
            "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # not contiguous
        },
        {"num_tokens": 35, "model": "llava", "nested": {"list": [1, 2.5, None]}},
    )


@pytest.mark.parametrize("container", [bytes, bytearray])
def test_round_trip_is_exact(container):
    features = all_dtypes_features()
    value = container(encode(features))
    assert_same_features(features, decode(value))


def test_value_is_safetensors_after_the_header():
    """Any safetensors reader takes a value's payload: the same tensors, and Iris's meta."""
    from safetensors import safe_open
    from safetensors.torch import load

    features = all_dtypes_features()
    value = bytes(encode(features))
    loaded = load(value[HEADER.size :])
    assert loaded.keys() == features.tensors.keys()
    for name, tensor in features.tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor.contiguous()), name
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(value[HEADER.size :])
        f.flush()
        with safe_open(f.name, "pt") as st:
            assert json.loads(st.metadata()["iris.meta"]) == features.meta


def test_nbytes_counts_tensor_bytes():
    f = make_features(tokens=16, hidden=32)
    assert f.nbytes == 16 * 32 * 2 + 3 * 8
    assert len(encode(f)) > f.nbytes  # header + safetensors' header on top


def test_decode_points_into_the_value_unless_copy():
    features = make_features()
    value = encode(features)
    shared = decode(value).tensors["image_embeds"]
    copied = decode(value, copy=True).tensors["image_embeds"]
    # Zero the value's bytes: the zero-copy tensor sees it, the copy does not.
    value[HEADER.size :] = bytes(len(value) - HEADER.size)
    assert not torch.equal(shared, features.tensors["image_embeds"])
    assert torch.equal(copied, features.tensors["image_embeds"])


@pytest.mark.parametrize(
    "damage",
    [
        lambda v: v[:-1],  # truncated by one byte
        lambda v: v[: len(v) // 2],  # truncated in the middle
        lambda v: v[:10],  # shorter than the header
        lambda v: b"",
        lambda v: b"not a cache value at all, just garbage bytes",
        lambda v: v[:100] + bytes([v[100] ^ 0x01]) + v[101:],  # one bit flipped
        lambda v: b"XXXX" + v[4:],  # other format
    ],
)
def test_corrupt_values_are_rejected(damage):
    value = bytes(encode(make_features(tokens=64)))
    with pytest.raises(CorruptValue):
        decode(damage(value))


def test_unsupported_inputs():
    with pytest.raises(TypeError):
        Features({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError):
        Features({"x": [1, 2, 3]})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        encode(Features({"x": torch.zeros(2)}, {"not json": object()}))
