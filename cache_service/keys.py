"""Cache keys: who an image's features belong to, as one Redis key string.

Format, version 1 (bump the version when the format or the value codec changes;
old keys then simply stop being read and expire by TTL):

    <namespace>:v1:<fingerprint>:c:<hash>              content key, shared by tenants
    <namespace>:v1:<fingerprint>:t:<tenant>:<hash>     content key private to a tenant
    <namespace>:v1:<fingerprint>:u:<tenant>:<uuid>     client-UUID key

Videos have keys of their own kinds, `vc`, `vt` and `vu` for `c`, `t` and `u`: vLLM's
`multi_modal_uuids` are per modality, so one uuid may name an image and a video.

- namespace: deployment-wide prefix, default "iris" (tests use one per run).
  Letters, digits, '_', '-', '.' only, so it can never contain a ':'.
- fingerprint: short lowercase hex naming the model (weights + preprocessing),
  computed elsewhere. Features of one model are never served to another.
- hash: blake3 of the raw image bytes as uploaded, before any decoding, as 64
  lowercase hex chars. Shared content keys serve equal bytes to every tenant;
  with sharing off (`content_key(..., tenant=...)`) a tenant cannot learn, from
  cache hits or timing, whether another tenant sent an image.
- tenant, uuid: client text, percent-escaped (RFC 3986 unreserved characters are
  kept, everything else, ':' '%' '/' spaces, control characters and non-ASCII
  included, becomes %XX of its UTF-8 bytes). Escaping is injective and leaves no
  ':' inside a field, so no choice of tenant or uuid can produce another key.
  UUID keys carry the tenant so that one tenant cannot read another's features
  by guessing an id; a missing tenant is "default".

Client UUIDs follow vLLM's `multi_modal_uuids`: one entry per item, and `None`
means "use the content key" (the caller picks `uuid_key` or `content_key`, or `item_key`
does).

Reserved uuid form, content uuids: `blake3:<64 lowercase hex>` names an item by its content
(the hash above), so a client can send an item it sent before without choosing ids itself
(iris_client computes it). Such a uuid maps to the item's content key, with the content key's
tenant scoping, never to a uuid key; a uuid that starts with `blake3:` (any case) and is not
exactly that form is refused, and one sent with bytes must be their hash (else a client could
store its bytes under another image's content key).
"""

from __future__ import annotations

import re
from urllib.parse import quote

from blake3 import blake3

KEY_VERSION = "v1"
DEFAULT_NAMESPACE = "iris"
DEFAULT_TENANT = "default"
MAX_UUID_CHARS = 512  # same bound as the request parser's
MAX_TENANT_CHARS = 256
MAX_FINGERPRINT_CHARS = 64

_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_FINGERPRINT_RE = re.compile(rf"[0-9a-f]{{1,{MAX_FINGERPRINT_CHARS}}}")


def content_hash(data: bytes) -> str:
    """blake3 hex digest of the raw bytes."""
    # Single-threaded: gigabytes a second, far more than image uploads need.
    return blake3(data).hexdigest()


def content_key(
    fingerprint: str,
    data: bytes,
    namespace: str = DEFAULT_NAMESPACE,
    tenant: str | None = None,
    modality: str = "image",
) -> str:
    """Key of an image (or video) by its content: shared across tenants when `tenant` is None,
    else private to that tenant."""
    return _content_key_of_hash(fingerprint, content_hash(data), namespace, tenant, modality)


def _content_key_of_hash(fingerprint: str, digest: str, namespace: str, tenant: str | None, modality: str) -> str:
    if tenant is None:
        return f"{_prefix(namespace, fingerprint)}:{_kind('c', modality)}:{digest}"
    return f"{_prefix(namespace, fingerprint)}:{_kind('t', modality)}:{_escape(_tenant(tenant))}:{digest}"


CONTENT_UUID_PREFIX = "blake3:"
_CONTENT_UUID_RE = re.compile(r"blake3:([0-9a-f]{64})")


class InvalidContentUuid(ValueError):
    """A uuid in the reserved `blake3:` form that is malformed, or does not match its bytes."""


def content_uuid(data: bytes) -> str:
    """The reserved-form uuid naming `data` by content (what iris_client sends)."""
    return CONTENT_UUID_PREFIX + content_hash(data)


