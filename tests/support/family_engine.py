"""One family's image path against one vLLM engine, in a process of its own (a cheaper
fidelity check than a whole app and a `vllm serve` per family; tests/test_family_engines.py).

    python -m tests.support.family_engine CHECKPOINT DTYPE [ENGINE_ARGS_JSON]    # prints one JSON line

Iris's VisionModel (vLLM's processor and model class, encoder-only) computes the features of
the test images and says how they reach the decoder; then vLLM's engine (in this process, as
LLMDecode builds it: with Iris's EC connector where the features go through it) answers each
case twice, greedily:
- "engine": the images under uuids nobody staged, so the engine runs its own tower, as
  `vllm serve` does; its encoder output is kept to compare Iris's features with;
- "iris": the same images under other uuids, fed as LLMDecode feeds them: embeddings, or the
  images with their features staged for the connector.
The connector's counters (vLLM's Prometheus metrics) say, per run, which items it supplied
and which the engine's tower encoded. "chat": one image through vLLM's chat rendering, the
route `vllm serve` answers a chat request by.
"""

from __future__ import annotations

import json
import os
import sys

CASES = {"one image": ["square"], "another size": ["wide"], "two images": ["tall", "wide"]}
MAX_TOKENS = 12


# vLLM's parallel settings: the engine's alone, as LLMDecode passes them (the other stages run one rank).
PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend")


def main(checkpoint: str, dtype: str, engine_args: dict | None = None) -> dict:
    """`engine_args`: the checkpoint's model settings (e.g. trust_remote_code), for every stage, and
    vLLM's parallel settings (tensor_parallel_size, ...), for the engine."""
    engine_args = engine_args or {}
    parallel = {k: v for k, v in engine_args.items() if k in PARALLEL}
    settings = {k: v for k, v in engine_args.items() if k not in PARALLEL}
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    from pipeline.model.ec_connector import connector_counts, ec_transfer_config
    from pipeline.model.ec_staging import FeatureStaging
    from pipeline.model.embedding_form import CONNECTOR
    from pipeline.model.vision_model import VisionModel
    from tests.support.images import REFERENCE_TEXT, data_url, png_bytes

    settings = settings or {}
    vision = VisionModel(checkpoint, dtype, max_items={"image": 2, "video": 0}, settings=settings)
    vision.load_encoder()
    form = vision.forms["image"]
    features = {}
    for name in ("square", "wide", "tall"):
        pixels = vision.preprocess(vision.load_image(png_bytes(name)))
        pixels.source = png_bytes(name)
        (features[name],) = vision.encode([pixels])
        assert vision.feature_problem(features[name]) is None, vision.feature_problem(features[name])
    vision.model = None
    # vLLM shares rotary-embedding modules between models built in one process: the encoder-only
    # build above left the language model's unallocated.
    _ROPE_DICT.clear()

    # As LLMDecode builds its engine: the EC connector only where the features take it.
    staging = FeatureStaging()
    connector = (
        {"ec_transfer_config": ec_transfer_config(staging.dir, {"image": form.width})}
        if form.delivery == CONNECTOR
        else {}
    )
    llm = LLM(
        model=checkpoint,
        dtype=str(vision.dtype).removeprefix("torch."),
        max_model_len=2048,
        enforce_eager=True,
        limit_mm_per_prompt={"image": vision.limits["image"]},
        seed=0,
        enable_mm_embeds=True,
        disable_log_stats=False,
        **connector,
        **settings,
        **parallel,
    )
    engine_tokenizer = llm.get_tokenizer()
    if getattr(engine_tokenizer, "IS_MISTRAL_TOKENIZER", False):
        # Mistral's format (tokenizer_mode mistral): no chat template; mistral_common renders the chat,
        # laying out each image's placeholder tokens by its size, from the images themselves.
        def prompt_ids(images: list[str]) -> list[int]:
            parts = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(n))}} for n in images]
            messages = [{"role": "user", "content": parts + [{"type": "text", "text": REFERENCE_TEXT}]}]
            return list(engine_tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    else:
        # (A checkpoint without a processor of its own, whose processor vLLM brings: its tokenizer.)
        processor = AutoProcessor.from_pretrained(
            checkpoint, trust_remote_code=settings.get("trust_remote_code", False)
        )
        tokenizer = getattr(processor, "tokenizer", processor)

        def prompt_ids(images: list[str]) -> list[int]:
            parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": REFERENCE_TEXT}]
            messages = [{"role": "user", "content": parts}]
            prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    encoder_outputs = {}  # uuid -> the engine's own encoder output for it

    def answer(images: list[str], uuids: list[str], iris: bool) -> dict:
        token_ids = prompt_ids(images)
        mine = [features[n] for n in images]
        if not iris:
            data = [vision.load_image(png_bytes(n)) for n in images]
        elif form.delivery == CONNECTOR:
            for uuid, f in zip(uuids, mine):
                staging.stage(uuid, f)
            data = vision.source_items(mine, "image")
        else:
            data = vision.embedding_input(mine, "image")
        before = connector_counts()
        out = llm.generate(
            {"prompt_token_ids": token_ids, "multi_modal_data": {"image": data}, "multi_modal_uuids": {"image": uuids}},
            params,
            use_tqdm=False,
        )[0].outputs[0]
        if iris and form.delivery == CONNECTOR:
            staging.release(uuids)
        elif not iris:
            # The engine's own encoder output, read now: its encoder cache evicts it to make room for
            # later runs' items (Phi-3-Vision's of ~760 tokens each). One tensor per worker (each rank
            # runs the tower); the first rank's.
            for uuid in uuids:
                encoder_outputs[uuid] = llm.collective_rpc(
                    lambda worker, uuid=uuid: worker.model_runner.encoder_cache[uuid].cpu()
                )[0]
        after = connector_counts()
        return {
            "tokens": list(out.token_ids),
            "logprobs": [next(iter(lp.values())).logprob for lp in out.logprobs],
            **{name: after[name] - before[name] for name in after},
        }

    # vLLM's own limit: some families take one image a prompt (PaliGemma)
    result = {"delivery": form.delivery, "image_limit": vision.limits["image"], "cases": {}, "features": {}}
    for case, images in CASES.items():
        if len(images) > vision.limits["image"]:
            continue
        result["cases"][case] = {
            "engine": answer(images, [f"engine-{case}-{i}" for i in range(len(images))], iris=False),
            "iris": answer(images, [f"iris-{case}-{i}" for i in range(len(images))], iris=True),
        }
    for name, uuid in (("square", "engine-one image-0"), ("wide", "engine-another size-0")):
        engine = encoder_outputs[uuid]
        ours = features[name].tensors[form.values_field]
        result["features"][name] = {
            "shape": [list(ours.shape), list(engine.shape)],
            "dtype": [str(ours.dtype), str(engine.dtype)],
            "max_diff": (ours.float() - engine.float()).abs().max().item(),
            "scale": engine.float().abs().max().item(),
        }
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(png_bytes("square"))}},
                {"type": "text", "text": REFERENCE_TEXT},
            ],
        }
    ]
    (chat_output,) = llm.chat(chat, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs
    result["chat"], result["chat_text"] = list(chat_output.token_ids), chat_output.text
    staging.close()
    return result


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its encoder cache can be read
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(
        json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)), flush=True
    )
