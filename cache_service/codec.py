"""Features and their byte form in Redis.

A value is a 16-byte header followed by the tensors in the safetensors format:

    offset 0   4 bytes  magic b"IRF2"
    offset 4   uint32   checksum algorithm, little-endian (1 = xxh3_64)
    offset 8   uint64   checksum of everything after the header, little-endian
    offset 16  safetensors: uint64 header length, JSON header (per tensor its dtype,
               shape and byte range; "__metadata__": {"iris.meta": meta as JSON}),
               then the tensors' bytes.

Why this shape:
- safetensors is the checkpoints' own format: any tool reads a value
  (`safetensors.torch.load(value[16:])`), bf16 included, and its data starts
  8-byte aligned, so `torch.frombuffer` points into the received value (no copy).
- The 16-byte header keeps that alignment relative to the start of the value.
- xxh3_64, several times faster than blake3: the checksum guards against
  truncated or garbled values, not against an attacker who can write to Redis.

Decoded tensors share memory with the buffer they were decoded from (no copy):
they keep that buffer alive, and are writable only when it is (a bytearray is,
`bytes` is not). Treat cached features as read-only either way: an L1 hit
hands every caller the same tensors. `decode(..., copy=True)` clones instead.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
import xxhash

MAGIC = b"IRF2"  # IRF1: the Arrow IPC layout before it (read as corrupt: deleted, recomputed)
CHECKSUM_XXH3_64 = 1
HEADER = struct.Struct("<4sIQ")
_META_KEY = "iris.meta"

# The dtypes a value may hold, by their name in the safetensors header.
DTYPES: dict[str, torch.dtype] = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                                  "F64": torch.float64, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
                                  "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}
_ALLOWED_DTYPES = frozenset(DTYPES.values())


class CorruptValue(ValueError):
    """The bytes are not a value this codec wrote (truncated, garbled, other format)."""


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
            if tensor.dtype not in _ALLOWED_DTYPES:
                raise TypeError(f"tensor {name!r}: unsupported dtype {tensor.dtype}")

    @property
    def num_tokens(self) -> int | None:
        """How many placeholder tokens these features fill in the prompt (the encoder records it)."""
        n = self.meta.get("num_tokens")
        return n if isinstance(n, int) else None  # (a value read from Redis may carry anything)

    @property
    def modality(self) -> str:
        """"image" or "video"; values written before videos existed are images."""
        return self.meta.get("modality", "image")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def cpu(self) -> "Features":
        """These features with every tensor in host memory (self when already there)."""
        if all(t.device.type == "cpu" for t in self.tensors.values()):
            return self
        return Features({n: t.detach().cpu() for n, t in self.tensors.items()}, self.meta)


def encode(features: Features) -> bytearray:
    """Serialise to header + safetensors."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in features.tensors.items()}
    meta = json.dumps(features.meta, separators=(",", ":"), allow_nan=False)
    payload = safetensors.torch.save(tensors, metadata={_META_KEY: meta})
    out = bytearray(HEADER.size + len(payload))
    out[HEADER.size:] = payload
    HEADER.pack_into(out, 0, MAGIC, CHECKSUM_XXH3_64, xxhash.xxh3_64_intdigest(payload))
    return out


def decode(data: bytes | bytearray | memoryview, *, copy: bool = False) -> Features:
    """Parse a value written by `encode`; raises CorruptValue for anything else.

    Tensors point into `data` unless copy=True (see the module docstring).
    """
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise CorruptValue(f"value of {len(view)} bytes is shorter than the header")
    magic, algorithm, checksum = HEADER.unpack_from(view)
    if magic != MAGIC or algorithm != CHECKSUM_XXH3_64:
        raise CorruptValue("unknown value format")
    if xxhash.xxh3_64_intdigest(view[HEADER.size:]) != checksum:
        raise CorruptValue("checksum mismatch (truncated or garbled value)")
    try:
        return _decode_payload(view, copy)
    except CorruptValue:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, struct.error) as exc:
        # The checksum matched, so this is a value of another writer or a bug;
        # either way it must not reach a model.
        raise CorruptValue(f"undecodable value: {exc}") from exc


def _decode_payload(view: memoryview, copy: bool) -> Features:
    (header_len,) = struct.unpack_from("<Q", view, HEADER.size)
    data_start = HEADER.size + 8 + header_len
    if data_start > len(view):
        raise CorruptValue("safetensors header longer than the value")
    header = json.loads(bytes(view[HEADER.size + 8:data_start]))
    meta_json = (header.pop("__metadata__", None) or {}).get(_META_KEY)
    if meta_json is None:
        raise CorruptValue("missing metadata")
    tensors = {}
    for name, info in header.items():
        dtype = DTYPES[info["dtype"]]
        shape = info["shape"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CorruptValue(f"bad shape {shape!r}")
        numel = math.prod(shape)
        start, end = info["data_offsets"]
        if end - start != numel * dtype.itemsize or start < 0 or data_start + end > len(view):
            raise CorruptValue(f"tensor {name!r}: bytes {start}..{end} for shape {shape}")
        if numel == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            with warnings.catch_warnings():
                # A `bytes` value gives a read-only buffer; torch warns once per
                # call. Read-only use is the documented contract.
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(view, dtype=dtype, count=numel, offset=data_start + start).view(shape)
            if copy:
                tensor = tensor.clone()
        tensors[name] = tensor
    return Features(tensors, json.loads(meta_json))
