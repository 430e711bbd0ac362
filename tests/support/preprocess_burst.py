"""Run in a fresh interpreter: 8 threads call VisionModel.preprocess at once on a
new VisionModel, as the first burst after a replica starts. Prints a JSON summary.

Usage: python -m tests.support.preprocess_burst CHECKPOINT
"""

from __future__ import annotations

import json
import sys
import threading

from PIL import Image

THREADS = 8


def main() -> None:
    checkpoint = sys.argv[1]
    # The race was in transformers' lazy imports of an image processor's modules: none yet.
    fresh = not any(name.startswith("transformers.models.") and "image_processing" in name for name in sys.modules)
    from pipeline.model.vision_model import VisionModel

    vision = VisionModel(checkpoint)
    barrier = threading.Barrier(THREADS)
    errors, tokens = [], []

    def work(i: int) -> None:
        image = Image.new("RGB", (48 + 8 * i, 64), (30 * i, 100, 200))
        barrier.wait()
        try:
            tokens.append(vision.preprocess(image).num_tokens)
        except Exception as err:  # the bug under test: ImportError from a worker thread
            errors.append(f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"fresh": fresh, "errors": errors, "results": len(tokens)}))


if __name__ == "__main__":
    main()
