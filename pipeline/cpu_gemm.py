"""The vision tower's linear layers on the CPU through vLLM's oneDNN GEMM.

vLLM runs its own ViT's linear layers on the CPU through oneDNN with the
weights packed once at load. Doing the same in Iris's encoder gives the same
outputs for about 8% less CPU per image than torch's linear on the bench tower
(bench/encoder_cpu.py); on a GPU nothing changes.
"""

from __future__ import annotations

import functools

import torch


def use_vllm_cpu_gemm(module: torch.nn.Module) -> int:
    """Routes every CPU nn.Linear of `module` through vLLM's packed oneDNN GEMM and
    returns how many; 0 where vLLM's CPU kernels are not built (e.g. a CUDA wheel)."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return 0
    if not getattr(ops, "_supports_onednn", False):
        return 0
    count = 0
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and layer.weight.device.type == "cpu":
            # The weights stay in place: the model fingerprint hashes them.
            handle = ops.create_onednn_mm(layer.weight.detach().t(), 32)
            layer.forward = functools.partial(_packed_linear, ops.onednn_mm, handle, layer.bias)
            count += 1
    return count


def _packed_linear(onednn_mm, handle, bias, x: torch.Tensor) -> torch.Tensor:
    return onednn_mm(handle, x, bias)
