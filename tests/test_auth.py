"""API keys -> tenants (pipeline/tenancy/auth.py), without Ray: where keys come from, what is refused at
start-up, and that no message or repr ever shows a key."""

from __future__ import annotations

import hmac
import json

import pytest
from pydantic import ValidationError

from deployments.config import IrisConfig
from pipeline.tenancy.auth import AuthConfig, KeyRing, unauthorized
from pipeline.tenancy.tenant import bearer_token, key_tenant, tenant_of

KEYS = {"acme": ["sk-acme-one-3f9a", "sk-acme-two-77c1"], "globex": "sk-globex-5b2e"}
ALL_KEYS = ["sk-acme-one-3f9a", "sk-acme-two-77c1", "sk-globex-5b2e"]


def keyring(tmp_path, mapping=KEYS, **config) -> KeyRing | None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(mapping))
    return KeyRing.load(AuthConfig(api_keys_file=str(path), **config))


def test_no_keys_configured_means_no_check_and_todays_tenants():
    assert AuthConfig().configured is False and KeyRing.load(AuthConfig()) is None
    assert IrisConfig().auth == AuthConfig()
    assert tenant_of({"authorization": "Bearer k1"}, None) == key_tenant("k1")
    assert tenant_of({}, None) == "default"


def test_keys_from_a_file_name_their_tenants(tmp_path):
    ring = keyring(tmp_path)
    assert ring.tenant("sk-acme-one-3f9a") == ring.tenant("sk-acme-two-77c1") == "acme"
    assert ring.tenant("sk-globex-5b2e") == "globex"
    for wrong in ("sk-acme-one-3f9", "sk-acme-one-3f9ax", "SK-GLOBEX-5B2E", "", None):
        assert ring.tenant(wrong) is None
    # The owner names the tenant; a tenant header is still honoured only when configured.
    headers = {"authorization": "Bearer sk-globex-5b2e", "x-iris-tenant": "acme"}
    assert tenant_of(headers, None, ring.tenant(bearer_token(headers))) == "globex"
    assert tenant_of(headers, "x-iris-tenant", ring.tenant(bearer_token(headers))) == "acme"


def test_keys_from_the_environment(tmp_path):
    env = {"IRIS_API_KEYS": json.dumps({"acme": ["sk-acme-one-3f9a"]})}
    ring = KeyRing.load(AuthConfig(api_keys_env="IRIS_API_KEYS"), env)
    assert ring.tenant("sk-acme-one-3f9a") == "acme"
    assert ring.tenant("sk-globex-5b2e") is None


def test_keys_written_in_the_config_are_refused_without_echoing_them():
    """Ray Serve writes an application's arguments to its logs: keys there would be logged."""
    with pytest.raises(ValidationError) as refused:
        IrisConfig.model_validate({"auth": {"api_keys": ["sk-inline-e0d4"]}})
    assert "api_keys_file or api_keys_env" in str(refused.value) and "sk-inline" not in str(refused.value)


def test_only_digests_are_kept_and_nothing_shows_a_key(tmp_path):
    ring = keyring(tmp_path)
    config = IrisConfig(auth={"api_keys_file": str(tmp_path / "keys.json")})
    shown = " ".join([repr(ring), str(ring), repr(config), str(config), repr(config.auth), str(ring.entries)])
    for key in ALL_KEYS:
        assert key not in shown
        assert key.encode() not in b"".join(digest for digest, _ in ring.entries)
    assert "sk-" not in json.dumps(unauthorized().to_dict())


def test_every_stored_digest_is_compared(tmp_path, monkeypatch):
    """Constant time over all entries: a match on the first key does not stop the comparisons."""
    ring = keyring(tmp_path)
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for key in ("sk-acme-one-3f9a", "sk-globex-5b2e", "nope"):
        calls.clear()
        ring.tenant(key)
        assert len(calls) == len(ring.entries) == 3


@pytest.mark.parametrize(
    "mapping, problem",
    [
        ({"acme": ["sk-acme-one-3f9a"], "globex": ["sk-acme-one-3f9a"]}, "listed twice (tenants 'acme' and 'globex')"),
        ({"sk-acme-one-3f9a!": "acme"}, "tenant name number 1 must match"),  # written the wrong way round
        ({"key-acme": ["sk-acme-one-3f9a"]}, "not start with `key-`"),
        ({"acme": []}, "non-empty list of keys"),
        ({"acme": [" sk-acme-one-3f9a"]}, "blanks at its ends"),
        ({}, "none was found"),
        (["sk-acme-one-3f9a"], "must be a JSON object"),
    ],
)
def test_bad_mappings_are_refused_without_showing_a_key(tmp_path, mapping, problem):
    with pytest.raises(ValueError) as err:
        keyring(tmp_path, mapping)
    assert problem in str(err.value)
    assert "sk-acme" not in str(err.value)


def test_unreadable_sources_name_the_source_not_the_keys(tmp_path):
    with pytest.raises(ValueError, match="api_keys_file .*missing.json: cannot be read"):
        KeyRing.load(AuthConfig(api_keys_file=str(tmp_path / "missing.json")))
    with pytest.raises(ValueError, match="api_keys_env IRIS_KEYS_UNSET: not set"):
        KeyRing.load(AuthConfig(api_keys_env="IRIS_KEYS_UNSET"), {})
    with pytest.raises(ValueError) as err:
        KeyRing.load(AuthConfig(api_keys_env="K"), {"K": '{"acme": ["sk-acme-one-3f9a"'})
    assert "not valid JSON (line 1" in str(err.value) and "sk-acme" not in str(err.value)
    with pytest.raises(ValidationError):
        AuthConfig(api_keys_env="not a variable name")
    with pytest.raises(ValidationError):
        AuthConfig(unknown=1)


def test_bearer_token():
    assert bearer_token({"authorization": "Bearer  abc "}) == "abc"
    assert bearer_token({"authorization": "bearer abc"}) == "abc"
    assert bearer_token({"authorization": "Basic abc"}) is None
    assert bearer_token({"authorization": "Bearer "}) is None and bearer_token({}) is None
