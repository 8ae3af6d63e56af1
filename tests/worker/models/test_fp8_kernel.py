"""Block-FP8 linears on FlashInfer's SM90 blockwise GEMM, the part a CPU can check (the kernel
needs an SM90 GPU: `bench/gpu_check.py`'s quantized step compares it there): which linears may
take it and why not, the call's wiring against a stand-in with the kernel's documented
contract, and the call binding FlashInfer's real signature where the package imports."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from worker.models.quant import fp8_kernel as fk
from worker.models.quant.fp8 import dequantize_fp8_into
from worker.models.quant.resident import Fp8Linear


def _fp8_linear(n: int, k: int, bias: bool, seed: int = 0) -> Fp8Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = Fp8Linear(nn.Linear(k, n, bias=bias), fk.BLOCK)
    with torch.no_grad():
        linear.weight.copy_((torch.randn(n, k, generator=gen) * 30).to(torch.float8_e4m3fn))
        linear.weight_scale_inv.copy_(torch.rand(linear.weight_scale_inv.shape, generator=gen) * 0.01 + 1e-3)
        if linear.bias is not None:
            linear.bias.copy_(torch.randn(n, generator=gen))
    return linear


def stand_in(input: torch.Tensor, weight: torch.Tensor, input_scale: Any, weight_scale: torch.Tensor,
             out: Any = None, out_dtype: Any = None) -> torch.Tensor:  # fmt: skip
    """`fp8_blockscale_gemm_sm90`'s contract as its docstring and checks state (2-D input
    [M, K], weight [N, K] with [ceil(N/128), K/128] float32 scales, no input scale for bf16, a
    fresh [M, N]), computed on the dequantized weight (the kernel also rounds the input to FP8)."""
    assert input.dim() == 2 and input_scale is None and out is None
    assert weight_scale.shape == (-(-weight.shape[0] // 128), input.shape[1] // 128)
    w = torch.empty(weight.shape, dtype=torch.float32)
    dequantize_fp8_into(w, weight, weight_scale, fk.BLOCK)
    return (input.float() @ w.T).to(out_dtype)


@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_path_reshapes_adds_the_bias_and_equals_the_dequantized_product(bias: bool) -> None:
    linear = _fp8_linear(192, 256, bias)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(1))
    want = linear(x)
    linear.kernel = stand_in
    got = linear(x)
    assert got.shape == (2, 3, 192)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_which_linears_may_take_the_kernel() -> None:
    assert fk.shape_unavailable((128, 128), 768, 4096) is None  # MiMo's full-attention k_proj
    assert fk.shape_unavailable((128, 128), 100, 4096) == "in 4096 is not a multiple of 128 or out 100 of 64"
    assert fk.shape_unavailable(None, 128, 128) == "weight_block_size None is not [128, 128]"
    assert fk.device_unavailable(torch.device("cpu"), torch.bfloat16) == "the SM90 blockwise FP8 GEMM is CUDA's (device cpu)"
    model = nn.Sequential(_fp8_linear(128, 128, False))
    assert fk.use_fp8_kernels(model, torch.device("cpu"), torch.bfloat16) is not None
    assert model[0].kernel is None
    assert fk.use_fp8_kernels(nn.Linear(2, 2), torch.device("cpu"), torch.bfloat16) is None  # nothing to do


def test_binds_names_a_call_the_function_does_not_take() -> None:
    def narrow(input: torch.Tensor, weight: torch.Tensor) -> None: ...

    why = fk.binds(narrow)
    assert why is not None and "does not take the call" in why


def test_the_call_binds_flashinfers_signature() -> None:
    """Against the real package (skipped where flashinfer does not import, e.g. CI's CPU venv)."""
    gemm = pytest.importorskip("flashinfer.gemm", reason="flashinfer is not installed")
    assert fk.binds(gemm.fp8_blockscale_gemm_sm90) is None
