"""Check image bytes against MediaLimits and decode them with vLLM's own image loader,
and check a video's header; every failure is an IrisError 400 (codes in pipeline/media/fetch.py).

The format and the pixel count come from the header, and are checked before any
pixel memory is allocated; a video's size, frames and duration likewise before any
frame is decoded. The pixels are vLLM's: `ImageMediaIO` (with `media_io_kwargs["image"]`)
decodes, orients (EXIF) and converts to RGB exactly as `vllm serve` does.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from PIL import Image

from pipeline.errors import bad_request
from pipeline.media.limits import MediaLimits, too_large_bytes

if TYPE_CHECKING:
    from vllm.multimodal.media import ImageMediaIO


def decode_image(data: bytes, limits: MediaLimits, image_io: ImageMediaIO, *, param: str | None = None) -> Image.Image:
    """Check image bytes against the limits, then decode them with `image_io` (vLLM's
    ImageMediaIO, e.g. VisionModel.image_io): the image `vllm serve` would see.

    Order matters: the format and the pixel count come from the header, and are
    checked before any pixel memory is allocated.
    """
    import vllm.envs as envs

    if not data:
        raise bad_request("image data is empty", param, "invalid_image")
    if len(data) > limits.max_image_bytes:
        raise too_large_bytes(str(len(data)), limits, param)
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        # Pillow's own guard (MAX_IMAGE_PIXELS) fires inside open() for huge headers.
        raise bad_request(f"image is too large: {e}", param, "image_too_large") from None
    except Image.UnidentifiedImageError:
        raise bad_request("data is not a recognised image", param, "invalid_image") from None
    except Exception as e:  # any parser failure on untrusted bytes is the client's problem
        raise bad_request(f"could not read image: {e}", param, "invalid_image") from None

    fmt = img.format or "unknown"
    # Pillow names a JPEG that carries extra pictures (phone cameras) "MPO"; it
    # is a JPEG to clients and to vLLM, and its first picture is the image.
    if fmt.upper() not in limits.allowed_formats and not (fmt == "MPO" and "JPEG" in limits.allowed_formats):
        raise bad_request(
            f"image format {fmt} is not supported; allowed formats: {', '.join(sorted(limits.allowed_formats))}",
            param,
            "unsupported_image_format",
        )
    w, h = img.size
    if w <= 0 or h <= 0:
        raise bad_request(f"image has invalid size {w}x{h}", param, "invalid_image")
    # vLLM's own limit (VLLM_MAX_IMAGE_PIXELS) too, so that either is a clear image_too_large.
    vllm_max = envs.VLLM_MAX_IMAGE_PIXELS
    max_pixels = min(limits.max_image_pixels, vllm_max) if vllm_max > 0 else limits.max_image_pixels
    if w * h > max_pixels:
        raise bad_request(
            f"image is {w}x{h} = {w * h} pixels; the limit is {max_pixels} pixels",
            param,
            "image_too_large",
        )
    try:
        return image_io.load_bytes(data).media  # first frame only for animated images
    except Image.DecompressionBombError as e:
        raise bad_request(f"image is too large: {e}", param, "image_too_large") from None
    except Exception as e:  # truncated files, corrupt streams, decoder errors (vLLM: ValueError)
        raise bad_request(f"could not decode {fmt} image: {e}", param, "invalid_image") from None


def check_video(data: bytes, limits: MediaLimits, *, param: str | None = None) -> None:
    """Refuse a video over the limits from its container's header, before any frame is
    decoded: bytes, frame size, frame count, duration. Bytes OpenCV cannot open are invalid."""
    import cv2
    from vllm.multimodal.video_decoders.opencv import OpenCVVideoBackendMixin

    if not data:
        raise bad_request("video data is empty", param, "invalid_video")
    if len(data) > limits.max_video_bytes:
        raise too_large_bytes(str(len(data)), limits, param, "video")
    try:
        cap = OpenCVVideoBackendMixin.open_video_capture(data)
    except Exception:  # any parser failure on untrusted bytes is the client's problem
        raise bad_request("data is not a video this server can read", param, "invalid_video") from None
    # No cap.release(): with a Python stream source it crashes the process off the main thread
    # (OpenCV 4.x calls back into Python without the GIL); dropping the reference closes it.
    width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
    frames, fps = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), cap.get(cv2.CAP_PROP_FPS)
    del cap
    if width <= 0 or height <= 0 or frames <= 0:
        raise bad_request(f"video has no readable frames ({width}x{height}, {frames} frames)", param, "invalid_video")
    for value, limit, what, knob in (
        (
            width * height,
            limits.max_video_frame_pixels,
            f"has frames of {width}x{height} = {width * height} pixels",
            "max_video_frame_pixels",
        ),
        (frames, limits.max_video_frames, f"has {frames} frames", "max_video_frames"),
        (
            frames / fps if fps > 0 else 0.0,
            limits.max_video_duration_s,
            f"is {frames / fps if fps > 0 else 0.0:.1f} s long",
            "max_video_duration_s",
        ),
    ):
        if value > limit:
            raise bad_request(f"video {what}; the limit is {limit:g} ({knob})", param, "video_too_large")
