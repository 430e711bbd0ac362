"""Built-in MiniCPM-V 4.5 in OpenBMB's original format (`MiniCPMV`, config `minicpmv`, `version` 4.5):
its config, image processor and processor are checkpoint code (`configuration_minicpm.py`,
`image_processing_minicpmv.py`, `processing_minicpmv.py`, written here after OpenBMB's, named by the
`auto_map`s of config.json, preprocessor_config.json and processor_config.json), so it loads only with
`trust_remote_code`; vLLM brings the model (`vllm/model_executor/models/minicpmv.py`, which picks
`MiniCPMV4_5` from the config's `version`: a Qwen3 language model, a SigLIP-style NaViT tower (vLLM's
Idefics2 one, from `vision_config`) and a perceiver resampler of `query_num` queries, `hidden / 128`
heads, with 2D sin-cos positions), and its own processor, which takes only the image processor of the
checkpoint (`auto_map["AutoImageProcessor"]`) and the tokenizer.

An image is resized to about `scale_resolution`² pixels (its aspect kept, sides whole patches: the
source view); a larger one is also cut into a grid of at most `max_slice_nums` slices of about that
size. Each view is `query_num` tokens: `<image_id>i</image_id><image>` + `<unk>`×n + `</image>`,
then `<slice>` + `<unk>`×n + `</slice>` per slice, rows joined by newlines. A prompt places an image
as `(<image>./</image>)`. vLLM takes precomputed embeddings as {"image_embeds": (views × n, hidden),
"image_sizes": [width, height] of the original image} (the size its placeholder is sized from)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.model.builtin.common import INIT_RANGE, Spec, byte_level_tokenizer, chat_template, save_code_processor

VERSION = 4.5
MAX_SLICES = 4
QUERY_NUM = 16  # tokens a view (OpenBMB's: 64)
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<unk>",
    "<image>",
    "</image>",
    "<slice>",
    "</slice>",
    "<image_id>",
    "</image_id>",
]
# ChatML, as MiniCPM-V 4.5's; an image is `(<image>./</image>)` on its own line, which the processor (and
# vLLM's) replaces by the image's placeholder.
TEMPLATE = chat_template(
    user_prefix="<|im_start|>user\n",
    user_suffix="<|im_end|>\n",
    assistant_prefix="<|im_start|>assistant\n",
    assistant_suffix="<|im_end|>\n",
    image="(<image>./</image>)\n",
    generation_prompt="<|im_start|>assistant\n",
    system_prefix="<|im_start|>system\n",
    system_suffix="<|im_end|>\n",
)

CONFIG_CODE = '''"""MiniCPM-V's config, as in OpenBMB's MiniCPM-V-4_5 configuration_minicpm.py (written by Iris for a
tiny built-in): Qwen3's language-model settings with the resampler's (`query_num`), the slicing's
(`slice_config`) and the SigLIP tower's (`vision_config`); vLLM picks the model from `version`."""

from transformers import PretrainedConfig, Qwen3Config, SiglipVisionConfig


