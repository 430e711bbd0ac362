"""What media Iris accepts: sizes, pixel counts, formats, video length, and where it may fetch from.
Every refusal is a 400 naming the knob (codes in pipeline/media/fetch.py)."""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.errors import IrisError, bad_request
from pipeline.media.address_policy import FetchPolicy, normalize_host

MiB = 1024 * 1024


class MediaLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_image_bytes: int = Field(
        20 * MiB,
        gt=0,
        description="Largest image accepted, in bytes (decoded "
        "from base64 or fetched); larger ones are a 400 image_too_large.",
    )
    max_image_pixels: int = Field(
        40_000_000,
        gt=0,
        description="Decompression-bomb guard: largest width × height, "
        "checked from the header before pixels are allocated.",
    )
    fetch_timeout_s: float = Field(10.0, gt=0, description="Time limit of one http(s) fetch, redirects included.")
    allowed_formats: frozenset[str] = Field(
        frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP"}),
        description="Image formats accepted (Pillow's names); others are a 400 unsupported_image_format.",
    )
    allow_http: bool = Field(
        True, description="Whether http(s) image and video URLs are fetched at all; false: data: URLs and uuids only."
    )
    max_redirects: int = Field(
        3, ge=0, le=20, description="Redirects one fetch follows; each target is checked by the SSRF guard again."
    )
    allowed_fetch_hosts: frozenset[str] = Field(
        frozenset(),
        description="SSRF guard exceptions by exact host name "
        "(e.g. images.internal), which may then resolve to any address; "
        "empty: public addresses only.",
    )
    allowed_fetch_cidrs: frozenset[str] = Field(
        frozenset(), description="SSRF guard exceptions by address range (e.g. 10.1.2.0/24, 127.0.0.1/32 for tests)."
    )
    # Videos: checked from the container's header before any frame is decoded.
    max_video_bytes: int = Field(64 * MiB, gt=0, description="Largest video accepted, in bytes.")
    max_video_frames: int = Field(
        36_000,
        gt=0,
        description="Most frames in a clip (the model's sampling picks fewer), from the container's header.",
    )
    max_video_duration_s: float = Field(
        1200.0, gt=0, description="Longest clip, in seconds, from the container's header."
    )
    max_video_frame_pixels: int = Field(3840 * 2160, gt=0, description="Largest frame width × height of a video.")

    def max_bytes(self, modality: str) -> int:
        return self.max_video_bytes if modality == "video" else self.max_image_bytes

    @field_validator("allowed_formats", mode="after")
    @classmethod
    def _upper(cls, v: frozenset[str]) -> frozenset[str]:
        return frozenset(f.upper() for f in v)

    @field_validator("allowed_fetch_hosts", mode="after")
    @classmethod
    def _hosts(cls, v: frozenset[str]) -> frozenset[str]:
        hosts = frozenset(normalize_host(h) for h in v)
        if "" in hosts:
            raise ValueError("host names must not be empty")
        return hosts

    @field_validator("allowed_fetch_cidrs", mode="after")
    @classmethod
    def _cidrs(cls, v: frozenset[str]) -> frozenset[str]:
        # Normalized ("10.1.2.3/8" -> "10.0.0.0/8"); a typo fails at start-up.
        return frozenset(str(ipaddress.ip_network(c.strip(), strict=False)) for c in v)

    def fetch_policy(self) -> FetchPolicy:
        return FetchPolicy.build(self.allowed_fetch_hosts, self.allowed_fetch_cidrs)


def too_large_bytes(size: str, limits: MediaLimits, param: str | None, m: str = "image") -> IrisError:
    return bad_request(
        f"{m} is {size} bytes; the limit is {limits.max_bytes(m)} bytes (max_{m}_bytes)",
        param,
        f"{m}_too_large",
    )
