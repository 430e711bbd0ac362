"""The byte form of Features (cache_service/features.py) in Redis.

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
from typing import Any

import safetensors.torch
import torch
import xxhash

from cache_service.features import Features

MAGIC = b"IRF2"  # IRF1: the Arrow IPC layout before it (read as corrupt: deleted, recomputed)
CHECKSUM_XXH3_64 = 1
HEADER = struct.Struct("<4sIQ")
_META_KEY = "iris.meta"

# The dtypes a value may hold, by their name in the safetensors header.
DTYPES: dict[str, torch.dtype] = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
# Bounds on what a value read from Redis may declare, checked before anything is parsed or
# allocated: Iris's own headers are a few hundred bytes, its meta a few fields, its tensors 1-4-d.
MAX_HEADER_BYTES = 1 << 20
MAX_META_BYTES = 64 << 10
MAX_NDIM = 8


class CorruptValue(ValueError):
    """The bytes are not a value this codec wrote (truncated, garbled, other format)."""


def encode(features: Features) -> bytearray:
    """Serialise to header + safetensors."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in features.tensors.items()}
    meta = json.dumps(features.meta, separators=(",", ":"), allow_nan=False)
    payload = safetensors.torch.save(tensors, metadata={_META_KEY: meta})
    out = bytearray(HEADER.size + len(payload))
    out[HEADER.size :] = payload
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
    if xxhash.xxh3_64_intdigest(view[HEADER.size :]) != checksum:
        raise CorruptValue("checksum mismatch (truncated or garbled value)")
    try:
        return _decode_payload(view, copy)
    except CorruptValue:
        raise
    except Exception as exc:
        # The checksum matched, so this is a value of another writer or a bug; either way
        # it must not reach a model, and nothing about it may fail the reader: JSON nested
        # past the recursion limit, a shape torch cannot size (RuntimeError), ...
        raise CorruptValue(f"undecodable value: {type(exc).__name__}: {str(exc)[:200]}") from None


def _decode_payload(view: memoryview, copy: bool) -> Features:
    (header_len,) = struct.unpack_from("<Q", view, HEADER.size)
    if header_len > MAX_HEADER_BYTES:
        raise CorruptValue(f"safetensors header of {header_len} bytes")
    data_start = HEADER.size + 8 + header_len
    if data_start > len(view):
        raise CorruptValue("safetensors header longer than the value")
    header = _json(bytes(view[HEADER.size + 8 : data_start]))
    if not isinstance(header, dict):
        raise CorruptValue("safetensors header is not an object")
    metadata = header.pop("__metadata__", None) or {}
    meta_json = metadata.get(_META_KEY) if isinstance(metadata, dict) else None
    if not isinstance(meta_json, str) or len(meta_json) > MAX_META_BYTES:
        raise CorruptValue("missing or oversized metadata")
    meta = _json(meta_json)
    if not isinstance(meta, dict):
        raise CorruptValue(f"metadata is a {type(meta).__name__}, not an object")
    tensors = {}
    for name, info in header.items():
        dtype, shape, (start, end) = _tensor_info(name, info)
        numel = math.prod(shape)
        if end - start != numel * dtype.itemsize or data_start + end > len(view):
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
    return Features(tensors, meta)


def _tensor_info(name: str, info: object) -> tuple[torch.dtype, list[int], tuple[int, int]]:
    """A tensor's dtype, shape and byte range from its header entry, each within bounds
    (no bools for ints, no negative or oversized dimensions, an ordered range)."""
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or info["dtype"] not in DTYPES:
        raise CorruptValue(f"tensor {name!r}: bad entry")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(d) and 0 <= d < 1 << 40 for d in shape):
        raise CorruptValue(f"tensor {name!r}: bad shape {str(shape)[:100]}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CorruptValue(f"tensor {name!r}: bad byte range {str(offsets)[:100]}")
    return DTYPES[info["dtype"]], shape, (offsets[0], offsets[1])


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _json(text: str | bytes) -> Any:
    """JSON as `encode` writes it: no NaN or Infinity (which Python's parser accepts)."""

    def refuse(constant: str):
        raise CorruptValue(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)
