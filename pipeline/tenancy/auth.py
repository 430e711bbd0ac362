"""API keys: which requests may come in, and the tenant each key belongs to (no Ray).

As `vllm serve --api-key`: once any key is configured, every request but /health must carry
one (`Authorization: Bearer <key>`), else 401. Keys come from a JSON file or environment
variable mapping tenant names to their keys ({"acme": ["key1", "key2"], ...}), e.g. a
Kubernetes Secret; never from the config itself, whose arguments Ray Serve writes to its logs.

Only SHA-256 digests of the keys are kept. A presented key's digest is compared with every
stored digest by hmac.compare_digest, all of them whatever matches, so the time taken says
nothing about which key, or how much of one, was right. No key is ever put in a message.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.errors import IrisError

TENANT_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class AuthConfig(BaseModel):
    # No input in error messages: whatever was written here may be a key.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    api_keys_file: str | None = Field(
        None,
        description='Path of a JSON file mapping tenant names to their keys: {"acme": ["key1", "key2"]} '
        "(a mounted Kubernetes Secret). Read by every ingress replica at start, and checked at build time.",
    )
    api_keys_env: str | None = Field(
        None,
        pattern=_ENV_NAME,
        description="Name of an environment variable holding the same JSON as api_keys_file (e.g. from a "
        "Kubernetes Secret via secretKeyRef). Read by every ingress replica at start, and checked at build time.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_keys_in_the_config(cls, data):
        if isinstance(data, dict) and "api_keys" in data:
            raise ValueError(
                "auth.api_keys: keys may not be written in the config, whose arguments Ray Serve "
                "writes to its logs; put them in the JSON of api_keys_file or api_keys_env"
            )
        return data

    @property
    def configured(self) -> bool:
        return self.api_keys_file is not None or self.api_keys_env is not None


def unauthorized() -> IrisError:
    """401 in OpenAI's shape (the same for a missing and a wrong key)."""
    return IrisError(
        "Incorrect or missing API key: send it as `Authorization: Bearer <key>`.",
        status_code=401,
        type="invalid_request_error",
        code="invalid_api_key",
    )


@dataclass(frozen=True)
class KeyRing:
    """The accepted keys, as (SHA-256 digest, tenant) pairs."""

    entries: tuple[tuple[bytes, str], ...]

    @classmethod
    def load(cls, config: AuthConfig, environ: Mapping[str, str] | None = None) -> KeyRing | None:
        """The keys `config` names; None when it names none (requests need no key). A ValueError
        names what is wrong (a file, a variable, a tenant), never a key."""
        if not config.configured:
            return None
        environ = os.environ if environ is None else environ
        owners: dict[bytes, str] = {}

        def add(key: str, tenant: str, where: str) -> None:
            if not key or key != key.strip() or any(c in key for c in "\r\n"):
                raise ValueError(f"{where}: a key of tenant {tenant!r} is empty or has blanks at its ends")
            digest = _digest(key)
            if digest in owners:
                raise ValueError(f"{where}: a key is listed twice (tenants {owners[digest]!r} and {tenant!r})")
            owners[digest] = tenant

        if config.api_keys_file is not None:
            where = f"auth.api_keys_file {config.api_keys_file}"
            try:
                with open(config.api_keys_file, encoding="utf-8") as f:
                    text = f.read()
            except OSError as err:
                raise ValueError(f"{where}: cannot be read ({err.strerror or type(err).__name__})") from None
            _add_mapping(text, where, add)
        if config.api_keys_env is not None:
            where = f"auth.api_keys_env {config.api_keys_env}"
            if config.api_keys_env not in environ:
                raise ValueError(f"{where}: not set in this process's environment")
            _add_mapping(environ[config.api_keys_env], where, add)
        if not owners:
            raise ValueError(
                "auth: keys are configured but none was found (an empty file or mapping would lock every client out)"
            )
        return cls(tuple(owners.items()))

    def tenant(self, key: str | None) -> str | None:
        """The tenant of `key`, or None when it is not an accepted key. Every stored digest is
        compared, in constant time each."""
        if key is None:
            return None
        digest = _digest(key)
        found = None
        for stored, tenant in self.entries:
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    def __repr__(self) -> str:
        return f"KeyRing({len(self.entries)} keys)"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _add_mapping(text: str, where: str, add) -> None:
    """{"tenant": ["key", ...] or "key"} -> add(key, tenant, where) for each."""
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as err:  # its message gives a position, never the text
        raise ValueError(f"{where}: not valid JSON (line {err.lineno}, column {err.colno})") from None
    if not isinstance(mapping, dict):
        raise ValueError(f"{where}: must be a JSON object mapping tenant names to lists of keys")
    for i, (tenant, keys) in enumerate(mapping.items()):
        if not TENANT_NAME.match(tenant) or tenant.startswith("key-"):
            # Not echoed: a mapping written the wrong way round would put a key here.
            raise ValueError(
                f"{where}: tenant name number {i + 1} must match {TENANT_NAME.pattern} and not "
                "start with `key-` (the names of unmapped keys' tenants)"
            )
        keys = [keys] if isinstance(keys, str) else keys
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"{where}: tenant {tenant!r} must map to a key or a non-empty list of keys (strings)")
        for key in keys:
            add(key, tenant, where)
