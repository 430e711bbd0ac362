"""One checkpoint's image path, all of it vLLM's own code, for every family vLLM serves.

- Preprocess (CPU): vLLM's multimodal processor for the checkpoint, the one a
  monolithic `vllm serve` runs, turns an image into the model's processed inputs
  (`MultiModalKwargsItem`: pixels, patch grids, tile counts, ...) and tells how
  many feature tokens it becomes. Models that normalise on the device get uint8
  pixels, as vLLM gives them.
- VisionEncoder: vLLM's model class for the checkpoint, built with
  `mm_encoder_only` (the language model is neither allocated nor loaded), and
  its `embed_multimodal`, the entry point vLLM's own model runner calls.
- LLMDecode: the features go back to vLLM as image embeddings in the form the
  model's data parser declares (`embedding_fields`: e.g. Qwen's
  `image_embeds` + `image_grid_thw`); families that declare nothing take one
  tensor per image.

So nothing here asks which model it serves: a family vLLM accepts image
embeddings for needs no Iris code.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from cache_service.codec import Features
from cache_service.keys import content_hash

FINGERPRINT_CHARS = 16
DEFAULT_VALUES_FIELD = "image_embeds"  # the name vLLM's models give precomputed image features

# Metadata that some families' embedding inputs carry but vLLM's processor does not output
# for pixels, by field name, from the image: MiniCPM-V sizes its slice grid from the
# original image's [width, height].
_METADATA_FROM_IMAGE = {"image_sizes": lambda image: torch.tensor([image.width, image.height])}

# vLLM's torch.distributed state is per process: one model is built at a time.
_DISTRIBUTED_LOCK = threading.Lock()


@dataclass
class PixelInputs:
    """One preprocessed image: vLLM's processed item and its feature-token count."""

    item: Any  # vllm.multimodal.inputs.MultiModalKwargsItem
    num_tokens: int
    metadata: dict[str, torch.Tensor] = field(default_factory=dict)  # embedding metadata not in `item`


def checkpoint_dtype(checkpoint: str) -> str:
    """The dtype a checkpoint was saved in (config.json), e.g. "bfloat16"; float32 if it says none."""
    path = Path(checkpoint) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
    else:  # a hub id
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(checkpoint).to_dict()
    text = config.get("text_config") or {}
    name = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return str(name or "float32").removeprefix("torch.")


