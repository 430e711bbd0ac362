"""Plain vLLM, offline, as the reference the tests compare against.

Run as a script so each engine lives and dies in its own process (memory):
    python tests/support/vllm_offline.py CHECKPOINT CASES.json OUT.json

For each case (image file + user text) it generates greedily
- from pixels (vLLM's own processor and vision tower), and
- from features computed outside vLLM by Iris's family adapter (transformers
  vision tower + projector) given as image embeddings (`enable_mm_embeds`),
and then repeats the embeddings request to read vLLM's prefix-cache hit tokens.
"""

from __future__ import annotations

import json
import os
import sys


def main(checkpoint: str, cases_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from PIL import Image
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    from pipeline.families import adapter_for

    cases = json.loads(open(cases_path).read())
    adapter = adapter_for(checkpoint)
    adapter.load_vision()
    processor = AutoProcessor.from_pretrained(checkpoint)
    llm = LLM(checkpoint, dtype=str(adapter.vision_dtype).removeprefix("torch."), enable_mm_embeds=True,
              enable_prefix_caching=True, max_model_len=2048, limit_mm_per_prompt={"image": 4}, seed=0)
    results = []
    for case in cases:
        image = Image.open(case["image"]).convert("RGB")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": case["text"]}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        params = SamplingParams(temperature=0.0, max_tokens=case.get("max_tokens", 16))
        pixel = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
        features = adapter.encode([adapter.preprocess(image)])
        embeds_request = {
            "prompt": prompt,
            "multi_modal_data": {"image": adapter.vllm_image_data(features)},
            "multi_modal_uuids": {"image": [f"case-{len(results)}"]},
        }
        embeds = llm.generate(embeds_request, params, use_tqdm=False)[0]
        again = llm.generate(embeds_request, params, use_tqdm=False)[0]
        results.append({
            "prompt": prompt,
            "prompt_tokens": len(pixel.prompt_token_ids),
            "pixel_tokens": list(pixel.outputs[0].token_ids),
            "pixel_text": pixel.outputs[0].text,
            "embeds_tokens": list(embeds.outputs[0].token_ids),
            "repeat_tokens": list(again.outputs[0].token_ids),
            "repeat_cached_tokens": again.num_cached_tokens or 0,
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        })
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(*sys.argv[1:4])
