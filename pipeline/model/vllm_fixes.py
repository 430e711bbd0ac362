"""Fixes to vLLM that Iris's engines need, applied in every vLLM process as a vLLM general plugin
(pyproject.toml's `vllm.general_plugins` entry point): the engine core runs in a spawned process
(vLLM spawns inside a Ray actor), which only a plugin reaches. Each fix checks the code it
replaces is still there and changes only what that code would refuse, so a vLLM that no longer has
the fault runs as it ships.

One fix so far (vLLM 0.32, CPU build, a CPU with AVX-512 BF16 or ARM BF16):
vLLM's C++ causal conv1d of a hybrid (linear-attention) model's prefill, e.g. Qwen3.5, MiniCPM-V 4.6,
checks that its input is a transposed contiguous (tokens, channels) block by its strides. A step
whose whole batch is one prefill token (a 1-token prompt, or a prompt one token past a
prefix-cache hit) hands it a (1, channels) row of a wider projection: `contiguous()` keeps that
row's stride, the check raises "expect x to be transposed" inside the EngineCore, and the engine
dies. The row copied to its own storage is what the kernel expects; the values are unchanged.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)


def register() -> None:
    """vLLM's general-plugin hook: may run more than once per process (vLLM's own warning)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        patch_single_token_conv1d()


def patch_single_token_conv1d() -> bool:
    """Wrap vLLM's CPU causal-conv1d prefill so a 1-token input has the strides its kernel checks.
    True when the wrapper is in place (now or from an earlier call)."""
    try:
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

        original = gdn_attention._causal_conv1d_fwd_cpu
    except (ImportError, AttributeError):  # another vLLM: nothing of this fault's shape to fix
        return False
    if getattr(original, "iris_fix", False):
        return True

    @functools.wraps(original)
    def causal_conv1d_fwd_cpu(*, x, **kwargs):
        return original(x=single_token_as_transposed(x), **kwargs)

    causal_conv1d_fwd_cpu.iris_fix = True
    gdn_attention._causal_conv1d_fwd_cpu = causal_conv1d_fwd_cpu
    logger.debug("Iris: vLLM's CPU causal conv1d takes 1-token prefills (pipeline/model/vllm_fixes.py)")
    return True


def single_token_as_transposed(x):
    """x is (channels, tokens), a transposed view: with one token its stride along tokens may be
    any number (a size-1 dimension's stride means nothing to `contiguous()`), while vLLM's kernel
    wants it to be the channel count. Copied to a block of its own then; otherwise x itself."""
    channels, tokens = x.shape[-2], x.shape[-1]
    if tokens != 1 or x.stride(-1) == channels:
        return x
    return x.transpose(-1, -2).clone(memory_format=torch.contiguous_format).transpose(-1, -2)
