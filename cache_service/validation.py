"""What a value read from Redis must satisfy before it may reach a model.

The codec's checksum catches truncated or garbled bytes, not a well-formed value
that is wrong for this model: one written by another model version during a
rolling update, by a bug, or by anyone who can write to Redis (a valid codec
value is easy to forge). `ValueCheck` rejects those too:

- fingerprint: the writer stamps the model fingerprint into the value's meta
  (`FINGERPRINT_META`); it must equal the fingerprint in the key the value was
  read from, so a value copied or written under another model's key is refused;
- expectation: a callback, normally the model family's `feature_problem`, that
  knows the tensors' names, dtype, hidden size and token count.

A rejected value is handled like a corrupt one (counted, deleted, a miss).
Values in L1 are not re-checked: only this process put them there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cache_service.codec import Features
from cache_service.keys import fingerprint_of

FINGERPRINT_META = "fingerprint"

# Returns why the features are unacceptable, or None when they are fine.
Expectation = Callable[[Features], "str | None"]


@dataclass(frozen=True)
class ValueCheck:
    expectation: Expectation | None = None
    require_fingerprint: bool = True

    def problem(self, key: str, features: Features) -> str | None:
        if self.require_fingerprint:
            stamped = features.meta.get(FINGERPRINT_META)
            expected = fingerprint_of(key)
            if expected is None:
                return "key has no model fingerprint"
            if stamped != expected:
                return f"value was written for model {stamped!r}, key is for {expected!r}"
        if self.expectation is not None:
            try:
                return self.expectation(features)
            except Exception as exc:  # a hostile value must never crash the reader
                return f"expectation check failed: {exc!r}"
        return None


def stamp_fingerprint(features: Features, fingerprint: str) -> Features:
    """The same tensors with the writer's model fingerprint in their meta."""
    return Features(features.tensors, {**features.meta, FINGERPRINT_META: fingerprint})
