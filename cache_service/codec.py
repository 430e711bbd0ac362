"""Features and their byte form in Redis.

A value is a 16-byte header followed by an Arrow IPC stream:

    offset 0   4 bytes  magic b"IRF1"
    offset 4   uint32   checksum algorithm, little-endian (1 = xxh3_64)
    offset 8   uint64   checksum of everything after the header, little-endian
    offset 16  Arrow IPC stream: one record batch of one row, one large_binary
               column per tensor (field name = tensor name, field metadata
               "dtype" and "shape"), schema metadata "iris.meta" = meta as JSON.

Why this shape:
- One column per tensor lets Arrow write each tensor's memory straight from
  the torch storage (no concatenation), and on decode lets `torch.frombuffer`
  point into the received value (no copy). bf16 needs no numpy detour: bytes
  are bytes, the dtype is in the field metadata.
- The 16-byte header keeps Arrow's 8-byte buffer alignment relative to the
  start of the value, so decoded tensors are aligned for any dtype.
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

import pyarrow as pa
import torch
import xxhash

MAGIC = b"IRF1"
CHECKSUM_XXH3_64 = 1
HEADER = struct.Struct("<4sIQ")
_META_KEY = b"iris.meta"

# Stored by name so a value does not depend on torch's enum numbering.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


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
            if tensor.dtype not in _DTYPE_NAMES:
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
    """Serialise to header + Arrow IPC stream; one copy of the tensor bytes."""
    columns, fields = [], []
    for name, tensor in features.tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        raw = pa.py_buffer(tensor.reshape(-1).view(torch.uint8).numpy())
        offsets = pa.py_buffer(struct.pack("<qq", 0, raw.size))
        columns.append(pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, raw]))
        fields.append(
            pa.field(
                name,
                pa.large_binary(),
                nullable=False,
                metadata={"dtype": _DTYPE_NAMES[tensor.dtype], "shape": json.dumps(list(tensor.shape))},
            )
        )
    meta = json.dumps(features.meta, separators=(",", ":"), allow_nan=False)
    schema = pa.schema(fields, metadata={_META_KEY: meta})
    batch = pa.RecordBatch.from_arrays(columns, schema=schema)

    # Measure first, then write once into a buffer that already has room for
    # the header: no second copy to prepend it.
    counter = pa.MockOutputStream()
    _write_stream(counter, batch)
    out = bytearray(HEADER.size + counter.size())
    payload = memoryview(out)[HEADER.size :]
    _write_stream(pa.FixedSizeBufferWriter(pa.py_buffer(payload)), batch)
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
    payload = view[HEADER.size :]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptValue("checksum mismatch (truncated or garbled value)")
    try:
        return _decode_payload(view, payload, copy)
    except CorruptValue:
        raise
    except (pa.ArrowException, ValueError, TypeError, KeyError, RuntimeError) as exc:
        # The checksum matched, so this is a value of another writer or a bug;
        # either way it must not reach a model.
        raise CorruptValue(f"undecodable value: {exc}") from exc


def _write_stream(sink: Any, batch: pa.RecordBatch) -> None:
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)


def _decode_payload(view: memoryview, payload: memoryview, copy: bool) -> Features:
    arrow_payload = pa.py_buffer(payload)
    batch = pa.ipc.open_stream(arrow_payload).read_next_batch()
    meta_json = (batch.schema.metadata or {}).get(_META_KEY)
    if meta_json is None:
        raise CorruptValue("missing metadata")
    meta = json.loads(meta_json)
    # Offsets of the tensors are taken relative to the value's own memory, so
    # torch.frombuffer wraps `view` itself and inherits its writability
    # (Arrow's slices of it would always be read-only).
    base_address = arrow_payload.address - HEADER.size
    tensors = {}
    for field_, column in zip(batch.schema, batch.columns):
        field_meta = field_.metadata or {}
        dtype = DTYPES[field_meta[b"dtype"].decode()]
        shape = json.loads(field_meta[b"shape"])
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CorruptValue(f"bad shape {shape!r}")
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if column.type != pa.large_binary() or len(column) != 1:
            raise CorruptValue(f"tensor {field_.name!r}: unexpected column layout")
        _, offsets, data = column.buffers()
        start, end = struct.unpack_from("<qq", offsets, 8 * column.offset)
        if end - start != nbytes or end > data.size:
            raise CorruptValue(f"tensor {field_.name!r}: {end - start} bytes for shape {shape}")
        if numel == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            offset = data.address + start - base_address
            with warnings.catch_warnings():
                # A `bytes` value gives a read-only buffer; torch warns once per
                # call. Read-only use is the documented contract.
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(view, dtype=dtype, count=numel, offset=offset).view(shape)
            if copy:
                tensor = tensor.clone()
        tensors[field_.name] = tensor
    return Features(tensors, meta)
