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


# --- content uuids: blake3:<hash>, the reserved uuid form that names a content key ---------------


def test_a_content_uuid_maps_to_the_content_key_of_its_bytes_with_its_tenant_scoping():
    from cache_service.keys import content_uuid, item_key

    data = b"\x89PNG the bytes"
    cuid = content_uuid(data)
    assert cuid == f"blake3:{blake3(data).hexdigest()}"
    # Upload-free by content: exactly the key the server computes for the bytes, private or shared.
    assert item_key(FP, "acme", cuid, None, content_owner="acme") == content_key(FP, data, tenant="acme")
    assert item_key(FP, "acme", cuid, None, content_owner=None) == content_key(FP, data)
    assert item_key(FP, "acme", None, data, content_owner="acme") == content_key(FP, data, tenant="acme")
    # With the bytes: checked, and the same key.
    assert item_key(FP, "acme", cuid, data, content_owner="acme") == content_key(FP, data, tenant="acme")
    # Another tenant naming the hash gets its own content key, not acme's.
    assert item_key(FP, "other", cuid, None, content_owner="other") != content_key(FP, data, tenant="acme")
    # Namespace and modality as for content keys.
    assert item_key(FP, "a", cuid, None, namespace="n-1", modality="video", content_owner="a") == content_key(
        FP, data, "n-1", "a", "video"
    )
    # An ordinary uuid stays a uuid key, with or without bytes.
    assert item_key(FP, "acme", "sku-1", data, content_owner="acme") == uuid_key(FP, "acme", "sku-1")


def test_content_uuids_never_collide_with_uuid_keys():
    """A content uuid maps to a content key (kind c/t), never to the uuid key of that text, so a
    client's old uuid that happens to read blake3:... cannot reach another client's uuid key."""
    from cache_service.keys import content_uuid, item_key

    cuid = content_uuid(b"x")
    key = item_key(FP, "acme", cuid, None, content_owner="acme")
    assert ":t:acme:" in key and key != uuid_key(FP, "acme", cuid)


@pytest.mark.parametrize(
    "bad",
    [
        "blake3:",
        "blake3:abc",
        "blake3:" + "A" * 64,
        "blake3:" + "0" * 63,
        "blake3:" + "0" * 65,
        "BLAKE3:" + "0" * 64,
        "Blake3:" + "0" * 64,
        "blake3:" + "g" * 64,
        "blake3: " + "0" * 64,
        "blake3:" + "0" * 64 + "\n",
    ],
)
def test_a_malformed_content_uuid_is_refused(bad):
    from cache_service.keys import InvalidContentUuid, item_key, parse_content_uuid

    with pytest.raises(InvalidContentUuid):
        parse_content_uuid(bad)
    with pytest.raises(InvalidContentUuid):
        item_key(FP, "acme", bad, None, content_owner="acme")


def test_ordinary_uuids_are_not_content_uuids():
    from cache_service.keys import parse_content_uuid

    for uid in (None, "", "sku-1", "blake3", "blake3-" + "0" * 64, "x-blake3:" + "0" * 64, "blake2:" + "0" * 64):
        assert parse_content_uuid(uid) is None


def test_bytes_that_do_not_match_their_content_uuid_are_refused():
    """Else a client could store its own bytes' features under another image's content key."""
    from cache_service.keys import InvalidContentUuid, content_uuid, item_key

    with pytest.raises(InvalidContentUuid, match="not the blake3 hash"):
        item_key(FP, "acme", content_uuid(b"the victim's image"), b"the attacker's image", content_owner=None)
