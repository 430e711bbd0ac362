"""Features: the vision features of one image or clip, as every stage and the cache hold them.

Named tensors plus JSON-able metadata. Their byte form in Redis is cache_service/codec.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# The dtypes a Features may hold: what the codec can write (cache_service/codec.py's DTYPES).
ALLOWED_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)


@dataclass
class Features:
    """Vision features of one image: named tensors plus JSON-able metadata.

    E.g. LLaVA: {"image_embeds": bf16[576, 4096]}; Qwen2-VL:
    {"image_embeds": bf16[tokens, hidden], "image_grid_thw": int64[1, 3]},
    with meta such as {"num_tokens": 576}.
    """

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, tensor in self.tensors.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise TypeError("tensors must map str to torch.Tensor")
            if tensor.dtype not in ALLOWED_DTYPES:
                raise TypeError(f"tensor {name!r}: unsupported dtype {tensor.dtype}")

    @property
    def num_tokens(self) -> int | None:
        """How many placeholder tokens these features fill in the prompt (the encoder records it)."""
        n = self.meta.get("num_tokens")
        # (a value read from Redis may carry anything; bool is an int to Python)
        return n if isinstance(n, int) and not isinstance(n, bool) else None

    @property
    def modality(self) -> str:
        """ "image" or "video"; values written before videos existed are images."""
        return self.meta.get("modality", "image")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def cpu(self) -> Features:
        """These features with every tensor in host memory (self when already there)."""
        if all(t.device.type == "cpu" for t in self.tensors.values()):
            return self
        return Features({n: t.detach().cpu() for n, t in self.tensors.items()}, self.meta)
