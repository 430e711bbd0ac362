"""The model fingerprint carried by every cache key.

It changes whenever anything that shapes an image's features changes: the
architecture config, the vision tower and projector weights (hashed byte by
byte, so a fine-tuned tower with the same shapes gets a new fingerprint) and
the preprocessing settings. The language model's weights are not part of it:
features do not depend on them.
"""

from __future__ import annotations

import json

import torch

from cache_service.keys import content_hash
from pipeline.families.base import FamilyAdapter

FINGERPRINT_CHARS = 16


def model_fingerprint(adapter: FamilyAdapter, extra: dict | None = None) -> str:
    """Fingerprint of a loaded adapter (`load_vision()` done); `extra` adds settings
    that change features outside the checkpoint (e.g. encoder dtype)."""
    if adapter.vision is None:
        raise RuntimeError("load_vision() before computing the fingerprint")
    parts = [
        json.dumps(adapter.config, sort_keys=True).encode(),
        adapter.preprocessing_settings(),
        json.dumps(extra or {}, sort_keys=True).encode(),
    ]
    for name, tensor in sorted(adapter.vision.state_dict().items()):
        parts.append(name.encode())
        parts.append(str(tensor.dtype).encode())
        parts.append(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return content_hash(b"\0".join(content_hash(p).encode() for p in parts))[:FINGERPRINT_CHARS]


def expected_fingerprint(adapter: FamilyAdapter, dtype: torch.dtype) -> str:
    """The fingerprint an encoder of this checkpoint in `dtype` computes, for a process that
    does not encode (the decoder): loads the vision weights on the CPU, hashes, drops them."""
    adapter.load_vision(device="cpu", dtype=dtype)
    try:
        return model_fingerprint(adapter, {"dtype": str(dtype)})
    finally:
        adapter.vision = None
