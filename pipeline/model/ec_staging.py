"""LLMDecode's side of Iris's EC connector (pipeline/model/ec_connector.py): the staging folder.

Before LLMDecode calls its engine with an item's key as the item's uuid, it writes the item's
features to a file named by `staged_name(key)` in a folder of its own (Iris's value codec;
/dev/shm where it can, or the folder $IRIS_EC_STAGING_DIR names: the engine runs in processes
of its own, and a file in tmpfs is the cheapest way in, one copy). The connector's scheduler side reads them from there
(`ec_transfer_config(staging_dir, ...)`); LLMDecode removes them when the request ends.

Staging is an optimisation too: a write that fails (/dev/shm full, a read-only folder) leaves
no file, partial or whole, and the item is simply not staged; the engine's connector finds
nothing and the engine runs its own tower on the item (counted in `failed`). A replica's
folder is `iris-ec-<pid>-<random>`; one whose process is gone (a replica that was killed) is
removed when the next FeatureStaging is created in the same place.

No Ray, no vLLM here.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from cache_service import codec
from cache_service.features import Features
from cache_service.keys import content_hash

logger = logging.getLogger(__name__)

SHM = Path("/dev/shm")
# Where staging folders go instead of /dev/shm (a memory-backed volume of its own, say).
STAGING_DIR_ENV = "IRIS_EC_STAGING_DIR"
PREFIX = "iris-ec-"
_FOLDER = re.compile(re.escape(PREFIX) + r"(\d+)-")


def staged_name(key: str) -> str:
    """The staging file of a key (keys may be long and hold any escaped text)."""
    return content_hash(key.encode())[:40] + ".irf"


def values_of(features: Features) -> torch.Tensor | None:
    """The tensor the engine's encoder cache holds for one item: the features' one 2-D
    floating-point tensor (the others are metadata: grids, the item's own bytes)."""
    values = [t for t in features.tensors.values() if t.is_floating_point() and t.ndim == 2]
    return values[0] if len(values) == 1 else None


class FeatureStaging:
    """LLMDecode's side of the staging folder: an item's features are on disk (tmpfs) while
    at least one request that needs them is in flight."""

    def __init__(self, directory: str | os.PathLike | None = None):
        shm = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else None
        base = directory or os.environ.get(STAGING_DIR_ENV) or shm
        self.swept = sweep_dead(Path(base or tempfile.gettempdir()))
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
        self._users: dict[str, int] = {}  # key -> requests in flight that staged it
        self.failed = 0  # items not staged because the write failed (the engine's tower ran)

    def stage(self, key: str, features: Features) -> bool:
        """Write `features` under `key` (once while any request holds it); `release` undoes.
        False when the write failed: nothing is left on disk and the engine encodes the item."""
        if self._users.get(key):
            self._users[key] += 1
            return True
        path = self.dir / staged_name(key)
        partial = path.with_suffix(".partial")
        try:
            partial.write_bytes(codec.encode(Features({"values": values_of(features)}, {})))
            partial.replace(path)  # the engine never sees a half-written file
        except OSError as err:  # ENOSPC in a full /dev/shm, EROFS, EACCES, ...
            partial.unlink(missing_ok=True)
            self.failed += 1
            logger.warning("cannot stage features in %s (%s); the engine encodes the item itself", self.dir, err)
            return False
        self._users[key] = 1
        return True

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
        shutil.rmtree(self.dir, ignore_errors=True)
        self._users.clear()


def sweep_dead(base: Path) -> list[Path]:
    """Remove the staging folders in `base` whose process no longer runs; the removed ones.
    (A folder of an older layout without a pid is left alone: its owner cannot be told.)"""
    swept = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return swept
    for entry in entries:
        match = _FOLDER.match(entry.name)
        if match is None or not entry.is_dir() or _alive(int(match.group(1))):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        swept.append(entry)
    if swept:
        logger.warning(
            "removed %d staging folder(s) of processes that are gone: %s",
            len(swept),
            ", ".join(p.name for p in swept[:5]),
        )
    return swept


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
