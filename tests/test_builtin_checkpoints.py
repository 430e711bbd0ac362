"""The built-in checkpoints: deterministic, hub layout, loadable by transformers;
and vLLM's encoder-only model batches them. (That Iris's features equal vLLM's own
encoder output is tests/test_families.py.)"""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from pipeline.model.builtin import BUILDERS, FAMILIES, build_checkpoint
from pipeline.model.source import resolve_model
from pipeline.model.vision_model import VisionModel
from tests.support.images import SIZES, make_image

# Built-ins in Mistral's own format (params.json, tekken.json, consolidated.safetensors: vLLM's and
# mistral_common's loaders read them, transformers does not); in the Hugging Face format (transformers
# has their classes); and the others, which ship their config classes as checkpoint code, and vLLM
# brings their model and processor (InternVL's original format).
MISTRAL_FORMAT = tuple(f for f in FAMILIES if BUILDERS[f].engine_args.get("config_format") == "mistral")
HF_FORMAT = tuple(
    f for f in FAMILIES if not BUILDERS[f].engine_args.get("trust_remote_code") and f not in MISTRAL_FORMAT
)
CODE_FORMAT = tuple(f for f in FAMILIES if BUILDERS[f].engine_args.get("trust_remote_code"))


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_build_is_deterministic(tmp_path, tiny_checkpoint):
    again = build_checkpoint("llava", "tiny", tmp_path / "again")
    assert _digest(again) == _digest(Path(tiny_checkpoint("llava")))


@pytest.mark.parametrize("family", HF_FORMAT)
def test_hub_layout(family, tiny_checkpoint):
    from safetensors import safe_open

    folder = Path(tiny_checkpoint(family))
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "model.safetensors",
    ):
        assert (folder / name).is_file(), name
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    if family in ("llava", "llava_next", "gemma3"):  # the hub's CLIP/SigLIP layout, which vLLM's loader expects
        assert any(k.startswith("vision_tower.vision_model.") for k in keys)
        assert not any(k.startswith("vision_tower.encoder.") for k in keys)


