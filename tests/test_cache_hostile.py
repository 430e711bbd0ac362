"""Hostile values in Redis never fail a reader (issue 42): whatever bytes sit under a key, a
FeatureCache read is a miss, the key is deleted (so the next request is not wedged until the
TTL) and the value is counted as `corrupt` (the codec refuses it) or `rejected` (decodable, but
not this model's features). Real Redis; the values are written as raw bytes with redis-py, most
with a valid checksum, so the codec's later checks are what stands in the way.

HOSTILE is shared with tests/test_ec_connector_reads.py, which feeds the same values to the EC
connector's feature-plane reader."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import xxhash

from cache_service.codec import HEADER, MAGIC, encode
from cache_service.config import CacheConfig
from cache_service.feature_cache import FeatureCache
from cache_service.features import Features
from cache_service.keys import uuid_key
from cache_service.validation import FINGERPRINT_META, ValueCheck
from tests.cache_fixtures import SHARED_REDIS_URL

FP, OTHER_FP = "0123abcd", "fedc9876"
TOKENS, HIDDEN = 16, 32
EMBEDS = bytes(torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16).view(torch.uint8).flatten().tolist())
META = {"num_tokens": TOKENS, FINGERPRINT_META: FP}


def expectation(features: Features) -> str | None:
    """A family's feature_problem in small: bf16 [16, 32] image_embeds, meta num_tokens 16."""
    t = features.tensors.get("image_embeds")
    if set(features.tensors) != {"image_embeds"} or t.dtype != torch.bfloat16 or list(t.shape) != [TOKENS, HIDDEN]:
        return "wrong embeddings"
    return None if features.num_tokens == t.shape[0] else "num_tokens does not match the rows"


def with_checksum(payload: bytes) -> bytes:
    """A value whose checksum matches `payload`: only the codec's parsing and the checks refuse it."""
    return HEADER.pack(MAGIC, 1, xxhash.xxh3_64_intdigest(payload)) + payload


def raw(header: dict | str, data: bytes = b"", header_len: int | None = None) -> bytes:
    """A safetensors payload of our own making (any header, any length field) with a valid checksum."""
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    return with_checksum(struct.pack("<Q", len(text) if header_len is None else header_len) + text + data)


def tensor(dtype="BF16", shape=(TOKENS, HIDDEN), offsets=(0, len(EMBEDS))) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def value_with(meta_json: str, **tensors) -> bytes:
    return raw({"__metadata__": {"iris.meta": meta_json}, **tensors}, EMBEDS)


def features(embeds=None, **meta) -> bytes:
    embeds = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16) if embeds is None else embeds
    return bytes(encode(Features({"image_embeds": embeds}, {**META, **meta})))


NESTED = "[" * 50_000 + "]" * 50_000
GOOD_META = json.dumps(META)

