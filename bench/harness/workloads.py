"""Benchmark workloads: deterministic for a seed, the same for every system.

A workload is a list of conversations; a conversation is one or more turns sent
one after another (each turn is one chat-completions request carrying the whole
history, as OpenAI clients do). Images are described by `ImageSpec` and made on
demand, so a spec is cheap to hold and its bytes are identical on every run.

    unique       every request brings a new image
    zipf         images drawn Zipf-style from a hot pool (repeat share configurable),
                 the rest new
    multiturn    conversations of several turns about one image
    upload_free  images sent by uuid only; on a cache miss (any 4xx) the client
                 resends the same uuid with the bytes
    repeat       the same image every request, a new question each time
    large        new ~12 MP JPEG photos (4000x3000)
    large_image_workload  new bytes every request from a pool of 12 MP photos (same pixels,
                 relabelled): new to Iris's byte-hash keys at the decoding cost of a photo
    text         no image, a prompt of about the same length as the others' text
    text_as_image  no image, a prompt as long as an image prompt in tokens (the
                 baseline a cached image's TTFT is held against)
    video_unique     a new clip every request
    video_repeat     the same clip every request, a new question each time
    video_multiturn  conversations of several turns about one clip
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import random
import struct
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

WORDS = (
    "picture scene colour light shape object corner detail texture pattern shadow edge centre "
    "background foreground left right top bottom bright dark small large"
).split()
QUESTIONS = (
    "What is in this picture?",
    "Describe the colours you see.",
    "Is there any text in it?",
    "What stands out the most?",
    "Describe the left half.",
    "And the right half?",
)


@dataclass(frozen=True)
class ImageSpec:
    seed: int
    width: int
    height: int
    fmt: str = "JPEG"  # JPEG or PNG
    uuid: str | None = None  # sent as the part's `uuid` (vLLM's multi_modal_uuids)

    @property
    def data_url(self) -> str:
        return _data_url(self.seed, self.width, self.height, self.fmt)


@dataclass(frozen=True)
class VideoSpec:
    """An MPEG-4 clip of moving smooth pictures (OpenCV's mp4v, as vLLM's loader reads it)."""

    seed: int
    width: int = 640
    height: int = 360
    frames: int = 288  # 12 s at 24 frames per second
    fps: float = 24.0

    @property
    def data_url(self) -> str:
        return _video_data_url(self.seed, self.width, self.height, self.frames, self.fps)


@dataclass(frozen=True)
class Turn:
    text: str
    image: ImageSpec | None = None
    video: VideoSpec | None = None


@dataclass
class Conversation:
    turns: list[Turn]
    upload_free: bool = False  # first send images by uuid alone


@dataclass
class Workload:
    name: str
    conversations: list[Conversation]
    max_tokens: int = 16
    description: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def distinct_images(self) -> int:
        """Distinct images and clips."""
        return len(
            {
                (t.image.seed, t.image.width, t.image.height, t.image.fmt)
                for c in self.conversations
                for t in c.turns
                if t.image is not None
            }
            | {t.video for c in self.conversations for t in c.turns if t.video is not None}
        )


def _photo(seed: int, width: int, height: int) -> np.ndarray:
    """A smooth random picture (gradients plus mild noise): compresses like a photo,
    so a 12 MP JPEG is a few MB rather than the 15 MB of pure noise."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, height // 64), max(2, width // 64), 3), dtype=np.uint8)
    image = np.asarray(Image.fromarray(small).resize((width, height), Image.BILINEAR), dtype=np.int16)
    noise = rng.integers(-12, 13, (height, width, 1), dtype=np.int16)
    return np.clip(image + noise, 0, 255).astype(np.uint8)


@functools.lru_cache(maxsize=512)
def _data_url(seed: int, width: int, height: int, fmt: str) -> str:
    buf = io.BytesIO()
    image = Image.fromarray(_photo(seed, width, height))
    if fmt == "JPEG":
        image.save(buf, format="JPEG", quality=90)
    else:
        image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@functools.lru_cache(maxsize=64)
def _video_data_url(seed: int, width: int, height: int, frames: int, fps: float) -> str:
    import tempfile
    from pathlib import Path

    import cv2

    base = _photo(seed, width, height)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clip.mp4"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        for i in range(frames):  # a slow pan, so that frames differ
            writer.write(np.roll(base, 3 * i, axis=1))
        writer.release()
        return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


def _text(rng: random.Random, words: int, min_chars: int = 0) -> str:
    chosen = [rng.choice(WORDS) for _ in range(words)]
    while len(" ".join(chosen)) < min_chars:
        chosen.append(rng.choice(WORDS))
    return " ".join(chosen).capitalize() + ". " + rng.choice(QUESTIONS)


