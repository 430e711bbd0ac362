"""The vision encoder on the CPU: two settings Iris picks for it, measured.

- gemm:  the bench tower's forward with torch's linear vs vLLM's packed oneDNN
         GEMM (pipeline/cpu_gemm.py, what vLLM's own ViT uses on the CPU)
- batch: CPU time per image for a batch of 1, 2 and 4 images (why
         encoder_batch_size "auto" is 1 on the CPU)

CPU time of this process (one torch thread, as the VisionEncoder replica has),
not wall time, so that other load on the machine disturbs it less; each variant
is run alternately and its fastest third kept.

    .venv/bin/python bench/encoder_cpu.py [--model builtin:bench-llava] [--repeats 12]

Prints a table and writes bench/results/encoder_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _cpu_ms(fn) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1000


def _fastest_third(samples: list[float]) -> float:
    return statistics.mean(sorted(samples)[: max(1, len(samples) // 3)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:bench-llava")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "bench/results/encoder_cpu.json"))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from pipeline.cpu_gemm import use_vllm_cpu_gemm
    from pipeline.families import adapter_for
    from pipeline.models.source import resolve_model
    from tests.support.images import make_image

    plain = adapter_for(resolve_model(args.model))
    plain.load_vision(device="cpu")  # torch's own linear
    packed = adapter_for(resolve_model(args.model))
    packed.load_vision(device="cpu")
    use_vllm_cpu_gemm(packed.vision)  # as the VisionEncoder replica does on the CPU
    pixels = packed.preprocess(make_image(640, 480, 0))

    with torch.inference_mode():
        same = torch.equal(packed.encode([pixels])[0].tensors["image_embeds"],
                           plain.encode([pixels])[0].tensors["image_embeds"])
        gemm = {"torch_linear": [], "vllm_onednn": []}
        batch = {1: [], 2: [], 4: []}
        for _ in range(args.repeats):
            gemm["torch_linear"].append(_cpu_ms(lambda: plain.encode([pixels])))
            gemm["vllm_onednn"].append(_cpu_ms(lambda: packed.encode([pixels])))
            for size in batch:
                batch[size].append(_cpu_ms(lambda: packed.encode([pixels] * size)) / size)

    result = {
        "model": args.model, "dtype": str(packed.vision_dtype), "torch_threads": 1,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "repeats": args.repeats,
        "gemm_ms_per_image": {k: round(_fastest_third(v), 1) for k, v in gemm.items()},
        "identical_features": same,
        "batch_ms_per_image": {str(k): round(_fastest_third(v), 1) for k, v in batch.items()},
    }
    g = result["gemm_ms_per_image"]
    result["onednn_saving"] = round(1 - g["vllm_onednn"] / g["torch_linear"], 3)
    print(f"{args.model} ({result['dtype']}), CPU ms per image, one torch thread")
    print(f"  torch linear {g['torch_linear']:.1f}  vLLM oneDNN {g['vllm_onednn']:.1f}  "
          f"({result['onednn_saving']:.1%} less; identical features: {same})")
    print("  batch of " + ", ".join(f"{k}: {v:.1f}" for k, v in result["batch_ms_per_image"].items()))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
