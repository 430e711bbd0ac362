"""Who is asking: the tenant that owns client-UUID cache keys."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from cache_service.keys import DEFAULT_TENANT


def tenant_of(headers: Mapping[str, str], tenant_header: str | None) -> str:
    """The tenant of a request.

    `tenant_header` (e.g. X-Iris-Tenant), when configured and present, wins: it is
    meant to be set by a trusted gateway that authenticated the caller. Otherwise
    the API key (Authorization: Bearer ...) names the tenant by its hash, so keys
    are never stored or logged. Without either the request belongs to the default tenant.
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
