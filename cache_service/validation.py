"""What a value read from Redis must satisfy before it may reach a model.

The codec's checksum catches truncated or garbled bytes, not a well-formed value
that is wrong for this model: one written by another model version during a
rolling update, by a bug, or by anyone who can write to Redis (a valid codec
value is easy to forge). `ValueCheck` rejects those too:

- fingerprint: the writer stamps the model fingerprint into the value's meta
  (`FINGERPRINT_META`); it must equal the fingerprint in the key the value was
  read from, so a value copied or written under another model's key is refused;
- modality: a value's meta says whether it is an image's or a video's; it must be the
  modality of its key (a video's features under an image's uuid are refused);
- finite: no NaN or infinity in floating-point tensors (an encoder does not produce them;
  one forged value would turn every answer that uses it into garbage);
- expectation: a callback, normally the model family's `feature_problem`, that
  knows the tensors' names, dtype, hidden size and token count.

A rejected value is handled like a corrupt one (counted, deleted, a miss).
Values in L1 are not re-checked: only this process put them there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cache_service.features import Features
from cache_service.keys import fingerprint_of, modality_of

FINGERPRINT_META = "fingerprint"

# Returns why the features are unacceptable, or None when they are fine.
Expectation = Callable[[Features], "str | None"]


@dataclass(frozen=True)
class ValueCheck:
    expectation: Expectation | None = None
    require_fingerprint: bool = True

    def problem(self, key: str, features: Features) -> str | None:
        """Why `features` read under `key` must not be used, or None. Never raises: a hostile
        value must never crash the reader."""
        try:
            return self._problem(key, features)
        except Exception as exc:
            return f"check failed: {exc!r}"[:300]

    def _problem(self, key: str, features: Features) -> str | None:
        if not isinstance(features.meta, dict):
            return "metadata is not an object"
        if self.require_fingerprint:
            stamped = features.meta.get(FINGERPRINT_META)
            expected = fingerprint_of(key)
            if expected is None:
                return "key has no model fingerprint"
            if stamped != expected:
                return f"value was written for model {str(stamped)[:80]!r}, key is for {expected!r}"
        wanted = modality_of(key)
        if wanted is not None and features.modality != wanted:
            return f"a value of modality {str(features.modality)[:40]!r} under a key for {wanted!r}"
        for name, tensor in features.tensors.items():
            if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
                return f"tensor {name!r} holds NaN or infinity"
        if self.expectation is not None:
            return self.expectation(features)
        return None


def stamp_fingerprint(features: Features, fingerprint: str) -> Features:
    """The same tensors with the writer's model fingerprint in their meta."""
    return Features(features.tensors, {**features.meta, FINGERPRINT_META: fingerprint})
