"""Model-family adapters, chosen by the checkpoint's `model_type`."""

from pipeline.families.base import FamilyAdapter, PixelInputs
from pipeline.families.llava import LlavaAdapter
from pipeline.families.qwen2_vl import Qwen2VLAdapter

ADAPTERS: dict[str, type[FamilyAdapter]] = {
    model_type: cls for cls in (LlavaAdapter, Qwen2VLAdapter) for model_type in cls.model_types
}


def adapter_for(checkpoint: str) -> FamilyAdapter:
    """The adapter for a resolved checkpoint (local folder or hub id)."""
    from pipeline.models.source import model_type

    kind = model_type(checkpoint)
    if kind not in ADAPTERS:
        raise ValueError(f"model type {kind!r} is not supported; supported: {sorted(ADAPTERS)}")
    return ADAPTERS[kind](checkpoint)


__all__ = ["ADAPTERS", "FamilyAdapter", "PixelInputs", "adapter_for"]
