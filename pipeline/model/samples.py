"""Small sample items: what the encoder warms up with and the decoder checks its path with."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def sample_image_bytes(width: int = 64, height: int = 64) -> bytes:
    """A grey PNG: the image the encoder warms up with and the decoder checks its path with."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), (128, 128, 128)).save(out, format="PNG")
    return out.getvalue()


def sample_video(frames: int = 4, side: int = 64) -> tuple[np.ndarray, dict]:
    """A grey clip as vLLM's video loader returns one: frames [T, H, W, 3] uint8 and their metadata."""
    fps = 2.0
    return np.full((frames, side, side, 3), 128, np.uint8), {
        "total_num_frames": frames,
        "fps": fps,
        "duration": frames / fps,
        "video_backend": "opencv",
        "frames_indices": list(range(frames)),
        "do_sample_frames": True,
    }