def parse_content_uuid(uuid: str | None) -> str | None:
    """The hash a content uuid names; None for an ordinary uuid (or none). Raises
    InvalidContentUuid for a uuid in the reserved form that is not exactly blake3:<64 hex>."""
    if not isinstance(uuid, str) or uuid[: len(CONTENT_UUID_PREFIX)].lower() != CONTENT_UUID_PREFIX:
        return None
    match = _CONTENT_UUID_RE.fullmatch(uuid)
    if match is None:
        raise InvalidContentUuid(
            f"a uuid starting with {CONTENT_UUID_PREFIX!r} is a content key and must be "
            f"{CONTENT_UUID_PREFIX}<64 lowercase hex digits of the blake3 hash of the bytes>, got {uuid[:80]!r}"
        )
    return match.group(1)


def item_key(
    fingerprint: str,
    tenant: str | None,
    uuid: str | None,
    data: bytes | None,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    modality: str = "image",
    content_owner: str | None = None,
) -> str:
    """The key of one request item: its uuid's key, the content key a content uuid names
    (checked against `data` when the bytes came too), or the content key of `data`.
    `content_owner`: the tenant content keys are private to, None when shared (the caller's
    `share_content_cache_across_tenants`). Raises ValueError (InvalidContentUuid for the
    reserved form) for what the client must fix."""
    digest = parse_content_uuid(uuid)
    if digest is None and uuid:
        return uuid_key(fingerprint, tenant, uuid, namespace, modality)
    if data is not None:
        actual = content_hash(data)
        if digest is not None and actual != digest:
            raise InvalidContentUuid(
                f"uuid {uuid!r} is not the blake3 hash of the bytes sent with it "
                f"(they hash to {CONTENT_UUID_PREFIX}{actual})"
            )
        digest = actual
    if digest is None:
        raise ValueError("an item needs bytes or a uuid")
    return _content_key_of_hash(fingerprint, digest, namespace, content_owner, modality)


def uuid_key(
    fingerprint: str, tenant: str | None, uuid: str, namespace: str = DEFAULT_NAMESPACE, modality: str = "image"
) -> str:
    """Key of an image (or video) by a client-supplied id, private to the tenant."""
    if not isinstance(uuid, str) or not uuid:
        raise ValueError("uuid must be a non-empty string")
    if len(uuid) > MAX_UUID_CHARS:
        raise ValueError(f"uuid longer than {MAX_UUID_CHARS} characters")
    return f"{_prefix(namespace, fingerprint)}:{_kind('u', modality)}:{_escape(_tenant(tenant))}:{_escape(uuid)}"


_MODALITY_KINDS = {"image": "", "video": "v"}


def _kind(kind: str, modality: str) -> str:
    if modality not in _MODALITY_KINDS:
        raise ValueError(f"no keys for modality {modality!r}")
    return _MODALITY_KINDS[modality] + kind


def fingerprint_of(key: str) -> str | None:
    """The model fingerprint in a key of this format, or None for any other string."""
    parts = key.split(":")
    if len(parts) < 5 or parts[1] != KEY_VERSION or not _FINGERPRINT_RE.fullmatch(parts[2]):
        return None
    return parts[2]


def modality_of(key: str) -> str | None:
    """The modality a key of this format is for ("image", "video"), or None for any other string."""
    parts = key.split(":")
    if fingerprint_of(key) is None:
        return None
    for modality, prefix in _MODALITY_KINDS.items():
        if parts[3] in (prefix + "c", prefix + "t", prefix + "u"):
            return modality
    return None


def _tenant(tenant: str | None) -> str:
    if tenant is None or tenant == "":
        return DEFAULT_TENANT
    if not isinstance(tenant, str):
        raise ValueError("tenant must be a string or None")
    if len(tenant) > MAX_TENANT_CHARS:
        raise ValueError(f"tenant longer than {MAX_TENANT_CHARS} characters")
    return tenant


def _prefix(namespace: str, fingerprint: str) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise ValueError(f"namespace must match {_NAMESPACE_RE.pattern}: {namespace!r}")
    if not isinstance(fingerprint, str) or not _FINGERPRINT_RE.fullmatch(fingerprint):
        raise ValueError(f"fingerprint must be 1-{MAX_FINGERPRINT_CHARS} lowercase hex chars")
    return f"{namespace}:{KEY_VERSION}:{fingerprint}"


def _escape(text: str) -> str:
    # safe="" so ':' and '/' are escaped too; errors="strict" rejects lone
    # surrogates, which have no UTF-8 form and so no unique escape.
    return quote(text, safe="", encoding="utf-8", errors="strict")