def hash_str(text: str) -> int:
    """A stable hash (Python's hash() of str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1 / (rank**s) for rank in range(1, n + 1)]


class WorkloadFactory:
    """Builds every workload from one seed; a different seed gives different images and text.

    Image seeds are drawn per workload from disjoint ranges, so "new" images of one
    workload are never another workload's (nor another run's with another seed).
    """

    def __init__(self, seed: int = 0, small_px: int = 256, prompt_words: int = 24, max_tokens: int = 16):
        self.seed = seed
        self.small_px = small_px
        self.prompt_words = prompt_words
        self.max_tokens = max_tokens

    def _rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}:{name}")

    def _image_seed(self, name: str, i: int) -> int:
        return (hash_str(f"{self.seed}:{name}") + i) % (2**63)

    def _small(self, name: str, i: int, uid: str | None = None) -> ImageSpec:
        return ImageSpec(self._image_seed(name, i), self.small_px, self.small_px, "JPEG", uid)

    def _single(self, name: str, rng: random.Random, image: ImageSpec | None) -> Conversation:
        return Conversation([Turn(_text(rng, self.prompt_words), image)])

    def build(self, name: str, n: int, **options) -> Workload:
        return getattr(self, name)(n, **options)

    def unique(self, n: int) -> Workload:
        rng = self._rng("unique")
        convs = [self._single("unique", rng, self._small("unique", i)) for i in range(n)]
        return Workload("unique", convs, self.max_tokens, "a new image every request")

    def zipf(self, n: int, repeat_share: float = 0.8, pool: int = 8, s: float = 1.1) -> Workload:
        rng = self._rng("zipf")
        weights = _zipf_weights(pool, s)
        convs = []
        for i in range(n):
            if rng.random() < repeat_share:
                image = self._small("zipf-pool", rng.choices(range(pool), weights)[0])
            else:
                image = self._small("zipf-new", i)
            convs.append(self._single("zipf", rng, image))
        return Workload(
            "zipf",
            convs,
            self.max_tokens,
            f"{repeat_share:.0%} of requests reuse a pool of {pool} images (Zipf s={s}), the rest new",
            {"repeat_share": repeat_share, "pool": pool, "s": s},
        )

    def multiturn(self, n: int, turns: int = 3) -> Workload:
        """n requests in conversations of `turns` turns; each conversation has its own image."""
        rng = self._rng("multiturn")
        convs = []
        for c in range((n + turns - 1) // turns):
            image = self._small("multiturn", c)
            convs.append(
                Conversation(
                    [Turn(_text(rng, self.prompt_words // 2), image if t == 0 else None) for t in range(turns)]
                )
            )
        return Workload(
            "multiturn", convs, self.max_tokens, f"conversations of {turns} turns on one image", {"turns": turns}
        )

    def upload_free(self, n: int, pool: int = 8, s: float = 1.1) -> Workload:
        rng = self._rng("upload_free")
        weights = _zipf_weights(pool, s)
        run = hash_str(f"{self.seed}:uuids") % 10**8  # uuids of one seed; another seed never hits them
        convs = []
        for _ in range(n):
            i = rng.choices(range(pool), weights)[0]
            convs.append(
                Conversation(
                    [Turn(_text(rng, self.prompt_words), self._small("upload_free", i, f"bench-{run}-{i}"))],
                    upload_free=True,
                )
            )
        return Workload(
            "upload_free",
            convs,
            self.max_tokens,
            f"uuid first, bytes resent on a miss; {pool} images drawn Zipf-style",
            {"pool": pool},
        )

    def repeat(self, n: int) -> Workload:
        rng = self._rng("repeat")
        convs = [self._single("repeat", rng, self._small("repeat", 0)) for _ in range(n)]
        return Workload("repeat", convs, self.max_tokens, "the same image every request, a new question each time")

    def large(self, n: int, width: int = 4000, height: int = 3000) -> Workload:
        rng = self._rng("large")
        convs = [
            self._single("large", rng, ImageSpec(self._image_seed("large", i), width, height, "JPEG")) for i in range(n)
        ]
        return Workload("large", convs, self.max_tokens, f"a new {width}x{height} JPEG every request")

    def text(self, n: int) -> Workload:
        rng = self._rng("text")
        convs = [self._single("text", rng, None) for _ in range(n)]
        return Workload("text", convs, self.max_tokens, "text only")

    def text_as_image(self, n: int, image_chars: int) -> Workload:
        """Text only, `image_chars` characters longer than the image workloads' text: with a
        byte-level tokenizer (the built-in checkpoints') as many tokens as an image prompt."""
        rng = self._rng("text_as_image")
        base = len(" ".join(["x" * 6] * self.prompt_words))
        convs = [Conversation([Turn(_text(rng, self.prompt_words, base + image_chars))]) for _ in range(n)]
        return Workload(
            "text_as_image",
            convs,
            self.max_tokens,
            f"text only, {image_chars} characters more (an image's tokens)",
            {"image_chars": image_chars},
        )

    # --- video --------------------------------------------------------------------
    def _clip(self, name: str, i: int) -> VideoSpec:
        return VideoSpec(self._image_seed(name, i))

    def video_unique(self, n: int) -> Workload:
        rng = self._rng("video_unique")
        convs = [
            Conversation([Turn(_text(rng, self.prompt_words), video=self._clip("video_unique", i))]) for i in range(n)
        ]
        return Workload("video_unique", convs, self.max_tokens, "a new clip every request")

    def video_repeat(self, n: int) -> Workload:
        rng = self._rng("video_repeat")
        convs = [
            Conversation([Turn(_text(rng, self.prompt_words), video=self._clip("video_repeat", 0))]) for _ in range(n)
        ]
        return Workload("video_repeat", convs, self.max_tokens, "the same clip every request, a new question each time")

    def video_multiturn(self, n: int, turns: int = 3) -> Workload:
        rng = self._rng("video_multiturn")
        convs = [
            Conversation(
                [
                    Turn(_text(rng, self.prompt_words // 2), video=self._clip("video_multiturn", c) if t == 0 else None)
                    for t in range(turns)
                ]
            )
            for c in range((n + turns - 1) // turns)
        ]
        return Workload(
            "video_multiturn", convs, self.max_tokens, f"conversations of {turns} turns on one clip", {"turns": turns}
        )


@dataclass(frozen=True)
class RelabelledJpeg:
    """A pool photo's JPEG with a comment segment (COM) naming `label` right after the SOI marker.

    The same pixels under new bytes: a new image to Iris, whose keys hash the bytes, at the same
    decoding cost, without drawing and encoding a new 12 MP photo per request on the cores the
    server needs. (A system that hashes pixels, as vLLM does, would see a repeat: this is for
    Iris's own runs.)"""

    base: ImageSpec
    label: int
    uuid = None  # read by workloads.chat_messages

    @property
    def data_url(self) -> str:
        # base64(a + b) == base64(a) + base64(b) when len(a) is a multiple of 3: the segment is sized so.
        payload = f"iris-autoscale {self.label}".encode()
        payload += b" " * (-(len(payload) + 6) % 3)
        head = b"\xff\xd8\xff\xfe" + struct.pack(">H", len(payload) + 2) + payload
        return "data:image/jpeg;base64," + base64.b64encode(head).decode() + jpeg_body_b64(self.base)


@functools.lru_cache(maxsize=64)
def jpeg_body_b64(base: ImageSpec) -> str:
    """base64 of the photo's JPEG after its 2-byte SOI marker."""
    data = base64.b64decode(base.data_url.split(",", 1)[1])
    assert data[:2] == b"\xff\xd8", "not a JPEG"
    return base64.b64encode(data[2:]).decode()


def large_image_workload(factory: WorkloadFactory, n: int, first_label: int, pool: int = 8) -> Workload:
    """n one-turn requests, each with a new 4000x3000 JPEG (the `large` workload's photos, relabelled)."""
    photos = factory.large(pool)
    convs = []
    for i in range(n):
        turn = photos.conversations[i % pool].turns[0]
        convs.append(Conversation([Turn(turn.text, RelabelledJpeg(turn.image, first_label + i))]))
    return Workload(
        "large_relabelled",
        convs,
        factory.max_tokens,
        f"a new 4000x3000 JPEG every request ({pool} photos, each request's bytes unique)",
    )


def image_prompt_chars(checkpoint: str, small_px: int) -> int:
    """How many tokens one small workload image becomes in the checkpoint's prompt: the characters
    text_as_image adds (a byte-level tokenizer, the built-in checkpoints')."""
    from pipeline.model.vision_model import VisionModel

    data = base64.b64decode(ImageSpec(0, small_px, small_px).data_url.split(",", 1)[1])
    return VisionModel(checkpoint).preprocess(Image.open(io.BytesIO(data)).convert("RGB")).num_tokens


def chat_messages(history: list[dict], turn: Turn, with_bytes: bool) -> list[dict]:
    """The messages of one request: the conversation so far plus this turn's user message."""
    content: list[dict] = []
    if turn.video is not None:
        content.append({"type": "video_url", "video_url": {"url": turn.video.data_url}})
    if turn.image is not None:
        part: dict = {"type": "image_url", "image_url": {"url": turn.image.data_url} if with_bytes else None}
        if turn.image.uuid is not None:
            part["uuid"] = turn.image.uuid
        content.append(part)
    content.append({"type": "text", "text": turn.text})
    return history + [{"role": "user", "content": content}]
