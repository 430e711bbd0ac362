"""Deterministic test clips: tiny MPEG-4 videos made with OpenCV (installed with vLLM)."""

from __future__ import annotations

import functools
import tempfile
import uuid
from pathlib import Path

import numpy as np

# (frames, width, height, fps, seed)
CLIPS = {"clip": (8, 96, 80, 4.0, 1), "other": (8, 96, 80, 4.0, 2), "long": (12, 64, 112, 6.0, 3)}


@functools.lru_cache(maxsize=8)  # the named clips, encoded once a session (bytes: nothing can change them)
def clip_bytes(name: str = "clip", smooth: bool = False, **override) -> bytes:
    """`smooth`: a moving gradient instead of noise (few bytes per frame, however large)."""
    import cv2

    frames, width, height, fps, seed = CLIPS[name]
    frames, width, height, fps, seed = (
        override.get(k, v)
        for k, v in zip(("frames", "width", "height", "fps", "seed"), (frames, width, height, fps, seed))
    )
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clip.mp4"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        if smooth:
            ramp = (np.arange(width)[None, :] * 255 // max(width - 1, 1) + rng.integers(0, 256)) % 256
            base = np.broadcast_to(ramp[:, :, None], (height, width, 3)).astype(np.uint8)
        else:
            base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        for i in range(frames):  # a moving picture: the frames differ, so their order matters
            writer.write(np.roll(base, 4 * i, axis=1))
        writer.release()
        return path.read_bytes()


def unique_clip(**override) -> bytes:
    """clip_bytes("clip") with a new seed each call (new bytes), `override` as there."""
    return clip_bytes(seed=uuid.uuid4().int % 2**32, **override)


def video_part(url: str | None, uid: str | None = None) -> dict:
    """A chat message's video part: by URL, by uuid (`url` None: upload-free), or both."""
    part = {"type": "video_url", "video_url": {"url": url} if url else None}
    if uid is not None:
        part["uuid"] = uid
    return part
