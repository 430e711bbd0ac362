"""The one interface behind which model families differ.

The generic flow (preprocess -> encode -> cache -> vLLM) only talks to a
`FamilyAdapter`; it never asks which model it serves. An adapter knows:
- how its image processor turns a decoded image into pixel tensors,
- how its vision tower + projector turn a batch of those into per-image features,
- how to pack cached features into vLLM's `multi_modal_data["image"]`,
- what its features must look like (`feature_problem`), so that a stale or
  forged cache entry is refused before it reaches vLLM.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from cache_service.codec import Features
from pipeline.models.weights import load_prefixed, local_checkpoint

# One lock for the process: transformers' lazy imports are process-wide, and
# several threads importing AutoImageProcessor at once raced into ImportError.
# Re-entrant because the warm-up preprocess reads image_processor again.
_PREPROCESSING_LOCK = threading.RLock()


@dataclass
class PixelInputs:
    """One preprocessed image: tensors for the vision tower plus what the encoder needs to know."""

    tensors: dict[str, torch.Tensor]
    num_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


class FamilyAdapter(ABC):
    model_types: tuple[str, ...] = ()

    def __init__(self, checkpoint: str):
        self.checkpoint = checkpoint
        self.root = local_checkpoint(checkpoint)
        self.config = json.loads((self.root / "config.json").read_text())
        self._image_processor = None
        self._preprocessing_ready = False  # processor loaded and one image preprocessed
        self._warming_up = False
        self.vision: torch.nn.Module | None = None

    # --- preprocessing (CPU) -------------------------------------------------
    @property
    def image_processor(self):
        if not self._preprocessing_ready:
            self.load_preprocessing()
        return self._image_processor

    def load_preprocessing(self) -> None:
        """Import transformers, load the image processor and preprocess one small
        image, once and under a lock, so the first requests (often a concurrent
        burst) neither race on lazy imports nor pay for them. Replicas call it in
        their constructor; otherwise the first preprocess does."""
        with _PREPROCESSING_LOCK:
            if self._preprocessing_ready or self._warming_up:  # done, or re-entered by the warm-up below
                return
            from transformers import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(str(self.root))
            self._warming_up = True
            try:
                # The processor's own first call imports more (e.g. torchvision transforms).
                self.preprocess(Image.new("RGB", (224, 224), (128, 128, 128)))
            finally:
                self._warming_up = False
            self._preprocessing_ready = True

    @abstractmethod
    def preprocess(self, image: Image.Image) -> PixelInputs:
        """Resize/normalise one RGB image into the vision tower's input."""

    # --- vision encoding (GPU in production) ----------------------------------
    # Checkpoint weight-name prefix -> prefix in the vision module (longest match wins).
    vision_weight_prefixes: dict[str, str] = {}

    @abstractmethod
    def build_vision(self) -> torch.nn.Module:
        """The vision tower + projector module, without weights."""

    def load_vision(self, device: str = "cpu", dtype: torch.dtype | None = None) -> None:
        """Load only the vision tower and projector weights (never the language model)."""
        module = self.build_vision()
        weights = load_prefixed(self.checkpoint, self.vision_weight_prefixes)
        weights = {name: w for name, w in weights.items() if not self.unused_vision_weight(name)}
        module.load_state_dict(weights, strict=True)
        self.vision = module.to(device=device, dtype=dtype or self.vision_dtype).eval()

    def unused_vision_weight(self, name: str) -> bool:
        """Whether a checkpoint weight belongs to a part of the tower that is not built
        because the features never depend on it (e.g. layers past the feature layer)."""
        return False

    @abstractmethod
    def encode(self, batch: list[PixelInputs]) -> list[Features]:
        """Features for each image of the batch, in one forward pass."""

    @property
    def vision_dtype(self) -> torch.dtype:
        name = self.config.get("dtype") or self.config.get("torch_dtype") or "float32"
        return getattr(torch, name)

    def preprocessing_settings(self) -> bytes:
        """The image-processor configuration as saved in the checkpoint."""
        parts = []
        for name in ("preprocessor_config.json", "processor_config.json"):
            path = self.root / name
            if path.is_file():
                parts.append(path.read_bytes())
        return b"\n".join(parts)

    # --- decode (vLLM) --------------------------------------------------------
    @abstractmethod
    def vllm_image_data(self, features: list[Features]) -> Any:
        """`multi_modal_data["image"]` for these features, in prompt order."""

    # --- what features must look like -------------------------------------------
    @abstractmethod
    def feature_problem(self, features: Features, dtype: torch.dtype) -> str | None:
        """Why `features` cannot be this model's encoder output in `dtype` (tensor names,
        dtype, hidden size, token count), or None when they can."""


def tensor_problem(features: Features, name: str, dtype: torch.dtype, shape: list[int]) -> str | None:
    """Why `features.tensors[name]` is not a `dtype` tensor of `shape`, or None."""
    tensor = features.tensors.get(name)
    if tensor is None:
        return f"no {name!r} tensor"
    if tensor.dtype != dtype:
        return f"{name} has dtype {tensor.dtype}, expected {dtype}"
    if list(tensor.shape) != shape:
        return f"{name} has shape {list(tensor.shape)}, expected {shape}"
    return None


def token_count_problem(features: Features, tokens: int) -> str | None:
    """The meta's token count drives the decoder's length check: it must be the real one."""
    stated = features.meta.get("num_tokens")
    if stated != tokens:
        return f"meta num_tokens {stated!r}, expected {tokens}"
    return None
