"""One checkpoint's image and video path, all of it vLLM's own code, for every family vLLM serves.

- Preprocess (CPU): vLLM's multimodal processor for the checkpoint, the one a
  monolithic `vllm serve` runs, turns an image (or a video's decoded frames)
  into the model's processed inputs (`MultiModalKwargsItem`: pixels, patch
  grids, tile counts, frame timestamps, ...) and tells how many feature tokens
  it becomes. Models that normalise on the device get uint8 pixels, as vLLM
  gives them.
- VisionEncoder: vLLM's model class for the checkpoint, built with
  `mm_encoder_only` (the language model is neither allocated nor loaded), and
  its `embed_multimodal`, the entry point vLLM's own model runner calls.
- LLMDecode: the features go back to vLLM as embeddings in the form the
  model's data parser declares per modality (`embedding_fields`: e.g. Qwen's
  `image_embeds` + `image_grid_thw`, `video_embeds` + `video_grid_thw`);
  families that declare nothing take one tensor per item. Where vLLM takes no
  embeddings for a modality (Gemma 3, Mistral 3, Idefics3, InternVL's videos, ...),
  the engine gets the item itself with its key, and Iris's EC connector puts the
  features into the engine's encoder cache (pipeline/model/ec_connector.py): those
  features carry the item's bytes (`SOURCE`), for the engine's processor.

So nothing here asks which model it serves: a family vLLM serves needs no Iris
code. Which way a modality's features reach the decoder is decided at load: as
embeddings where vLLM takes the model's own features back unchanged (and, with M-RoPE,
places them as it places the items themselves), else through the connector.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from cache_service.features import Features
from cache_service.keys import content_hash
from pipeline.errors import causes
from pipeline.model.embedding_form import CONNECTOR, SOURCE, EmbeddingForm
from pipeline.model.encoder_loading import load_encoder_only, process_group_of_one
from pipeline.model.engine_settings import (
    config_dtype,
    feature_settings,
    folder_digest,
    load_refusal,
    stage_engine_args,
)
from pipeline.model.samples import sample_image_bytes, sample_video

FINGERPRINT_CHARS = 16
MODALITIES = ("image", "video")  # what Iris takes from clients; a family serves those vLLM serves for it

# Metadata that some families' embedding inputs carry but vLLM's processor does not output
# for pixels, by field name, from the image: MiniCPM-V sizes its slice grid from the
# original image's [width, height].
_METADATA_FROM_IMAGE = {"image_sizes": lambda image: torch.tensor([image.width, image.height])}

logger = logging.getLogger(__name__)


@dataclass
class PixelInputs:
    """One preprocessed image or video: vLLM's processed item and its feature-token count."""

    item: Any  # vllm.multimodal.inputs.MultiModalKwargsItem
    num_tokens: int
    metadata: dict[str, torch.Tensor] = field(default_factory=dict)  # embedding metadata not in `item`
    modality: str = "image"
    source: bytes | None = None  # the item's bytes, kept where the decoder needs them (connector delivery)
    # VisionModel.processing_id() of the processor that made it: the encoder refuses pixels another
    # Preprocess setting made (a rolling update), which its fingerprint would otherwise vouch for.
    processed_with: str = ""


