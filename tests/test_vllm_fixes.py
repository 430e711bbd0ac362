"""pipeline/model/vllm_fixes.py: the fixes to vLLM every vLLM process loads as a plugin.
The whole-engine case (a 1-token prompt to Qwen3.5 and MiniCPM-V 4.6 served, and the replica
serving after it) is test_families' test_one_token_prompt_leaves_the_replica_serving."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn

from pipeline.model import vllm_fixes

# vLLM's C++ kernel runs where the CPU has BF16 instructions (AVX-512 BF16 here, as vLLM asks torch);
# elsewhere vLLM takes its torch path.
CPP_CONV = "avx512_bf16" in Path("/proc/cpuinfo").read_text() or gdn.is_arm_bf16()


def test_the_fix_is_a_vllm_general_plugin_of_this_install():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("iris_fixes") == "pipeline.model.vllm_fixes:register"


def _prefill(conv, x_rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vLLM's prefill call as _cpu_gdn_attention_nonspec makes it: x transposed, one sequence."""
    channels, width = weight.shape
    return conv(
        x=x_rows.transpose(0, 1),
        weight=weight,
        bias=None,
        conv_states=torch.zeros(2, channels, width - 1, dtype=x_rows.dtype),
        query_start_loc=torch.tensor([0, x_rows.shape[0]], dtype=torch.int32),
        cache_indices=torch.tensor([1], dtype=torch.int32),
        has_initial_state=torch.tensor([False]),
        silu_activation=True,
        is_weight_packed=False,
    )


@pytest.mark.skipif(not CPP_CONV, reason="this CPU takes vLLM's torch path, which never had the fault")
def test_one_token_row_of_a_wider_projection_is_convolved():
    """The fault itself: vLLM's own function raises on a 1-token row of a wider tensor (the step
    of a lone 1-token prefill); the fixed one returns what the same row gives as a block of its own."""
    torch.manual_seed(0)
    channels = 64
    weight = torch.randn(channels, 4, dtype=torch.bfloat16)
    projection = torch.randn(1, channels + 32, dtype=torch.bfloat16)  # q, k, v and more, one token
    row = projection[:, :channels].contiguous()  # a no-op for one row: its stride stays channels + 32
    assert row.stride(0) != channels
    original = gdn._causal_conv1d_fwd_cpu
    if getattr(original, "iris_fix", False):
        original = original.__wrapped__
    with pytest.raises(RuntimeError, match="expect x to be transposed"):
        _prefill(original, row, weight)

    assert vllm_fixes.patch_single_token_conv1d()
    fixed = _prefill(gdn._causal_conv1d_fwd_cpu, row, weight)
    expected = _prefill(original, row.clone(memory_format=torch.contiguous_format), weight)
    assert torch.equal(fixed, expected)
    assert vllm_fixes.patch_single_token_conv1d() and not getattr(
        gdn._causal_conv1d_fwd_cpu.__wrapped__, "iris_fix", False
    )


def test_other_inputs_pass_through_untouched():
    block = torch.randn(5, 64).transpose(0, 1)  # several tokens: the kernel's layout already
    assert vllm_fixes.single_token_as_transposed(block) is block
    own_row = torch.randn(1, 64).transpose(0, 1)
    assert vllm_fixes.single_token_as_transposed(own_row) is own_row
    wide_row = torch.randn(1, 96)[:, :64].transpose(0, 1)
    fixed = vllm_fixes.single_token_as_transposed(wide_row)
    assert fixed.stride() == (1, 64) and torch.equal(fixed, wide_row)
