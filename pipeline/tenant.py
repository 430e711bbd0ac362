"""Who is asking: the tenant that owns client-UUID cache keys."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from cache_service.keys import DEFAULT_TENANT


def tenant_of(headers: Mapping[str, str], tenant_header: str | None) -> str:
    """The tenant of a request.

    `tenant_header` (e.g. X-Iris-Tenant) is honoured only when configured, which
    says a trusted gateway authenticates callers and sets it (stripping any copy a
    client sent); unconfigured (the default) the header is ignored, since any
    client could claim any tenant with it. Otherwise the API key (Authorization:
    Bearer ...) names the tenant by its hash, so keys are never stored or logged.
    Without either the request belongs to the default tenant.
    """
    if tenant_header:
        value = headers.get(tenant_header)
        if value:
            return value.strip()
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return "key-" + hashlib.sha256(token.strip().encode()).hexdigest()[:24]
    return DEFAULT_TENANT


def cache_salt(tenant: str) -> str:
    """vLLM's `cache_salt` for a tenant: its prefix-cache blocks then match only the
    same tenant's, so nobody can tell from time to first token what another tenant
    prompted. Hashed so the tenant text itself never reaches the engine or its logs."""
    return hashlib.sha256(b"iris-cache-salt\0" + tenant.encode()).hexdigest()[:32]
