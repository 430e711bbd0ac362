"""Decode image bytes into an RGB image, and check a video's header, with the limits of
MediaLimits; every failure is an IrisError 400 (codes in pipeline/media/fetch.py).

The format and the pixel count come from the header, and are checked before any
pixel memory is allocated; a video's size, frames and duration likewise before any
frame is decoded.
"""

from __future__ import annotations

import io

from PIL import Image, ImageOps

from pipeline.api.errors import bad_request
from pipeline.media.fetch import MediaLimits, too_large_bytes


def decode_image(data: bytes, limits: MediaLimits, *, param: str | None = None) -> Image.Image:
    """Decode image bytes into a loaded RGB PIL image, enforcing the limits.

    Order matters: the format and the pixel count come from the header, and are
    checked before any pixel memory is allocated.
    """
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
    if w * h > limits.max_image_pixels:
        raise bad_request(
            f"image is {w}x{h} = {w * h} pixels; the limit is {limits.max_image_pixels} pixels",
            param,
            "image_too_large",
        )
    try:
        img.load()  # first frame only for animated images
        img = _exif_transpose(img)
        return to_rgb(img)
    except Image.DecompressionBombError as e:
        raise bad_request(f"image is too large: {e}", param, "image_too_large") from None
    except Exception as e:  # truncated files (OSError), corrupt streams, decoder errors
        raise bad_request(f"could not decode {fmt} image: {e}", param, "invalid_image") from None


def _exif_transpose(img: Image.Image) -> Image.Image:
    # Phone photos store rotation in EXIF; vLLM applies it too (normalize_image),
    # so both pixel paths see the same orientation. A broken EXIF block is ignored.
    try:
        return ImageOps.exif_transpose(img)
    except Exception:
        return img


def to_rgb(img: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """Any Pillow mode -> RGB. Transparency is composited onto `background`
    (white, as vLLM's default), not dropped, so transparent pixels do not turn
    into whatever colour happens to sit under the alpha."""
    mode = img.mode
    # "transparency" in info: a tRNS colour key in P, L or even RGB PNGs.
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, background)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    if mode.startswith("I;16") or mode == "I":
        # Pillow clips 16/32-bit samples to 255 (a white image); scale instead.
        i32 = img if mode == "I" else img.convert("I")
        _, hi = i32.getextrema()
        if mode != "I" or hi > 255:
            scale = 255.0 / (65535 if hi <= 65535 else hi)
            i32 = i32.point(lambda v: v * scale)
        return i32.convert("L").convert("RGB")
    if mode == "RGB":
        return img
    if mode == "F":
        lo, hi = img.getextrema()
        if hi > lo:
            img = img.point(lambda v: (v - lo) * (255.0 / (hi - lo)))
        return img.convert("L").convert("RGB")
    return img.convert("RGB")  # L, 1, P, CMYK, YCbCr, ...


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
        (width * height, limits.max_video_frame_pixels, f"has frames of {width}x{height} = {width * height} pixels",
         "max_video_frame_pixels"),
        (frames, limits.max_video_frames, f"has {frames} frames", "max_video_frames"),
        (frames / fps if fps > 0 else 0.0, limits.max_video_duration_s,
         f"is {frames / fps if fps > 0 else 0.0:.1f} s long", "max_video_duration_s"),
    ):
        if value > limit:
            raise bad_request(f"video {what}; the limit is {limit:g} ({knob})", param, "video_too_large")
