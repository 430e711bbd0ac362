"""How vLLM takes one modality's precomputed features: as embeddings in the form the model's
data parser declares, or through Iris's EC connector (pipeline/model/ec_connector.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SOURCE = "source"  # connector delivery: the item's bytes as uploaded (uint8), for the engine's processor
EMBEDDINGS, CONNECTOR = "embeddings", "connector"  # how features reach the decoder (EmbeddingForm.delivery)


@dataclass
class EmbeddingForm:
    """How vLLM takes one modality's precomputed features: its data parser's `embedding_fields`
    (a dict of values + metadata tensors, e.g. Qwen's), or one tensor per item (LLaVA); or,
    `delivery` "connector", not as embeddings at all: the engine gets the item and Iris's EC
    connector fills its encoder cache with the values."""

    values_field: str
    metadata_fields: tuple[str, ...]
    dict_input: bool
    width: int | None = None  # of the values, known once the encoder was loaded here
    metadata_kinds: dict[str, tuple[torch.dtype, int]] = field(default_factory=dict)  # name -> (dtype, ndim)
    delivery: str = EMBEDDINGS  # or CONNECTOR; decided by VisionModel.load_encoder

    def tensor_names(self) -> set[str]:
        """What one item's features hold."""
        if self.delivery == CONNECTOR:
            return {self.values_field, SOURCE}
        return {self.values_field, *self.metadata_fields}

    @classmethod
    def of(cls, parser_class, modality: str) -> EmbeddingForm:
        roles = parser_class.embedding_fields.get(modality, {})
        values = [name for name, role in roles.items() if role == "values"]
        return cls(
            values[0] if values else f"{modality}_embeds",
            tuple(sorted(name for name, role in roles.items() if role == "metadata")),
            bool(roles),
        )