# name -> (the value under an image uuid key, the counter it must bump)
HOSTILE: dict[str, tuple[bytes, str]] = {
    # The three: metadata that is valid JSON but no object, or nested past any parser.
    "meta_empty_list": (value_with("[]", image_embeds=tensor()), "corrupt"),
    "meta_string": (value_with('"x"', image_embeds=tensor()), "corrupt"),
    "meta_nested_50000": (value_with(NESTED, image_embeds=tensor()), "corrupt"),
    # The safetensors header itself.
    "header_nested_50000": (raw(NESTED), "corrupt"),
    "header_a_list": (raw("[]"), "corrupt"),
    "header_not_utf8": (with_checksum(struct.pack("<Q", 2) + b"\xff\xfe"), "corrupt"),
    "huge_header_length": (raw({"__metadata__": {"iris.meta": GOOD_META}}, header_len=1 << 62), "corrupt"),
    "metadata_not_a_dict": (raw({"__metadata__": ["iris.meta"], "image_embeds": tensor()}, EMBEDS), "corrupt"),
    "meta_json_not_a_string": (raw({"__metadata__": {"iris.meta": 5}, "image_embeds": tensor()}, EMBEDS), "corrupt"),
    "missing_meta": (raw({"image_embeds": tensor()}, EMBEDS), "corrupt"),
    "meta_with_nan": (value_with(f'{{"num_tokens": NaN, "fingerprint": "{FP}"}}', image_embeds=tensor()), "corrupt"),
    "tensor_entry_not_a_dict": (value_with(GOOD_META, image_embeds=5), "corrupt"),
    # Tensors: truncated (checksum recomputed over the short value), bad dtype / shape / range.
    "truncated_tensor": (
        raw({"__metadata__": {"iris.meta": GOOD_META}, "image_embeds": tensor()}, EMBEDS[:-64]),
        "corrupt",
    ),
    "unknown_dtype": (value_with(GOOD_META, image_embeds=tensor(dtype="F8_E4M3")), "corrupt"),
    "dtype_not_a_string": (value_with(GOOD_META, image_embeds=tensor(dtype=["BF16"])), "corrupt"),
    "negative_shape": (value_with(GOOD_META, image_embeds=tensor(shape=(-16, -32))), "corrupt"),
    "bool_shape": (value_with(GOOD_META, image_embeds=tensor(shape=(True, True), offsets=(0, 2))), "corrupt"),
    "gigantic_shape_no_bytes": (
        value_with(GOOD_META, image_embeds=tensor(shape=(1 << 62, 1 << 62, 0), offsets=(0, 0))),
        "corrupt",
    ),
    "gigantic_shape": (value_with(GOOD_META, image_embeds=tensor(shape=(1 << 31, 1 << 31))), "corrupt"),
    "too_many_dims": (value_with(GOOD_META, image_embeds=tensor(shape=(1,) * 64 + (TOKENS, HIDDEN))), "corrupt"),
    "offsets_reversed": (value_with(GOOD_META, image_embeds=tensor(offsets=(len(EMBEDS), 0))), "corrupt"),
    "offsets_not_ints": (value_with(GOOD_META, image_embeds=tensor(offsets=("0", "1024"))), "corrupt"),
    # Well-formed values that are not this model's features for this key.
    "another_models_fingerprint": (features(fingerprint=OTHER_FP), "rejected"),
    "no_fingerprint": (
        bytes(
            encode(Features({"image_embeds": torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)}, {"num_tokens": TOKENS}))
        ),
        "rejected",
    ),
    "wrong_modality": (features(modality="video"), "rejected"),
    "modality_not_a_string": (features(modality=["image"]), "rejected"),
    "wrong_dtype": (features(torch.ones(TOKENS, HIDDEN, dtype=torch.float32)), "rejected"),
    "missing_num_tokens": (
        bytes(
            encode(Features({"image_embeds": torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)}, {FINGERPRINT_META: FP}))
        ),
        "rejected",
    ),
    "shape_num_tokens_mismatch": (features(num_tokens=TOKENS * 4), "rejected"),
    "nan_values": (features(torch.full((TOKENS, HIDDEN), float("nan"), dtype=torch.bfloat16)), "rejected"),
    "inf_values": (features(torch.full((TOKENS, HIDDEN), float("inf"), dtype=torch.bfloat16)), "rejected"),
}


@pytest.fixture
async def checked_cache(namespace):
    cache = FeatureCache(CacheConfig(redis_url=SHARED_REDIS_URL, namespace=namespace), check=ValueCheck(expectation))
    yield cache
    await cache.close()


def test_the_stand_in_check_accepts_the_honest_value():
    """So each hostile case differs from an accepted value only in what it names."""
    from cache_service.codec import decode

    honest = decode(value_with(GOOD_META, image_embeds=tensor()))
    assert ValueCheck(expectation).problem(uuid_key(FP, None, "x"), honest) is None
    assert ValueCheck(expectation).problem(uuid_key(FP, None, "x"), decode(features())) is None


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_value_is_a_counted_deleted_miss_then_recomputed(case, namespace, raw_redis, checked_cache):
    value, counter = HOSTILE[case]
    key = uuid_key(FP, "default", f"upload-free-{case}", namespace)
    raw_redis.set(key, value)

    # The upload-free read: a miss (409 for the request), the key gone, the value counted.
    assert await checked_cache.get_many([key]) == [None]
    assert raw_redis.exists(key) == 0
    stats = checked_cache.stats()
    assert stats[counter] == 1 and stats["l2_hits"] == 0 and stats["l1_entries"] == 0, stats

    # Written again, the read that carries the bytes recomputes and replaces it.
    raw_redis.set(key, value)
    honest = Features({"image_embeds": torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16)}, META)

    async def compute(indexes):
        return [honest for _ in indexes]

    [result] = await checked_cache.get_or_compute_many([key], compute)
    assert result.computed and checked_cache.stats()[counter] == 2
    assert raw_redis.get(key) == bytes(encode(honest))


def test_the_big_values_of_the_codec_are_refused_before_allocation():
    """A declared shape of 2**124 elements is refused by its bounds, in no time and no memory."""
    from cache_service.codec import CorruptValue, decode

    for case in ("gigantic_shape", "gigantic_shape_no_bytes", "huge_header_length"):
        with pytest.raises(CorruptValue):
            decode(HOSTILE[case][0])
