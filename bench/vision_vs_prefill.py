"""How long one image takes through each stage, on this machine, for the `bench`
built-in checkpoints (ViT-B/16-sized vision towers, small language model):

- preprocess: decode + resize + normalise (CPU, the family's image processor)
- vision:     vision tower + projector, one image (Iris's VisionEncoder work)
- prefill:    vLLM prefill of the prompt with the image given as embeddings
              (max_tokens=1, prefix caching off): the language model's share
- vllm_pixels_cold: vLLM's own pixel path, a new image each time (all of the above inside vLLM)
- vllm_pixels_warm: the same image again: vLLM's per-instance processor/encoder caches hit

    python -m bench vision-vs-prefill [--repeats 10]

Prints a table and writes bench/results/vision_vs_prefill.json (or --out).
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from bench.harness import results
from bench.harness.stats import percentile, timed


def _median_ms(fn, repeats: int) -> float:
    return percentile(timed(fn, repeats, warmup=1), 50) * 1000


def bench_family(family: str, repeats: int) -> dict:
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    from pipeline.model.source import resolve_model
    from pipeline.model.vision_model import VisionModel

    checkpoint = resolve_model(f"builtin:bench-{family.replace('_', '-')}")
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))  # a 640x480 photo-sized input
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    jpeg = buf.getvalue()

    vision = VisionModel(checkpoint)
    vision.load_encoder()

    def preprocess():
        return vision.preprocess(Image.open(io.BytesIO(jpeg)).convert("RGB"))

    pixels = preprocess()
    result = {
        "checkpoint": checkpoint,
        "visual_tokens": pixels.num_tokens,
        "preprocess_ms": _median_ms(preprocess, repeats),
        "vision_ms": _median_ms(lambda: vision.encode([pixels]), repeats),
    }
    features = vision.encode([pixels])
    processor = AutoProcessor.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    llm = LLM(
        checkpoint,
        dtype=str(vision.dtype).removeprefix("torch."),
        enable_mm_embeds=True,
        enable_prefix_caching=False,
        max_model_len=2048,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=1)
    embeds = {"prompt": prompt, "multi_modal_data": {"image": vision.embedding_input(features)}}
    fresh = iter([Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)) for _ in range(repeats + 1)])
    same = Image.open(io.BytesIO(jpeg)).convert("RGB")

    def pixels_request(image):
        return llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params, use_tqdm=False)

    result["prefill_ms"] = _median_ms(lambda: llm.generate(embeds, params, use_tqdm=False), repeats)
    result["vllm_pixels_cold_ms"] = _median_ms(lambda: pixels_request(next(fresh)), repeats)
    result["vllm_pixels_warm_ms"] = _median_ms(lambda: pixels_request(same), repeats)
    result["prompt_tokens"] = len(llm.generate(embeds, params, use_tqdm=False)[0].prompt_token_ids)
    result["vision_over_prefill"] = result["vision_ms"] / result["prefill_ms"]
    return result


def main(argv: list[str]) -> None:
    parser = results.parser("vision-vs-prefill", __doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--families", nargs="+", default=["llava", "qwen2_vl", "qwen2_5_vl"])
    parser.add_argument("--out", type=Path, default=results.RESULTS_DIR / "vision_vs_prefill.json")
    args = parser.parse_args(argv)
    record = results.provenance(results.command_line("vision-vs-prefill", argv))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    by_family = {family: bench_family(family, args.repeats) for family in args.families}
    print(
        f"{'family':10} {'tokens':>6} {'preproc ms':>10} {'vision ms':>9} {'prefill ms':>10} "
        f"{'vLLM cold ms':>12} {'vLLM warm ms':>12} {'vision/prefill':>14}"
    )
    for family, r in by_family.items():
        print(
            f"{family:10} {r['visual_tokens']:>6} {r['preprocess_ms']:>10.1f} "
            f"{r['vision_ms']:>9.1f} {r['prefill_ms']:>10.1f} {r['vllm_pixels_cold_ms']:>12.1f} "
            f"{r['vllm_pixels_warm_ms']:>12.1f} {r['vision_over_prefill']:>14.1f}"
        )
    out = results.save({**record, "repeats": args.repeats, "results": by_family}, args.out)
    print(f"saved {out}")


if __name__ == "__main__":
    sys.exit("run it as: python -m bench vision-vs-prefill [options]")