@pytest.mark.parametrize("family", MISTRAL_FORMAT)
def test_mistral_layout(family, tiny_checkpoint):
    """Mistral's own layout, as its hub repositories ship it: vLLM reads params.json into the model's
    config (with the vision encoder's), mistral_common's Tekken tokenizer reads tekken.json with its
    image settings, and the weights carry Mistral's names."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from safetensors import safe_open
    from vllm.transformers_utils.config import get_config

    folder = Path(tiny_checkpoint(family))
    assert not (folder / "config.json").exists()
    params = json.loads((folder / "params.json").read_text())
    config = get_config(str(folder), trust_remote_code=False, config_format="mistral")
    assert config.architectures == ["PixtralForConditionalGeneration"]
    assert config.text_config.hidden_size == params["dim"]
    assert config.vision_config.image_token_id == params["vision_encoder"]["image_token_id"]
    tokenizer = MistralTokenizer.from_file(str(folder / "tekken.json"))
    tekken = tokenizer.instruct_tokenizer.tokenizer
    assert tekken.n_words == params["vocab_size"]
    assert tekken.get_special_token("[IMG]") == params["vision_encoder"]["image_token_id"]
    assert tekken.image.max_image_size == params["vision_encoder"]["image_size"]
    assert tokenizer.instruct_tokenizer.mm_encoder is not None
    with safe_open(str(folder / "consolidated.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"tok_embeddings.weight", "layers.0.attention.wq.weight", "output.weight"} <= keys
    assert {"vision_encoder.patch_conv.weight", "vision_language_adapter.w_in.weight"} <= keys
    assert "vision_encoder.transformer.layers.0.feed_forward.w1.weight" in keys


@pytest.mark.parametrize("family", CODE_FORMAT)
def test_checkpoint_code_loads_only_when_trusted(family, tiny_checkpoint):
    """Its config class is the checkpoint's own code, named by config.json's auto_map: transformers
    refuses it without trust_remote_code, as for the checkpoints users download."""
    from transformers import AutoConfig

    folder = Path(tiny_checkpoint(family))
    config = json.loads((folder / "config.json").read_text())
    for module in {ref.split(".")[0] for ref in config["auto_map"].values()}:
        assert (folder / f"{module}.py").is_file(), module
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(folder)
    loaded = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert type(loaded).__module__.startswith("transformers_modules") and loaded.model_type == config["model_type"]
    # A processor that is checkpoint code too (Phi-3-Vision's), named by preprocessor_config.json's auto_map.
    preprocessor = folder / "preprocessor_config.json"
    if preprocessor.is_file() and "auto_map" in json.loads(preprocessor.read_text()):
        from transformers import AutoProcessor

        for module in {ref.split(".")[0] for ref in json.loads(preprocessor.read_text())["auto_map"].values()}:
            assert (folder / f"{module}.py").is_file(), module
        with pytest.raises(ValueError, match="trust_remote_code"):
            AutoProcessor.from_pretrained(folder)
        processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
        assert type(processor).__module__.startswith("transformers_modules")
        assert type(processor.image_processor).__module__.startswith("transformers_modules")


@pytest.mark.parametrize("family", HF_FORMAT)
def test_transformers_loads_and_runs(family, tiny_checkpoint):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = tiny_checkpoint(family)
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=[make_image(*SIZES["wide"])], return_tensors="pt")
    # (Llama 4's image processor hands out bfloat16 pixels whatever the model's dtype.)
    inputs = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    # The processor expanded the single image placeholder into the vision tokens.
    image_token = getattr(model.config, "image_token_id", None) or model.config.image_token_index
    assert int((inputs["input_ids"] == image_token).sum()) > 1


def test_batched_encode_equals_single(tiny_checkpoint):
    vision = VisionModel(tiny_checkpoint("qwen2_vl"))
    vision.load_encoder()
    pixels = [vision.preprocess(make_image(*s)) for s in SIZES.values()]
    batched = vision.encode(pixels)
    for p, b in zip(pixels, batched):
        torch.testing.assert_close(
            b.tensors["image_embeds"], vision.encode([p])[0].tensors["image_embeds"], rtol=0, atol=1e-4
        )
    assert len({p.num_tokens for p in pixels}) == 3  # sizes differ: dynamic resolution works


def test_bench_checkpoints_build_and_load(tmp_path):
    """The bench sizes have a realistic vision tower (ViT-B: CLIP ViT-B/16 at 224 px for LLaVA)."""
    for family in ("llava", "qwen2_vl", "qwen2_5_vl"):
        folder = build_checkpoint(family, "bench", tmp_path / family)
        vision_config = json.loads((folder / "config.json").read_text())["vision_config"]
        assert vision_config.get("embed_dim", vision_config["hidden_size"]) == 768  # ViT-B: 768 wide, 12 deep
        assert vision_config.get("depth", vision_config.get("num_hidden_layers")) == 12
        vision = VisionModel(str(folder))
        vision.load_encoder()
        features = vision.encode([vision.preprocess(make_image(224, 224, 0))])[0]
        assert features.tensors["image_embeds"].shape[0] == (196 if family == "llava" else 64)


def test_resolve_model_forms(tmp_path, tiny_checkpoint):
    assert resolve_model("builtin:tiny-llava") == tiny_checkpoint("llava")  # built once, then reused
    assert resolve_model(tiny_checkpoint("llava")) == str(Path(tiny_checkpoint("llava")).resolve())
    assert resolve_model("llava-hf/llava-1.5-7b-hf") == "llava-hf/llava-1.5-7b-hf"  # hub id left to the loaders
    with pytest.raises(ValueError, match="unknown built-in"):
        resolve_model("builtin:huge-llava")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("./nope")


def _model_on_meta(family: str, size: str, monkeypatch, tmp_path):
    """The model a builder makes, allocated on no device (its weights are not drawn nor saved)."""
    import pipeline.model.builtin as builtin
    from pipeline.model.builtin import llava, qwen2_vl

    made = {}
    for module in (llava, qwen2_vl):
        monkeypatch.setattr(
            module, "save", lambda model, processor, tokenizer, spec, out: made.update(model=model, tokenizer=tokenizer)
        )
    spec = builtin.BUILDERS[family].specs[size]
    with builtin.drawing_weights(spec, "meta"):
        builtin.BUILDERS[family].build(spec, tmp_path)
    return made["model"], made["tokenizer"]


@pytest.mark.parametrize(
    "family, billions, text, vision",
    [
        # (hidden, layers, heads, kv heads, MLP, vocabulary), (hidden, layers, heads, patch, MLP):
        # the real config.json's
        ("llava", 7.063, (4096, 32, 32, 32, 11008, 32064), (1024, 24, 16, 14, 4096)),
        ("qwen2_5_vl", 8.292, (3584, 28, 28, 4, 18944, 152064), (1280, 32, 16, 14, 3420)),
    ],
)
def test_7b_builtins_have_the_real_models_dimensions(family, billions, text, vision, monkeypatch, tmp_path):
    """builtin:7b-llava and builtin:7b-qwen2-5-vl are LLaVA-1.5-7B and Qwen2.5-VL-7B but for their
    weights and tokenizer: the same parameter count (7.06 B, 8.29 B), bfloat16."""
    model, tokenizer = _model_on_meta(family, "7b", monkeypatch, tmp_path)
    params = sum(p.numel() for p in model.parameters())
    assert params / 1e9 == pytest.approx(billions, abs=0.001)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    t, v = model.config.text_config, model.config.vision_config
    assert (
        t.hidden_size,
        t.num_hidden_layers,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.intermediate_size,
        t.vocab_size,
    ) == text
    assert len(tokenizer) == t.vocab_size
    depth = getattr(v, "num_hidden_layers", None) or v.depth
    heads = getattr(v, "num_attention_heads", None) or v.num_heads
    assert (v.hidden_size, depth, heads, v.patch_size, v.intermediate_size) == vision
    if family == "llava":
        assert v.image_size == 336 and model.config.image_seq_length == 576
    else:
        assert v.fullatt_block_indexes == [7, 15, 23, 31] and v.out_hidden_size == 3584 and v.window_size == 112


def test_padded_vocabulary_decodes_every_token_and_text_encodes_to_bytes_only(tmp_path, monkeypatch):
    """A real-size vocabulary (the 7b sizes): the padding tokens decode like any other (a random model
    emits them) and no text encodes to them; a fast build (bfloat16 drawn on the build device) loads."""
    import dataclasses

    from transformers import AutoModelForImageTextToText, AutoTokenizer

    import pipeline.model.builtin as builtin

    spec = dataclasses.replace(
        builtin.BUILDERS["qwen2_5_vl"].specs["tiny"],
        dtype="bfloat16",
        vocab_size=2000,
        text_intermediate=200,
        vision_intermediate=96,
        fast_build=True,
    )
    monkeypatch.setitem(
        builtin.BUILDERS, "qwen2_5_vl", dataclasses.replace(builtin.BUILDERS["qwen2_5_vl"], specs={"padded": spec})
    )
    folder = build_checkpoint("qwen2_5_vl", "padded", tmp_path / "padded")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 2000
    text = "Describe the picture, s'il vous plaît: 日本"
    ids = tokenizer(text)["input_ids"]
    assert max(ids) < 256 and tokenizer.decode(ids) == text
    padding = range(256, 2000 - 7)  # 7 special tokens after the padding
    assert all(tokenizer.decode([i]) for i in padding)
    assert len({tokenizer.convert_ids_to_tokens(i) for i in padding}) == len(padding)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert model.dtype == torch.bfloat16 and model.config.text_config.intermediate_size == 200
    assert model.get_output_embeddings().weight.shape[0] == 2000


def test_text_only_llama(tmp_path, tiny_checkpoint, monkeypatch):
    """builtin:tiny-llama: LLaVA's language model and tokenizer alone (LlamaForCausalLM), for apps that
    serve a VLM beside a text model. Built like the others (seeded, byte-identical when built twice, the
    CLI builds it), no VLM family (the family lists the VLM tests iterate leave it out), and vLLM's
    config says it takes no images or videos."""
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.engine.arg_utils import EngineArgs

    import pipeline.model.builtin as builtin
    from pipeline.model.engine_settings import takes_media
    from pipeline.model.source import builtin_engine_args, builtin_names

    folder = Path(tiny_checkpoint("llama"))
    assert "builtin:tiny-llama" in builtin_names() and builtin_engine_args("builtin:tiny-llama") == {}
    assert "llama" not in BUILDERS and "llama" not in FAMILIES
    assert "llama" not in builtin.APP_TESTED_FAMILIES + builtin.ENGINE_TESTED_FAMILIES
    monkeypatch.setattr(sys, "argv", ["builtin", "--family", "llama", "--out", str(tmp_path / "again")])
    builtin.main()
    assert _digest(tmp_path / "again") == _digest(folder)
    assert not (folder / "preprocessor_config.json").exists() and not (folder / "processor_config.json").exists()

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "vision_config" not in config
    llava = json.loads((Path(tiny_checkpoint("llava")) / "config.json").read_text())["text_config"]
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert config[name] == llava[name], name
    assert (folder / "generation_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny_checkpoint("llava")).get_vocab()
    plain = [{"role": "user", "content": "What is it?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What "}, {"type": "text", "text": "is it?"}]}]
    prompt = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    assert prompt == "USER: What is it?\nASSISTANT:"
    assert tokenizer.apply_chat_template(parts, add_generation_prompt=True, tokenize=False) == prompt
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == tokenizer.chat_template

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4

    assert not EngineArgs(model=str(folder)).create_model_config().is_multimodal_model
    assert takes_media(str(folder), {}) is False
    assert takes_media(tiny_checkpoint("llava"), {}) is True
