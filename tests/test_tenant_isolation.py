"""Tenant resolution, per-tenant content keys and vLLM cache salts (no Ray)."""

from __future__ import annotations

from cache_service.keys import content_key, fingerprint_of, uuid_key
from deployments.config import IrisConfig
from pipeline.tenancy.tenant import cache_salt, tenant_of

FP = "0123abcd"
IMAGE = b"\x89PNG same bytes"


def test_defaults_are_the_safe_ones():
    config = IrisConfig()
    assert config.tenant_header is None
    assert config.share_content_cache_across_tenants is False


def test_tenant_header_is_ignored_unless_configured():
    claimed = {"x-iris-tenant": "victim"}
    assert tenant_of(claimed, None) == "default"
    assert tenant_of({**claimed, "authorization": "Bearer k1"}, None).startswith("key-")
    # Behind a trusted gateway that sets it, the header wins over the key.
    assert tenant_of({**claimed, "authorization": "Bearer k1"}, "x-iris-tenant") == "victim"


def test_api_keys_name_distinct_tenants_without_revealing_the_key():
    a = tenant_of({"authorization": "Bearer secret-a"}, None)
    b = tenant_of({"authorization": "Bearer secret-b"}, None)
    assert a != b and "secret" not in a and a == tenant_of({"authorization": "bearer  secret-a "}, None)
    assert tenant_of({"authorization": "Basic xyz"}, None) == "default"


def test_cache_salt_is_per_tenant_stable_and_opaque():
    assert cache_salt("tenant-a") == cache_salt("tenant-a")
    assert cache_salt("tenant-a") != cache_salt("tenant-b")
    assert "tenant" not in cache_salt("tenant-a") and len(cache_salt("x" * 256)) == 32


def test_content_keys_private_per_tenant_unless_shared():
    shared = content_key(FP, IMAGE)
    a, b = content_key(FP, IMAGE, tenant="tenant-a"), content_key(FP, IMAGE, tenant="tenant-b")
    assert len({shared, a, b}) == 3
    assert a == content_key(FP, IMAGE, tenant="tenant-a")
    assert shared.split(":")[3] == "c" and a.split(":")[3] == "t"
    assert {fingerprint_of(k) for k in (shared, a, b)} == {FP}
    # A tenant-private content key never equals a uuid key, whatever the uuid.
    digest = a.rsplit(":", 1)[1]
    assert uuid_key(FP, "tenant-a", digest) != a


def test_tricky_tenants_cannot_forge_another_tenants_content_key():
    # ':' is escaped, so "a:<hash>" as a tenant cannot land on tenant "a"'s key space.
    a = content_key(FP, IMAGE, tenant="a")
    forged_tenant = "a:" + a.rsplit(":", 1)[1]
    assert content_key(FP, b"other", tenant=forged_tenant).split(":")[4] != "a"
