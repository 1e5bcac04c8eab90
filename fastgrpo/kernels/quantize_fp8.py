"""quantize_fp8's rounding in one Triton pass per row: e4m3 rows and their fp32 scales from a weight of any float
dtype, written into the caller's buffers.

Why: the FP8 rollout copies (rollout/decode_weights.py) are quantized from the current weights at every rollout
call. In eager torch each element went through a fp32 copy, its abs, the divide, the clamp and the cast (about ten
times the bytes of reading the weight once and writing its e4m3), and a fused group's rows were then copied once
more into the stacked buffer: 0.14 s for Llama-3.1-8B's decoder linears on an H100, 0.14 ms per decoded token of a
64 x 1024 rollout (benchmarks/NOTES_rollout.md). Here a program reads its row twice (the amax, then the cast; the
second read mostly from L2) and writes each e4m3 once, straight into its slot of the stacked buffer.

The math is ops/fp8_linear.quantize_rows': scale = max(amax / 448, fp32's smallest normal), q = clamp(x / scale,
+-448) rounded to nearest even; both divisions IEEE (div_rn), so the bytes are the eager ones on the CPU. (torch's
CUDA eager divides a tensor by a Python scalar as a multiply by its reciprocal: one ulp off in about half the scales.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny
BLOCK_K = 2048  # elements of a row per load


@triton.jit
def _max_with_nan(a, b):
    # NaN wins, as in torch's amax and clamp (Triton's default max drops it: a NaN weight would quantize finite)
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_rows_kernel(X, Q, SCALE, COLUMN_SCALE, stride_x, stride_q, K, BLOCK_K: tl.constexpr,
                          HAS_COLUMN_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, K, BLOCK_K):
        x = _load_row_block(X, COLUMN_SCALE, row * stride_x, start, cols, K, HAS_COLUMN_SCALE)
        amax = _max_with_nan(amax, tl.abs(x))
    scale = _max_with_nan(tl.div_rn(tl.reduce(amax, 0, _max_with_nan), FP8_MAX), FP32_TINY)
    tl.store(SCALE + row, scale)
    for start in range(0, K, BLOCK_K):
        x = _load_row_block(X, COLUMN_SCALE, row * stride_x, start, cols, K, HAS_COLUMN_SCALE)
        q = tl.minimum(_max_with_nan(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(Q + row * stride_q + start + cols, q.to(tl.float8e4nv), mask=start + cols < K)


@triton.jit
def _load_row_block(X, COLUMN_SCALE, offset, start, cols, K, HAS_COLUMN_SCALE: tl.constexpr):
    """A block of a row in fp32, times each column's scale where given (one fp32 multiply, IEEE: torch's bits)."""
    ok = start + cols < K
    x = tl.load(X + offset + start + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_COLUMN_SCALE:
        x = x * tl.load(COLUMN_SCALE + start + cols, mask=ok, other=0.0)
    return x


def quantize_rows_fwd(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      column_scale: torch.Tensor | None = None) -> None:
    """x [R, K] (unit-stride rows; fp16, bf16 or fp32) -> q [R, K] e4m3 (unit-stride rows) and scale [R] fp32
    (unit-stride), in place; with column_scale [K] fp32 (unit-stride), the rows of x * column_scale."""
    R, K = x.shape
    if R:
        block_k = min(BLOCK_K, triton.next_power_of_2(K))
        _quantize_rows_kernel[(R,)](x, q, scale, scale if column_scale is None else column_scale, x.stride(0),
                                    q.stride(0), K, BLOCK_K=block_k, HAS_COLUMN_SCALE=column_scale is not None)