class MiniCPMVSliceConfig(PretrainedConfig):
    model_type = "minicpmv"

    def __init__(self, patch_size=14, max_slice_nums=9, scale_resolution=448, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.max_slice_nums = max_slice_nums
        self.scale_resolution = scale_resolution


class MiniCPMVConfig(Qwen3Config):
    model_type = "minicpmv"
    keys_to_ignore_at_inference = ["past_key_values"]

    default_vision_config = {
        "hidden_size": 1152,
        "image_size": 980,
        "intermediate_size": 4304,
        "model_type": "siglip",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
    }

    def __init__(
        self,
        use_cache=True,
        query_num=64,
        image_size=448,
        drop_vision_last_layer=True,
        batch_vision_input=True,
        slice_config=None,
        vision_config=None,
        use_image_id=True,
        vision_batch_size=16,
        batch_3d_resampler=True,
        **kwargs,
    ):
        self.use_cache = use_cache
        self.query_num = query_num
        self.image_size = image_size
        self.drop_vision_last_layer = drop_vision_last_layer
        self.batch_vision_input = batch_vision_input
        self.use_image_id = use_image_id
        self.vision_batch_size = vision_batch_size
        self.batch_3d_resampler = batch_3d_resampler
        if slice_config is None:
            self.slice_config = MiniCPMVSliceConfig(max_slice_nums=1)
        elif isinstance(slice_config, dict):
            self.slice_config = MiniCPMVSliceConfig(**slice_config)
        else:
            self.slice_config = slice_config
        self.slice_mode = True
        if vision_config is None:
            self.vision_config = SiglipVisionConfig(**self.default_vision_config)
        elif isinstance(vision_config, dict):
            self.vision_config = SiglipVisionConfig(**vision_config)
        else:
            self.vision_config = vision_config
        self.patch_size = self.vision_config.patch_size
        super().__init__(**kwargs)

    def to_dict(self):
        output = super().to_dict()
        for key in ("slice_config", "vision_config"):
            if hasattr(output.get(key), "to_dict"):
                output[key] = output[key].to_dict()
        return output
'''

IMAGE_PROCESSING_CODE = '''"""MiniCPM-V's image processor, after OpenBMB's MiniCPM-V-4_5
image_processing_minicpmv.py (written by Iris for a tiny built-in): the source view of about
`scale_resolution`² pixels and, for a larger image, a grid of at most `max_slice_nums` slices; each
view is cut into `patch_size` patches laid in a row ((3, patch, patches × patch)), its patch grid in
`tgt_sizes`; and the text placeholder of each image."""

import math

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


class MiniCPMVBatchFeature(BatchFeature):
    """Nested lists (prompts, images, slices) of arrays, converted to tensors item by item."""

    def __init__(self, data=None, tensor_type=None):
        super().__init__(data)
        self.convert_to_tensors(tensor_type=tensor_type)

    def convert_to_tensors(self, tensor_type=None, **kwargs):
        if tensor_type is None:
            return self

        def convert(value):
            if isinstance(value, list):
                return [convert(v) for v in value]
            return value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))

        for key, value in self.items():
            self[key] = convert(value)
        return self


class MiniCPMVImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values"]

    def __init__(self, max_slice_nums=9, scale_resolution=448, patch_size=14, **kwargs):
        self.max_slice_nums = max_slice_nums
        self.scale_resolution = scale_resolution
        self.patch_size = patch_size
        self.use_image_id = kwargs.pop("use_image_id", False)
        self.image_feature_size = kwargs.pop("image_feature_size", 64)
        self.im_start_token = kwargs.pop("im_start", "<image>")
        self.im_end_token = kwargs.pop("im_end", "</image>")
        self.slice_start_token = kwargs.pop("slice_start", "<slice>")
        self.slice_end_token = kwargs.pop("slice_end", "</slice>")
        self.unk_token = kwargs.pop("unk", "<unk>")
        self.im_id_start = kwargs.pop("im_id_start", "<image_id>")
        self.im_id_end = kwargs.pop("im_id_end", "</image_id>")
        self.slice_mode = kwargs.pop("slice_mode", True)
        self.mean = list(kwargs.pop("norm_mean", [0.5, 0.5, 0.5]))
        self.std = list(kwargs.pop("norm_std", [0.5, 0.5, 0.5]))
        self.version = kwargs.pop("version", 2.0)
        super().__init__(**kwargs)

    # -- sizes --

    def ensure_divide(self, length, patch_size):
        return max(round(length / patch_size) * patch_size, patch_size)

    def find_best_resize(self, original_size, scale_resolution, patch_size, allow_upscale=False):
        width, height = original_size
        if (width * height > scale_resolution * scale_resolution) or allow_upscale:
            r = width / height
            height = int(scale_resolution / math.sqrt(r))
            width = int(height * r)
        return (self.ensure_divide(width, patch_size), self.ensure_divide(height, patch_size))

    def get_refine_size(self, original_size, grid, scale_resolution, patch_size, allow_upscale=False):
        width, height = original_size
        grid_x, grid_y = grid
        refine_width = self.ensure_divide(width, grid_x)
        refine_height = self.ensure_divide(height, grid_y)
        best_grid_size = self.find_best_resize(
            (refine_width / grid_x, refine_height / grid_y), scale_resolution, patch_size, allow_upscale=allow_upscale
        )
        return (best_grid_size[0] * grid_x, best_grid_size[1] * grid_y)

    def get_sliced_grid(self, image_size, max_slice_nums, nerver_split=False):
        original_width, original_height = (float(v) for v in image_size)
        log_ratio = math.log(original_width / original_height)
        ratio = original_width * original_height / (self.scale_resolution * self.scale_resolution)
        multiple = min(math.ceil(ratio), max_slice_nums)
        if multiple <= 1 or nerver_split:
            return None
        candidate_split_grids_nums = [
            i for i in (multiple - 1, multiple, multiple + 1) if i != 1 and i <= max_slice_nums
        ]
        candidate_grids = []
        for split_grids_nums in candidate_split_grids_nums:
            for m in range(1, split_grids_nums + 1):
                if split_grids_nums % m == 0:
                    candidate_grids.append([m, split_grids_nums // m])
        best_grid = [1, 1]
        min_error = float("inf")
        for grid in candidate_grids:
            error = abs(log_ratio - math.log(grid[0] / grid[1]))
            if error < min_error:
                best_grid = grid
                min_error = error
        return best_grid

    # -- images --

    def split_to_patches(self, image, grid):
        patches = []
        width, height = image.size
        grid_x = int(width / grid[0])
        grid_y = int(height / grid[1])
        for i in range(0, height, grid_y):
            patches.append([image.crop((j, i, j + grid_x, i + grid_y)) for j in range(0, width, grid_x)])
        return patches

    def slice_image(self, image, max_slice_nums=9, scale_resolution=448, patch_size=14, never_split=False):
        original_size = image.size
        best_grid = self.get_sliced_grid(original_size, max_slice_nums, never_split)
        patches = []
        if best_grid is None:
            best_size = self.find_best_resize(original_size, scale_resolution, patch_size, allow_upscale=True)
            source_image = image.resize(best_size, resample=Image.Resampling.BICUBIC)
        else:
            best_resize = self.find_best_resize(original_size, scale_resolution, patch_size)
            source_image = image.copy().resize(best_resize, resample=Image.Resampling.BICUBIC)
            refine_size = self.get_refine_size(
                original_size, best_grid, scale_resolution, patch_size, allow_upscale=True
            )
            refine_image = image.resize(refine_size, resample=Image.Resampling.BICUBIC)
            patches = self.split_to_patches(refine_image, best_grid)
        return source_image, patches, best_grid

    def get_sliced_images(self, image, max_slice_nums=None):
        if not self.slice_mode:
            return [image]
        max_slice_nums = self.max_slice_nums if max_slice_nums is None else int(max_slice_nums)
        assert max_slice_nums > 0
        source_image, patches, _ = self.slice_image(image, max_slice_nums, self.scale_resolution, self.patch_size)
        return [source_image] + [patch for row in patches for patch in row]

    def reshape_by_patch(self, image):
        """(3, H, W) -> (3, patch_size, H * W / patch_size): the patches in a row, row by row."""
        image = torch.from_numpy(image)
        patch_size = self.patch_size
        patches = torch.nn.functional.unfold(image, (patch_size, patch_size), stride=(patch_size, patch_size))
        patches = patches.reshape(image.size(0), patch_size, patch_size, -1)
        patches = patches.permute(0, 1, 3, 2).reshape(image.size(0), patch_size, -1)
        return patches.numpy()

    # -- text --

    def get_grid_placeholder(self, grid):
        if grid is None:
            return ""
        slice_placeholder = self.slice_start_token + self.unk_token * self.image_feature_size + self.slice_end_token
        cols, rows = grid[0], grid[1]
        return "\\n".join(slice_placeholder * cols for _ in range(rows))

    def get_image_id_placeholder(self, idx=0):
        return f"{self.im_id_start}{idx}{self.im_id_end}"

    def get_slice_image_placeholder(self, image_size, image_idx=0, max_slice_nums=None, use_image_id=None):
        max_slice_nums = self.max_slice_nums if max_slice_nums is None else int(max_slice_nums)
        assert max_slice_nums > 0
        grid = self.get_sliced_grid(image_size=image_size, max_slice_nums=max_slice_nums)
        image_placeholder = self.im_start_token + self.unk_token * self.image_feature_size + self.im_end_token
        use_image_id = self.use_image_id if use_image_id is None else bool(use_image_id)
        placeholder = image_placeholder
        if use_image_id:
            placeholder = self.get_image_id_placeholder(image_idx) + placeholder
        if self.slice_mode:
            placeholder = placeholder + self.get_grid_placeholder(grid=grid)
        return placeholder

    # -- preprocessing --

    def __call__(self, images, **kwargs):
        return self.preprocess(images, **kwargs)

    def preprocess(self, images, do_pad=True, max_slice_nums=None, return_tensors=None, **kwargs):
        if isinstance(images, Image.Image):
            images_list = [[images]]
        elif isinstance(images[0], Image.Image):
            images_list = [images]
        else:
            images_list = images
        mean = np.asarray(self.mean, dtype=np.float32)
        std = np.asarray(self.std, dtype=np.float32)
        new_images_list, image_sizes_list, tgt_sizes_list = [], [], []
        for _images in images_list:
            if _images is None or len(_images) == 0:
                new_images_list.append([])
                image_sizes_list.append([])
                tgt_sizes_list.append([])
                continue
            _images = [
                (image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))).convert("RGB")
                for image in _images
            ]
            new_images, tgt_sizes = [], []
            image_sizes = [image.size for image in _images]
            for image in _images:
                for view in self.get_sliced_images(image, max_slice_nums):
                    pixels = (np.asarray(view, dtype=np.float32) / 255.0 - mean) / std
                    pixels = np.ascontiguousarray(pixels.transpose(2, 0, 1))
                    new_images.append(self.reshape_by_patch(pixels))
                    tgt_sizes.append(np.array((pixels.shape[1] // self.patch_size, pixels.shape[2] // self.patch_size)))
            new_images_list.append(new_images)
            image_sizes_list.append(image_sizes)
            tgt_sizes_list.append(np.vstack(tgt_sizes))
        return MiniCPMVBatchFeature(
            data={"pixel_values": new_images_list, "image_sizes": image_sizes_list, "tgt_sizes": tgt_sizes_list},
            tensor_type=return_tensors,
        )
'''

PROCESSING_CODE = '''"""MiniCPM-V's processor, after OpenBMB's MiniCPM-V-4_5 processing_minicpmv.py (written by
Iris for a tiny built-in): each `(<image>./</image>)` in a text becomes its image's placeholder (the image
processor's `get_slice_image_placeholder`); `image_bound` spans each view's `<unk>` run."""

import re

import torch
from transformers.image_processing_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

PATTERN = "(<image>./</image>)"


class MiniCPMVProcessor(ProcessorMixin):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    def __call__(self, text=None, images=None, max_length=None, return_tensors="pt", **kwargs):
        max_slice_nums = kwargs.get("max_slice_nums")
        image_inputs = {}
        if images is not None:
            image_inputs = self.image_processor(images, max_slice_nums=max_slice_nums, return_tensors=return_tensors)
        if text is None:
            return BatchFeature(data=dict(image_inputs))
        texts = [text] if isinstance(text, str) else list(text)
        if not image_inputs:
            return BatchFeature(data=dict(self.tokenizer(texts, return_tensors=return_tensors)))
        image_sizes = image_inputs["image_sizes"]
        unk_id = self.tokenizer.convert_tokens_to_ids(self.image_processor.unk_token)
        input_ids_list, bounds_list = [], []
        for index, prompt in enumerate(texts):
            chunks = prompt.split(PATTERN)
            if len(chunks) - 1 != len(image_sizes[index]):
                raise ValueError(f"{len(chunks) - 1} image tags for {len(image_sizes[index])} images")
            final = chunks[0]
            for i, chunk in enumerate(chunks[1:]):
                final += self.image_processor.get_slice_image_placeholder(
                    image_sizes[index][i], image_idx=i, max_slice_nums=max_slice_nums
                )
                final += chunk
            ids = self.tokenizer.encode(final, add_special_tokens=False)
            if max_length is not None:
                ids = ids[:max_length]
            ids = torch.tensor(ids, dtype=torch.long)
            runs = [(m.start(), m.end()) for m in re.finditer(r"1+", "".join("1" if t == unk_id else "0" for t in ids))]
            input_ids_list.append(ids)
            bounds_list.append(torch.tensor(runs, dtype=torch.long).reshape(-1, 2))
        width = max(len(ids) for ids in input_ids_list)
        pad_id = self.tokenizer.pad_token_id or 0
        input_ids = torch.full((len(texts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(texts), width), dtype=torch.long)
        for i, ids in enumerate(input_ids_list):  # padded on the left
            input_ids[i, width - len(ids) :] = ids
            attention_mask[i, width - len(ids) :] = 1
            bounds_list[i] = bounds_list[i] + (width - len(ids))
        data = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "pixel_values": image_inputs["pixel_values"],
            "image_sizes": image_sizes,
            "image_bound": bounds_list,
            "tgt_sizes": image_inputs["tgt_sizes"],
        }
        return BatchFeature(data=data)

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    @property
    def model_input_names(self):
        return ["input_ids", "attention_mask", "pixel_values", "image_sizes", "image_bound", "tgt_sizes"]
'''


def build(spec: Spec, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM, SiglipVisionConfig, SiglipVisionModel

    tokenizer = byte_level_tokenizer(SPECIAL, bos="<|im_start|>", eos="<|im_end|>", pad="<|endoftext|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    dtype = getattr(torch, spec.dtype)
    head_dim = spec.text_hidden // spec.text_heads
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp(),
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    language_model = Qwen3ForCausalLM(Qwen3Config(**text)).to(dtype).eval()
    weights = {"llm." + name: t for name, t in language_model.state_dict().items()}

    # The tower: SigLIP (vLLM builds it as Idefics2's NaViT tower, positions bucketed by each view's
    # patch grid); `image_size` sets its position table, twice the slices' side.
    vision = dict(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_mlp(),
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=2 * spec.image_size,
        patch_size=spec.patch_size,
        model_type="siglip",
    )
    siglip = SiglipVisionModel(SiglipVisionConfig(**vision)).to(dtype)
    for name, t in siglip.state_dict().items():
        name = name.removeprefix("vision_model.")
        if not name.startswith("head.") and "position_ids" not in name:
            weights["vpm." + name] = t

    # The resampler: `query_num` queries attending to a view's patches (kv_proj: tower -> text width).
    hidden = spec.text_hidden
    attn = torch.nn.MultiheadAttention(hidden, max(hidden // 128, 1))
    resampler = {
        "query": torch.randn(QUERY_NUM, hidden) * 0.02,
        "kv_proj.weight": torch.randn(hidden, spec.vision_hidden) * 0.02,
        "attn.in_proj_weight": attn.in_proj_weight.detach(),
        "attn.in_proj_bias": torch.zeros(3 * hidden),
        "attn.out_proj.weight": attn.out_proj.weight.detach(),
        "attn.out_proj.bias": torch.zeros(hidden),
        # Output near the text embeddings' scale (INIT_RANGE).
        "proj": torch.randn(hidden, hidden) * hidden**-0.5 * INIT_RANGE,
    }
    for norm in ("ln_q", "ln_kv", "ln_post"):
        resampler[f"{norm}.weight"] = torch.ones(hidden)
        resampler[f"{norm}.bias"] = torch.zeros(hidden)
    weights.update({"resampler." + name: t.to(dtype) for name, t in resampler.items()})
    weights = {n: t.contiguous() for n, t in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = {
        **text,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "architectures": ["MiniCPMV"],
        "model_type": "minicpmv",
        "version": VERSION,
        "auto_map": {
            "AutoConfig": "configuration_minicpm.MiniCPMVConfig",
        },
        "query_num": QUERY_NUM,
        "image_size": spec.image_size,
        "patch_size": spec.patch_size,
        "drop_vision_last_layer": False,
        "batch_vision_input": True,
        "batch_3d_resampler": True,
        "use_image_id": True,
        "vision_batch_size": 16,
        "slice_mode": True,
        "slice_config": {"model_type": "minicpmv", "max_slice_nums": MAX_SLICES, "patch_size": spec.patch_size},
        "vision_config": vision,
        "use_cache": True,
        "dtype": spec.dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_code_processor(
        out,
        tokenizer,
        TEMPLATE,
        {
            "configuration_minicpm.py": CONFIG_CODE,
            "image_processing_minicpmv.py": IMAGE_PROCESSING_CODE,
            "processing_minicpmv.py": PROCESSING_CODE,
        },
        "processing_minicpmv.MiniCPMVProcessor",
        "image_processing_minicpmv.MiniCPMVImageProcessor",
        max_slice_nums=MAX_SLICES,
        scale_resolution=spec.image_size,
        patch_size=spec.patch_size,
        use_image_id=True,
        image_feature_size=QUERY_NUM,
        im_start="<image>",
        im_end="</image>",
        slice_start="<slice>",
        slice_end="</slice>",
        unk="<unk>",
        im_id_start="<image_id>",
        im_id_end="</image_id>",
        slice_mode=True,
        norm_mean=[0.5, 0.5, 0.5],
        norm_std=[0.5, 0.5, 0.5],
        version=VERSION,
    )
