"""Run in a fresh interpreter: 8 threads call adapter.preprocess at once on a
new adapter, as the first burst after a replica starts. Prints a JSON summary.

Usage: python -m tests.support.preprocess_burst CHECKPOINT [--eager]
(--eager calls load_preprocessing() first, as the Preprocess replica does).
"""

from __future__ import annotations

import json
import sys
import threading

from PIL import Image

from pipeline.families import adapter_for

THREADS = 8


def main() -> None:
    checkpoint, eager = sys.argv[1], "--eager" in sys.argv
    adapter = adapter_for(checkpoint)
    # The race is in transformers' first (lazy) import: it must not have happened yet.
    fresh = "transformers" not in sys.modules
    if eager:
        adapter.load_preprocessing()
    barrier = threading.Barrier(THREADS)
    errors, tokens = [], []

    def work(i: int) -> None:
        image = Image.new("RGB", (48 + 8 * i, 64), (30 * i, 100, 200))
        barrier.wait()
        try:
            tokens.append(adapter.preprocess(image).num_tokens)
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
