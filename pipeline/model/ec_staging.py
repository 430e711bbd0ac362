"""LLMDecode's side of Iris's EC connector (pipeline/model/ec_connector.py): the staging folder.

Before LLMDecode calls its engine with an item's key as the item's uuid, it writes the item's
features to a file named by `staged_name(key)` in a folder of its own (Iris's value codec;
/dev/shm where it can: the engine runs in processes of its own, and a file in tmpfs is the
cheapest way in, one copy). The connector's scheduler side reads them from there
(`ec_transfer_config(staging_dir, ...)`); LLMDecode removes them when the request ends.

No Ray, no vLLM here.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from cache_service import codec
from cache_service.keys import content_hash

SHM = Path("/dev/shm")


def staged_name(key: str) -> str:
    """The staging file of a key (keys may be long and hold any escaped text)."""
    return content_hash(key.encode())[:40] + ".irf"


def values_of(features: codec.Features) -> torch.Tensor | None:
    """The tensor the engine's encoder cache holds for one item: the features' one 2-D
    floating-point tensor (the others are metadata: grids, the item's own bytes)."""
    values = [t for t in features.tensors.values() if t.is_floating_point() and t.ndim == 2]
    return values[0] if len(values) == 1 else None


class FeatureStaging:
    """LLMDecode's side of the staging folder: an item's features are on disk (tmpfs) while
    at least one request that needs them is in flight."""

    def __init__(self, directory: str | os.PathLike | None = None):
        base = directory or (SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else None)
        self.dir = Path(tempfile.mkdtemp(prefix="iris-ec-", dir=base))
        self._users: dict[str, int] = {}  # key -> requests in flight that staged it

    def stage(self, key: str, features: codec.Features) -> None:
        """Write `features` under `key` (once while any request holds it); `release` undoes."""
        if self._users.get(key):
            self._users[key] += 1
            return
        path = self.dir / staged_name(key)
        partial = path.with_suffix(".partial")
        partial.write_bytes(codec.encode(codec.Features({"values": values_of(features)}, {})))
        partial.replace(path)  # the engine never sees a half-written file
        self._users[key] = 1

    def release(self, keys: list[str]) -> None:
        for key in keys:
            users = self._users.get(key, 0) - 1
            if users > 0:
                self._users[key] = users
                continue
            self._users.pop(key, None)
            (self.dir / staged_name(key)).unlink(missing_ok=True)

    @property
    def staged(self) -> int:
        return len(self._users)

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
        self._users.clear()
