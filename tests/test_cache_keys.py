"""Key format, isolation by model and tenant, and escaping of client text."""

import hashlib
import itertools

import pytest
from blake3 import blake3

from cache_service.keys import (
    MAX_UUID_CHARS,
    content_hash,
    content_key,
    uuid_key,
)

FP = "0123abcd"


def test_content_key_format_and_hash():
    data = b"\x89PNG fake image bytes"
    assert content_hash(data) == blake3(data).hexdigest()
    assert content_hash(data) != hashlib.sha256(data).hexdigest()
    assert content_key(FP, data) == f"iris:v1:{FP}:c:{blake3(data).hexdigest()}"
    assert content_key(FP, data, namespace="t-1") == f"t-1:v1:{FP}:c:{blake3(data).hexdigest()}"
    assert content_key(FP, data) != content_key(FP, data + b"\0")


def test_uuid_key_format_and_default_tenant():
    assert uuid_key(FP, "acme", "img-1") == f"iris:v1:{FP}:u:acme:img-1"
    assert uuid_key(FP, None, "img-1") == f"iris:v1:{FP}:u:default:img-1"
    assert uuid_key(FP, "", "img-1") == uuid_key(FP, None, "img-1")


def test_fingerprint_isolates_models():
    data = b"same image"
    assert content_key("aa", data) != content_key("bb", data)
    assert uuid_key("aa", "t", "u") != uuid_key("bb", "t", "u")


def test_tenant_isolates_uuid_keys_but_content_keys_are_shared():
    assert content_key(FP, b"img-a") == content_key(FP, b"img-a")  # no tenant in a shared content key
    assert uuid_key(FP, "t1", "x") != uuid_key(FP, "t2", "x")


def test_tricky_tenants_and_uuids_do_not_collide():
    parts = ["a", "a:b", "b", "a%3Ab", ":", "", "default", "a:b:c", "b:c", "%", "é", "\n", "a b", "u:x", "c:h"]
    tenants = [None] + [p for p in parts if p]
    keys = {}
    for tenant, uid in itertools.product(tenants, [p for p in parts if p]):
        key = uuid_key(FP, tenant, uid)
        # Exactly six fields: no ':' left inside tenant or uuid.
        assert len(key.split(":")) == 6, key
        assert "\n" not in key and " " not in key
        effective_tenant = tenant or "default"
        assert keys.setdefault(key, (effective_tenant, uid)) == (effective_tenant, uid), key
    assert uuid_key(FP, "a:b", "c") != uuid_key(FP, "a", "b:c")
    # A uuid cannot forge a content key either.
    assert uuid_key(FP, "x", "c:" + "0" * 64).split(":")[3] == "u"


def test_invalid_inputs_raise_value_error():
    with pytest.raises(ValueError):
        uuid_key(FP, "t", "x" * (MAX_UUID_CHARS + 1))
    uuid_key(FP, "t", "x" * MAX_UUID_CHARS)  # the bound itself is fine
    with pytest.raises(ValueError):
        uuid_key(FP, "t", "")
    with pytest.raises(ValueError):
        uuid_key(FP, "t", "\ud800")  # lone surrogate: no UTF-8 form
    with pytest.raises(ValueError):
        content_key("NOT-HEX", b"x")
    with pytest.raises(ValueError):
        content_key(FP, b"x", namespace="a:b")