class VisionModel:
    """vLLM's processor, encoder and embedding format for one checkpoint.

    `dtype` is vLLM's dtype argument ("auto": the checkpoint's); the encoder and
    the decoder must agree on it for features to equal vLLM's own. `max_items` caps
    images and videos per prompt (vLLM's `limit_mm_per_prompt`); `media_io_kwargs`
    is vLLM's `--media-io-kwargs` (e.g. {"video": {"num_frames": 16}}), for the loader.
    `settings`: vLLM's other model settings, as LLMDecode's engine gets them (EngineArgs fields:
    revision, tokenizer, trust_remote_code, hf_overrides, ...; pipeline/model/engine_settings.py).
    `connector`: deliver every modality through the EC connector, also where vLLM takes
    embeddings (to compare the two paths)."""

    def __init__(
        self,
        checkpoint: str,
        dtype: str = "auto",
        max_items: dict[str, int] | None = None,
        mm_processor_kwargs: dict | None = None,
        media_io_kwargs: dict | None = None,
        connector: bool = False,
        settings: Mapping[str, Any] | None = None,
    ):
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.multimodal.media import ImageMediaIO

        self.checkpoint = checkpoint
        self.force_connector = connector
        # vLLM's model settings, as LLMDecode's engine gets them (engine_settings.py): `settings`, with
        # the processor's and loader's settings given apart.
        self.settings = dict(settings or {})
        for name, value in (("mm_processor_kwargs", mm_processor_kwargs), ("media_io_kwargs", media_io_kwargs)):
            if value:
                if self.settings.get(name, value) != value:
                    raise ValueError(f"{name} given twice, with other values")
                self.settings[name] = value
        self.mm_processor_kwargs = dict(self.settings.get("mm_processor_kwargs") or {})
        self.media_io_kwargs = {m: dict(kw) for m, kw in (self.settings.get("media_io_kwargs") or {}).items()}
        # vLLM's image loader as `vllm serve` builds it (RGB, its --media-io-kwargs), for images
        # and video frames alike.
        self.image_io = ImageMediaIO(**({"image_mode": "RGB"} | self.media_io_kwargs.get("image", {})))
        self.limits = limits = {"image": 4, "video": 1, **(max_items or {})}  # items per prompt, by modality
        try:
            if dtype == "auto":  # the checkpoint's, as vLLM resolves its config (hf_overrides, revision, ...)
                hf_config = stage_engine_args(checkpoint, self.settings, "auto", limits).create_model_config().hf_config
                dtype = config_dtype(hf_config)
            self.vllm_config = stage_engine_args(checkpoint, self.settings, dtype, limits).create_engine_config()
        except Exception as err:
            refusal = load_refusal(checkpoint, self.settings, err)
            if refusal is None:
                raise
            raise refusal from err
        model_config = self.vllm_config.model_config
        self.dtype: torch.dtype = model_config.dtype
        self.processor = MULTIMODAL_REGISTRY.create_processor(model_config)
        # The modalities this model serves: vLLM's processor knows them and the limits allow them.
        supported = self.processor.info.get_supported_mm_limits()
        self.modalities = tuple(m for m in MODALITIES if m in supported and limits.get(m))
        for m in self.modalities:  # vLLM's own limit for the model (PaliGemma: one image a prompt)
            if supported[m] is not None:
                limits[m] = min(limits[m], supported[m])
        parser_class = type(self.processor.data_parser)
        self.forms = {m: EmbeddingForm.of(parser_class, m) for m in self.modalities}
        # The prompt text of one item: the processor expands it into the item's placeholder tokens.
        self._prompts = {m: self.processor.dummy_inputs.get_dummy_text({m: 1}) for m in self.modalities}
        self.model: torch.nn.Module | None = None
        # Whether the tower's forward asks for vLLM's tensor-parallel group (Pixtral's in Mistral's format:
        # VisionTransformer.forward sizes its attention metadata by it), found on the first call.
        self._forward_needs_group = False
        self._weights_digest: str | None = None
        self._processing_id: str | None = None
        # Features of the load-time image sample (`sample_image_bytes`), with its bytes where the
        # decoder needs them: LLMDecode checks its path to the engine with them.
        self.sample_features: Features | None = None

    # --- Preprocess (CPU) -------------------------------------------------------
    def _item_prompt(self, modality: str, items, mm_kwargs) -> str | list[int]:
        """The prompt vLLM's processor takes `items` (parsed, of one prompt) in: the processor's own
        text for that many items, which it expands into their placeholder tokens. A processor whose
        text names no placeholder (empty) takes prompts that hold each item's placeholder tokens
        already, laid out by the tokenizer's chat rendering (Pixtral's, in Mistral's format:
        mistral_common places [IMG] tokens by the image's size): those tokens, as vLLM's own prompt
        update for the items gives them."""
        from vllm.multimodal.inputs import MultiModalKwargsItems

        count = items.get_count(modality, strict=False)
        prompt = (
            self._prompts[modality] if count == 1 else self.processor.dummy_inputs.get_dummy_text({modality: count})
        )
        if prompt:
            return prompt
        updates = self.processor._get_prompt_updates(items, mm_kwargs, MultiModalKwargsItems({}))
        tokens: list[int] = []
        for update in updates:
            if update.modality == modality:
                for i in range(count):
                    full = update.resolve(i).content.full
                    tokens += full if isinstance(full, list) else self.processor.info.get_tokenizer().encode(full)
        return tokens

    def preprocess(self, media: Any, modality: str = "image") -> PixelInputs:
        """vLLM's processor on one RGB image, or one video as vLLM's loader gives it
        (frames, metadata). A ValueError means the model cannot take it."""
        if modality not in self.modalities:
            raise ValueError(f"this model takes no {modality} input")
        try:
            items = self.processor.data_parser.parse_mm_data({modality: [media]})
            out = self.processor(
                self._item_prompt(modality, items, self.mm_processor_kwargs),
                items,
                hf_processor_mm_kwargs=self.mm_processor_kwargs,
            )
        except ValueError as err:
            # vLLM wraps the processor's reason in "Failed to apply <processor> on data=...": the reason.
            raise ValueError(str(list(causes(err))[-1])) from err
        (item,) = out["mm_kwargs"][modality]
        (placeholder,) = out["mm_placeholders"][modality]
        metadata = (
            {
                name: _METADATA_FROM_IMAGE[name](media)
                for name in self.forms[modality].metadata_fields
                if name not in item
            }
            if modality == "image"
            else {}
        )
        return PixelInputs(item, placeholder.get_num_embeds(), metadata, modality, processed_with=self.processing_id())

    def load_video(self, data: bytes) -> tuple[np.ndarray, dict]:
        """A video's sampled frames [T, H, W, 3] (uint8) and metadata, decoded by vLLM's video
        loader as `vllm serve` does for this model (its --media-io-kwargs, its backend for the
        model's video processor). Raises on bytes it cannot decode."""
        from vllm.multimodal.media import VideoMediaIO
        from vllm.multimodal.video import get_video_loader_backend_for_processor
        from vllm.transformers_utils.processor import get_video_processor_cls_name

        video_kwargs = dict(self.media_io_kwargs.get("video", {}))
        if "video_backend" not in video_kwargs:
            backend = get_video_loader_backend_for_processor(
                get_video_processor_cls_name(self.vllm_config.model_config)
            )
            if backend:
                video_kwargs["video_backend"] = backend
        return VideoMediaIO(self.image_io, **video_kwargs).load_bytes(data).media

    def load_image(self, data: bytes) -> Image.Image:
        """An image decoded by vLLM's image loader, as `vllm serve` decodes it (RGB, its
        --media-io-kwargs). Raises on bytes it cannot decode."""
        return self.image_io.load_bytes(data).media

    # --- VisionEncoder ------------------------------------------------------------
    def load_encoder(self) -> None:
        """vLLM's model class with the tower and projector only, on vLLM's device; and, per
        modality, how its features reach the decoder."""
        self.model, self._weights_digest = load_encoder_only(self.vllm_config)
        # A small sample of each modality warms the tower up and tells the width of its
        # features, which vLLM does not check for dict-form embeddings (e.g. Qwen3-VL's
        # carry DeepStack taps).
        # Two images of other shapes: a prompt's images may become different token counts, which
        # some families' embedding input does not take (LLaVA-OneVision's: one tensor for all).
        image = sample_image_bytes()
        samples = {
            "image": [self.load_image(image), self.load_image(sample_image_bytes(128, 48))],
            "video": [sample_video()],
        }
        arch = self.vllm_config.model_config.architecture
        for modality in self.modalities:
            batch = [self.preprocess(sample, modality) for sample in samples[modality][: self.limits[modality]]]
            pixels, warm = batch[0], self.encode(batch)
            form = self.forms[modality]
            form.width = int(warm[0].tensors[form.values_field].shape[1])
            form.metadata_kinds = {
                name: (warm[0].tensors[name].dtype, warm[0].tensors[name].ndim) for name in form.metadata_fields
            }
            problem = (
                None
                if self.force_connector
                else self._embedding_input_problem(warm, modality, samples[modality][: self.limits[modality]])
            )
            if self.force_connector or problem:
                form.delivery = CONNECTOR
                logger.info(
                    "%s: %s features reach the decoder through Iris's EC connector (%s)",
                    arch,
                    modality,
                    problem or "configured",
                )
            if modality == "image":
                pixels.source = image
                self.sample_features = self._features(warm[0].tensors[form.values_field], pixels)

    @torch.inference_mode()
    def _embedding_input_problem(
        self, features: list[Features], modality: str, media: list | None = None
    ) -> str | None:
        """Give the model its own features of these items back as the embedding input of one
        prompt, the way vLLM's engine does for a request (parser, processor, batching,
        `embed_multimodal`): they must come back unchanged. Why they do not, or None. Families
        whose vLLM class takes no embeddings for a modality fail here. With the items themselves
        (`media`), a model with M-RoPE must also give the prompt's tokens the positions it gives
        them for the items (MiniCPM-V 4.7 places embeddings at sequential positions, its pixels
        on a canvas)."""
        from vllm.config import set_current_vllm_config
        from vllm.multimodal.utils import group_and_batch_mm_kwargs

        form = self.forms[modality]
        try:
            items = self._parse(features, modality)
            prompt = self._item_prompt(modality, items, {})
            out = self.processor(prompt, items, hf_processor_mm_kwargs={})
            back = []
            with set_current_vllm_config(self.vllm_config):
                for _, _, kwargs in group_and_batch_mm_kwargs(
                    [(modality, item) for item in out["mm_kwargs"][modality]],
                    device=self.vllm_config.device_config.device,
                ):
                    back.extend(self._embed(**kwargs))
        except Exception as err:
            return f"vLLM takes no {modality} embeddings for it: {type(err).__name__}: {err}"
        if len(back) != len(features) or not all(
            torch.equal(b.cpu(), f.tensors[form.values_field]) for b, f in zip(back, features)
        ):
            return f"vLLM changes {modality} embeddings on input"
        if media is not None:
            return self._position_problem(prompt, out, media, modality)
        return None

    def _position_problem(self, prompt: str | list[int], embedded, media: list, modality: str) -> str | None:
        """Why the M-RoPE positions vLLM's model gives a prompt whose items are embeddings (`embedded`,
        the processor's output) are not those it gives the same prompt with the items themselves, or
        None (also for a model without M-RoPE)."""
        from vllm.model_executor.models.interfaces import supports_mrope
        from vllm.multimodal.inputs import MultiModalFeatureSpec

        if not supports_mrope(self.model):
            return None

        def positions(out) -> tuple[list[int], torch.Tensor, int]:
            items = zip(out["mm_kwargs"][modality], out["mm_placeholders"][modality])
            specs = [
                MultiModalFeatureSpec(data=item, modality=modality, identifier=str(i), mm_position=placeholder)
                for i, (item, placeholder) in enumerate(items)
            ]
            tokens = list(out["prompt_token_ids"])
            return (tokens, *self.model.get_mrope_input_positions(tokens, specs))

        try:
            pixels = self.processor(
                prompt, self.processor.data_parser.parse_mm_data({modality: media}), hf_processor_mm_kwargs={}
            )
            (tokens, at, delta), (tokens_back, at_back, delta_back) = positions(pixels), positions(embedded)
        except Exception as err:
            return f"vLLM cannot place {modality} embeddings: {type(err).__name__}: {err}"
        if tokens != tokens_back or delta != delta_back or not torch.equal(at, at_back):
            return f"vLLM gives {modality} embeddings other positions than the {modality}s themselves"
        return None

    def _embed(self, **kwargs) -> list[torch.Tensor]:
        """The model's `embed_multimodal`, in a tensor-parallel group of one where its forward asks for
        one (outside an engine there is none: vLLM's "tensor model parallel group is not initialized")."""
        from vllm.distributed import model_parallel_is_initialized

        if self._forward_needs_group and not model_parallel_is_initialized():
            with process_group_of_one():
                return list(self.model.embed_multimodal(**kwargs))
        try:
            return list(self.model.embed_multimodal(**kwargs))
        except AssertionError as err:
            if "parallel group is not initialized" not in str(err):
                raise
            self._forward_needs_group = True
            return self._embed(**kwargs)

    @torch.inference_mode()
    def encode(self, batch: list[PixelInputs]) -> list[Features]:
        """Features of each item, in as few `embed_multimodal` calls as vLLM's batching allows."""
        from vllm.config import set_current_vllm_config
        from vllm.multimodal.utils import group_and_batch_mm_kwargs

        device = self.vllm_config.device_config.device
        embeddings: list[torch.Tensor] = []
        with set_current_vllm_config(self.vllm_config):
            for _, _, kwargs in group_and_batch_mm_kwargs([(p.modality, p.item) for p in batch], device=device):
                embeddings.extend(self._embed(**kwargs))
        return [self._features(e, p) for e, p in zip(embeddings, batch)]

    def _features(self, embedding: torch.Tensor, pixels: PixelInputs) -> Features:
        form = self.forms[pixels.modality]
        tensors = {form.values_field: embedding.detach().to("cpu").contiguous()}
        if form.delivery == CONNECTOR:
            if pixels.source is not None:  # (None: load_encoder's sample)
                tensors[SOURCE] = torch.frombuffer(bytearray(pixels.source), dtype=torch.uint8)
            metadata_fields = ()
        else:
            metadata_fields = form.metadata_fields
        for name in metadata_fields:  # e.g. image_grid_thw: sizes the placeholder from embeddings
            value = pixels.item[name].data if name in pixels.item else pixels.metadata[name]
            # Fields a processor gives as a list of tensors (OpenBMB's MiniCPM-V processor: an image's
            # image_sizes [tensor([w, h])], a video's one [w, h] a frame) go back as one tensor: an
            # image's alone (the shape vLLM's image embedding input takes), a video's frames stacked.
            if (
                isinstance(value, (list, tuple))
                and value
                and all(isinstance(v, torch.Tensor) and v.ndim for v in value)
            ):
                value = value[0] if pixels.modality == "image" and len(value) == 1 else torch.stack(value)
            # Lists of numbers (Qwen3-VL's frame timestamps) as float64, which keeps their printed value.
            tensors[name] = (
                value.to("cpu") if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
            )
        meta = {"num_tokens": int(embedding.shape[0])}
        if pixels.modality != "image":  # values stored before videos existed are images
            meta["modality"] = pixels.modality
        return Features(tensors, meta)

    def fingerprint(self) -> str:
        """What shapes an item's features: the tower's and projector's weights (byte by byte),
        the architecture, processor and loader settings, the dtype. The language model is not in it."""
        if self._weights_digest is None:
            raise RuntimeError("load_encoder() before computing the fingerprint")
        parts = self._setting_parts() + [self._weights_digest.encode()]
        return content_hash(b"\0".join(content_hash(p).encode() for p in parts))[:FINGERPRINT_CHARS]

    def processing_id(self) -> str:
        """The fingerprint's settings without the weights: what Preprocess's pixels depend on."""
        if self._processing_id is None:
            self._processing_id = content_hash(b"\0".join(content_hash(p).encode() for p in self._setting_parts()))[
                :FINGERPRINT_CHARS
            ]
        return self._processing_id

    def _setting_parts(self) -> list[bytes]:
        # The folder vLLM loads (a hub id's cached snapshot where vLLM resolved one), else the checkpoint's.
        root = next(
            (Path(p) for p in (self.vllm_config.model_config.model, self.checkpoint) if Path(p).is_dir()),
            Path(self.checkpoint),
        )
        # The pixel decoder too: Iris's own decoder rescaled 16-bit images, vLLM's (now Iris's) clips them.
        settings = {
            "dtype": str(self.dtype),
            "mm_processor_kwargs": self.mm_processor_kwargs,
            "image_decoder": "vllm.ImageMediaIO",
        }
        if self.media_io_kwargs:  # (absent, the fingerprints of image-only deployments stay as they were)
            settings["media_io_kwargs"] = self.media_io_kwargs
        # vLLM's other model settings that shape features (revision, hf_overrides, tokenizer, ...): none
        # by default, so the fingerprints of deployments without them stay as they were.
        settings |= {name: value for name, value in feature_settings(self.settings).items() if name not in settings}
        parts = [json.dumps(settings, sort_keys=True).encode()]
        for name in (
            "config.json",
            "preprocessor_config.json",
            "processor_config.json",
            "video_preprocessor_config.json",
            # Mistral's format: its config, and its Tekken tokenizer with the image settings
            # mistral_common sizes images by (tokenizer_mode mistral).
            "params.json",
            "tekken.json",
        ):
            if (root / name).is_file():
                parts.append((root / name).read_bytes())
        if root.is_dir() and any(root.glob("*.py")):  # code the checkpoint ships (trust_remote_code)
            parts.append(b"code:" + folder_digest(root, "*.py").encode())
        if not (root / "config.json").is_file():  # a hub id: the resolved config instead
            parts.append(self.vllm_config.model_config.hf_config.to_json_string().encode())
        return parts

    def expected_fingerprint(self) -> str:
        """The encoder's fingerprint (and feature widths), for a process that does not
        encode (the decoder): loads the tower, hashes it and drops it."""
        self.load_encoder()
        try:
            return self.fingerprint()
        finally:
            self.model = None

    # --- LLMDecode ----------------------------------------------------------------
    def source_items(self, features: list[Features], modality: str = "image") -> list:
        """`multi_modal_data[modality]` for connector delivery, in prompt order: the items themselves,
        decoded by vLLM's loaders from the bytes their features carry (the engine's processor lays
        out their placeholders; the connector brings the values)."""
        load = self.load_image if modality == "image" else self.load_video
        return [load(f.tensors[SOURCE].numpy().tobytes()) for f in features]

    def embedding_item(self, features: Features, modality: str = "image") -> Any:
        """One item's embedding input as vLLM's chat parser takes it from an `image_embeds` /
        `video_embeds` part: the values tensor, or a dict of values and metadata tensors (vLLM
        merges a prompt's items itself)."""
        form = self.forms[modality]
        if not form.dict_input:
            return features.tensors[form.values_field]
        return {name: features.tensors[name] for name in (form.values_field, *form.metadata_fields)}

    def embedding_input(self, features: list[Features], modality: str = "image") -> Any:
        """`multi_modal_data[modality]` for these features, in prompt order, merged from the items'
        embedding inputs as vLLM's chat parser merges a request's `image_embeds` parts: what the
        engine gets from LLMDecode's serving layer."""
        from vllm.renderers.chat_utils import _get_embeds_data

        return _get_embeds_data(modality, [self.embedding_item(f, modality) for f in features], self.processor)

    def _parse(self, features: list[Features], modality: str):
        return self.processor.data_parser.parse_mm_data({modality: self.embedding_input(features, modality)})

    def feature_problem(self, features: Features) -> str | None:
        """Why `features` cannot be this model's encoder output for one item, or None.
        vLLM's own parser and processor judge them as it would a request's embeddings
        (hidden size, placeholder size from the metadata fields); Iris adds names and dtype."""
        modality = features.modality
        if modality not in self.modalities:
            return f"{modality!r} features; this model serves {list(self.modalities)}"
        form = self.forms[modality]
        expected = form.tensor_names()
        if set(features.tensors) != expected:
            return f"tensors {sorted(features.tensors)}, expected {sorted(expected)}"
        values = features.tensors[form.values_field]
        if values.dtype != self.dtype:
            return f"{form.values_field} has dtype {values.dtype}, expected {self.dtype}"
        if values.ndim != 2 or features.num_tokens != values.shape[0]:
            meta_tokens = features.meta.get("num_tokens")
            return f"{form.values_field} has shape {list(values.shape)}, meta num_tokens {meta_tokens!r}"
        if form.width is not None and values.shape[1] != form.width:
            return f"{form.values_field} is {values.shape[1]} wide, this model's features {form.width}"
        if form.delivery == CONNECTOR:
            # The rows are checked against the engine's own placeholder by the connector.
            source = features.tensors[SOURCE]
            return None if source.dtype == torch.uint8 and source.ndim == 1 else f"{SOURCE} is not a byte string"
        for name, (dtype, ndim) in form.metadata_kinds.items():
            if (features.tensors[name].dtype, features.tensors[name].ndim) != (dtype, ndim):
                return f"{name} is a {features.tensors[name].ndim}-d {features.tensors[name].dtype} tensor"
        try:
            items = self._parse([features], modality)
            out = self.processor(self._item_prompt(modality, items, {}), items, hf_processor_mm_kwargs={})
            (placeholder,) = out["mm_placeholders"][modality]
        except Exception as err:  # vLLM's validation: wrong hidden size, inconsistent grid, ...
            return f"vLLM refuses them as {modality} embeddings: {err}"
        if placeholder.get_num_embeds() != values.shape[0]:
            return f"{values.shape[0]} feature rows for a placeholder of {placeholder.get_num_embeds()} tokens"
        return None
