"""Who is asking: the tenant that owns client-UUID cache keys."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping

from cache_service.keys import DEFAULT_TENANT

logger = logging.getLogger(__name__)

# The per-deployment secret that salts tenant labels of metrics and traces (set it from a Secret on
# every Ray pod, the same everywhere, so one tenant has one label across replicas).
METRIC_SALT_ENV = "IRIS_METRIC_SALT"
_process_salt: bytes | None = None


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The API key of `Authorization: Bearer <key>` (surrounding blanks dropped), or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def key_tenant(token: str) -> str:
    """The tenant an API key names when no configured tenant name owns it: `key-` + its hash,
    so keys are never stored or logged."""
    return "key-" + hashlib.sha256(token.encode()).hexdigest()[:24]


def tenant_of(headers: Mapping[str, str], tenant_header: str | None, key_owner: str | None = None) -> str:
    """The tenant of a request.

    `tenant_header` (e.g. X-Iris-Tenant) is honoured only when configured, which
    says a trusted gateway authenticates callers and sets it (stripping any copy a
    client sent); unconfigured (the default) the header is ignored, since any
    client could claim any tenant with it. Otherwise `key_owner`, the tenant an
    authenticated key belongs to (pipeline/tenancy/auth.py), or else the API key
    (Authorization: Bearer ...) names the tenant by its hash. Without either the
    request belongs to the default tenant.
    """
    if tenant_header:
        value = headers.get(tenant_header)
        if value:
            return value.strip()
    if key_owner is not None:
        return key_owner
    token = bearer_token(headers)
    return key_tenant(token) if token is not None else DEFAULT_TENANT


def cache_salt(tenant: str) -> str:
    """vLLM's `cache_salt` for a tenant: its prefix-cache blocks then match only the
    same tenant's, so nobody can tell from time to first token what another tenant
    prompted. Hashed so the tenant text itself never reaches the engine or its logs."""
    return hashlib.sha256(b"iris-cache-salt\0" + tenant.encode()).hexdigest()[:32]


def metric_tenant(tenant: str) -> str:
    """How metrics and traces name a tenant: an HMAC of the name under a per-deployment secret
    (`IRIS_METRIC_SALT`), so neither a tenant name nor anything derived from a key shows on a
    dashboard, and a guessed name cannot be confirmed without the secret. Without the variable,
    each process draws a random salt: labels are then opaque per process (one tenant has other
    labels on other replicas). `IRIS_METRIC_SALT=... python -c "from pipeline.tenancy.tenant
    import metric_tenant; print(metric_tenant('acme'))"` says which series is whose."""
    return hmac.new(_metric_salt(), tenant.encode(), hashlib.sha256).hexdigest()[:12]


def _metric_salt() -> bytes:
    global _process_salt
    configured = os.environ.get(METRIC_SALT_ENV)
    if configured:
        return b"iris-metric-tenant\0" + configured.encode()
    if _process_salt is None:
        _process_salt = secrets.token_bytes(32)
        logger.warning(
            "%s is not set: tenant labels of metrics are opaque per process (set it, the same on "
            "every Ray pod, for one label per tenant across replicas)",
            METRIC_SALT_ENV,
        )
    return _process_salt