class VisionModel:
    """vLLM's processor, encoder and embedding format for one checkpoint.

    `dtype` is vLLM's dtype argument ("auto": the checkpoint's); the encoder and
    the decoder must agree on it for features to equal vLLM's own."""

    def __init__(self, checkpoint: str, dtype: str = "auto", max_images: int = 4,
                 mm_processor_kwargs: dict | None = None):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.multimodal import MULTIMODAL_REGISTRY

        self.checkpoint = checkpoint
        self.mm_processor_kwargs = dict(mm_processor_kwargs or {})
        self.vllm_config = EngineArgs(
            model=checkpoint, dtype=checkpoint_dtype(checkpoint) if dtype == "auto" else dtype,
            mm_encoder_only=True, enable_mm_embeds=True, enforce_eager=True,
            limit_mm_per_prompt={"image": max_images}, mm_processor_kwargs=self.mm_processor_kwargs or None,
        ).create_engine_config()
        model_config = self.vllm_config.model_config
        self.dtype: torch.dtype = model_config.dtype
        self.processor = MULTIMODAL_REGISTRY.create_processor(model_config)
        # The prompt text of one image: the processor expands it into the image's placeholder tokens.
        self._image_prompt = self.processor.dummy_inputs.get_dummy_text({"image": 1})
        roles = type(self.processor.data_parser).embedding_fields.get("image", {})
        values = [name for name, role in roles.items() if role == "values"]
        self.values_field = values[0] if values else DEFAULT_VALUES_FIELD
        self.metadata_fields = tuple(sorted(name for name, role in roles.items() if role == "metadata"))
        self._dict_input = bool(roles)
        self._batched_values = False  # dict input: one tensor per image rather than all rows in one
        self.model: torch.nn.Module | None = None
        self.feature_width: int | None = None  # known once the encoder was loaded here
        self._weights_digest: str | None = None
        self._metadata_kinds: dict[str, tuple[torch.dtype, int]] = {}  # name -> (dtype, ndim), as encoded

    # --- Preprocess (CPU) -------------------------------------------------------
    def preprocess(self, image: Image.Image) -> PixelInputs:
        """vLLM's processor on one RGB image. A ValueError means the model cannot take it."""
        try:
            out = self.processor(self._image_prompt, self.processor.data_parser.parse_mm_data({"image": [image]}),
                                 hf_processor_mm_kwargs=self.mm_processor_kwargs)
        except ValueError as err:
            # vLLM wraps the processor's reason in "Failed to apply <processor> on data=...": the reason.
            cause: BaseException = err
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__
            raise ValueError(str(cause)) from err
        (item,) = out["mm_kwargs"]["image"]
        (placeholder,) = out["mm_placeholders"]["image"]
        metadata = {name: _METADATA_FROM_IMAGE[name](image) for name in self.metadata_fields if name not in item}
        return PixelInputs(item, placeholder.get_num_embeds(), metadata)

    # --- VisionEncoder ------------------------------------------------------------
    def load_encoder(self) -> None:
        """vLLM's model class with the tower and projector only, on vLLM's device."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader

        # What get_model does, with the weights hashed as loaded: vLLM then repacks some
        # into kernel formats (on the CPU, linear weights into oneDNN handles, leaving
        # empty parameters), which would hide them from a hash of the finished model.
        loader = get_model_loader(self.vllm_config.load_config)
        load_weights = loader.load_weights

        def load_and_hash(model, model_config):
            load_weights(model, model_config)
            self._weights_digest = _weights_digest(model)

        loader.load_weights = load_and_hash
        with set_current_vllm_config(self.vllm_config), _process_group_of_one():
            self.model = loader.load_model(vllm_config=self.vllm_config, model_config=self.vllm_config.model_config)
        # One small image warms the tower up and tells the width of its features, which
        # vLLM does not check for dict-form embeddings (e.g. Qwen3-VL's carry DeepStack taps).
        (warm,) = self.encode([self.preprocess(Image.new("RGB", (64, 64), (128, 128, 128)))])
        self.feature_width = int(warm.tensors[self.values_field].shape[1])
        self._metadata_kinds = {name: (warm.tensors[name].dtype, warm.tensors[name].ndim)
                                for name in self.metadata_fields}
        self._check_embedding_input(warm)

    @torch.inference_mode()
    def _check_embedding_input(self, features: Features) -> None:
        """Give the model its own features back as an embedding input, the way vLLM's engine
        does for a request (parser, processor, batching, `embed_multimodal`): they must come
        back unchanged. Families whose vLLM class takes no image embeddings fail here, at
        start-up, rather than on every request."""
        from vllm.config import set_current_vllm_config
        from vllm.multimodal.utils import group_and_batch_mm_kwargs

        arch = self.vllm_config.model_config.architecture
        try:
            # Dict input: vLLM's field config decides whether the values are one tensor of all
            # images' rows (Qwen) or one tensor per image (MiniCPM-V); one image tells which.
            if self._dict_input:
                self._batched_values = not self._parses_as_one_image(features)
            items = self._parse([features])
            out = self.processor(self._image_prompt, items, hf_processor_mm_kwargs={})
            with set_current_vllm_config(self.vllm_config):
                (_, _, kwargs), = group_and_batch_mm_kwargs([("image", out["mm_kwargs"]["image"][0])],
                                                            device=self.vllm_config.device_config.device)
                (back,) = self.model.embed_multimodal(**kwargs)
        except Exception as err:
            raise ValueError(f"{arch}: vLLM does not take this model's image features back as image "
                             f"embeddings ({type(err).__name__}: {err}), so Iris cannot serve it") from err
        if not torch.equal(back.cpu(), features.tensors[self.values_field]):
            raise ValueError(f"{arch}: vLLM changes image embeddings on input; Iris cannot serve it")

    @torch.inference_mode()
    def encode(self, batch: list[PixelInputs]) -> list[Features]:
        """Features of each image, in as few `embed_multimodal` calls as vLLM's batching allows."""
        from vllm.config import set_current_vllm_config
        from vllm.multimodal.utils import group_and_batch_mm_kwargs

        device = self.vllm_config.device_config.device
        embeddings: list[torch.Tensor] = []
        with set_current_vllm_config(self.vllm_config):
            for _, _, kwargs in group_and_batch_mm_kwargs([("image", p.item) for p in batch], device=device):
                embeddings.extend(self.model.embed_multimodal(**kwargs))
        return [self._features(e, p) for e, p in zip(embeddings, batch)]

    def _features(self, embedding: torch.Tensor, pixels: PixelInputs) -> Features:
        tensors = {self.values_field: embedding.detach().to("cpu").contiguous()}
        for name in self.metadata_fields:  # e.g. image_grid_thw: sizes the placeholder from embeddings
            tensors[name] = pixels.item[name].data.to("cpu") if name in pixels.item else pixels.metadata[name]
        return Features(tensors, {"num_tokens": int(embedding.shape[0])})

    def fingerprint(self) -> str:
        """What shapes an image's features: the tower's and projector's weights (byte by byte),
        the architecture and processor settings, the dtype. The language model is not in it."""
        if self._weights_digest is None:
            raise RuntimeError("load_encoder() before computing the fingerprint")
        root = Path(self.checkpoint)
        parts = [json.dumps({"dtype": str(self.dtype), "mm_processor_kwargs": self.mm_processor_kwargs},
                            sort_keys=True).encode()]
        for name in ("config.json", "preprocessor_config.json", "processor_config.json"):
            if (root / name).is_file():
                parts.append((root / name).read_bytes())
        if not (root / "config.json").is_file():  # a hub id: the resolved config instead
            parts.append(self.vllm_config.model_config.hf_config.to_json_string().encode())
        parts.append(self._weights_digest.encode())
        return content_hash(b"\0".join(content_hash(p).encode() for p in parts))[:FINGERPRINT_CHARS]

    def expected_fingerprint(self) -> str:
        """The encoder's fingerprint (and feature width), for a process that does not
        encode (the decoder): loads the tower, hashes it and drops it."""
        self.load_encoder()
        try:
            return self.fingerprint()
        finally:
            self.model = None

    # --- LLMDecode ----------------------------------------------------------------
    def embedding_input(self, features: list[Features]) -> Any:
        """`multi_modal_data["image"]` for these features, in prompt order."""
        if not self._dict_input:
            values = [f.tensors[self.values_field] for f in features]
            # One [images, tokens, hidden] tensor where the images agree in size (LLaVA-1.5: always).
            return torch.stack(values) if len({v.shape for v in values}) == 1 else values
        values = [f.tensors[self.values_field] for f in features]
        data = {self.values_field: values if self._batched_values else torch.cat(values)}
        for name in self.metadata_fields:
            data[name] = torch.stack([f.tensors[name] for f in features])
        return data

    def _parses_as_one_image(self, features: Features) -> bool:
        try:
            return self._parse([features]).get_count("image", strict=False) == 1
        except (ValueError, TypeError):
            return False

    def _parse(self, features: list[Features]):
        return self.processor.data_parser.parse_mm_data({"image": self.embedding_input(features)})

    def feature_problem(self, features: Features) -> str | None:
        """Why `features` cannot be this model's encoder output for one image, or None.
        vLLM's own parser and processor judge them as it would a request's embeddings
        (hidden size, placeholder size from the metadata fields); Iris adds names and dtype."""
        expected = {self.values_field, *self.metadata_fields}
        if set(features.tensors) != expected:
            return f"tensors {sorted(features.tensors)}, expected {sorted(expected)}"
        values = features.tensors[self.values_field]
        if values.dtype != self.dtype:
            return f"{self.values_field} has dtype {values.dtype}, expected {self.dtype}"
        if values.ndim != 2 or features.meta.get("num_tokens") != values.shape[0]:
            return f"{self.values_field} has shape {list(values.shape)}, meta num_tokens {features.meta.get('num_tokens')!r}"
        if self.feature_width is not None and values.shape[1] != self.feature_width:
            return f"{self.values_field} is {values.shape[1]} wide, this model's features {self.feature_width}"
        for name, (dtype, ndim) in self._metadata_kinds.items():
            if (features.tensors[name].dtype, features.tensors[name].ndim) != (dtype, ndim):
                return f"{name} is a {features.tensors[name].ndim}-d {features.tensors[name].dtype} tensor"
        try:
            out = self.processor(self._image_prompt, self._parse([features]), hf_processor_mm_kwargs={})
            (placeholder,) = out["mm_placeholders"]["image"]
        except Exception as err:  # vLLM's validation: wrong hidden size, inconsistent grid, ...
            return f"vLLM refuses them as image embeddings: {err}"
        if placeholder.get_num_embeds() != values.shape[0]:
            return f"{values.shape[0]} feature rows for a placeholder of {placeholder.get_num_embeds()} tokens"
        return None


def _weights_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter and buffer, byte by byte, with its name and dtype."""
    parts = []
    for name, tensor in sorted(model.state_dict().items()):
        parts += [name.encode(), str(tensor.dtype).encode(),
                  content_hash(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).encode()]
    return content_hash(b"\0".join(parts))


@contextlib.contextmanager
def _process_group_of_one():
    """vLLM's layers ask for their tensor-parallel group while they are built: a group of one.
    It goes again once the model is built (a one-process model never uses it), since gloo's
    39 threads would otherwise wake the replica ~1.5% of a core, idle, for good."""
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  ensure_model_parallel_initialized, init_distributed_environment)

    with _DISTRIBUTED_LOCK, tempfile.TemporaryDirectory(prefix="iris-vllm-dist-") as rendezvous:
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{rendezvous}/store", backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
