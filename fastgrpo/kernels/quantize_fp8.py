"""quantize_fp8's rounding in one Triton kernel: e4m3 rows and their fp32 scales from a weight of any float
dtype, written into the caller's buffers.

Why: the FP8 rollout copies (rollout/decode_weights.py) are quantized from the current weights at every rollout
call. In eager torch each element went through a fp32 copy, its abs, the divide, the clamp and the cast (about ten
times the bytes of reading the weight once and writing its e4m3), and a fused group's rows were then copied once
more into the stacked buffer: 0.14 s for Llama-3.1-8B's decoder linears on an H100, 0.14 ms per decoded token of a
64 x 1024 rollout (benchmarks/NOTES_rollout.md). Here a program reads its rows once where a row fits its registers
(else twice: the amax, then the cast, the second read mostly from L2) and writes each e4m3 once, straight into its
slot of the stacked buffer. patch_model(fp8_base=True) quantizes activations and gradients with it too.

The math is ops/fp8_linear.quantize_rows': scale = max(amax / 448, fp32's smallest normal), q = clamp(x / scale,
+-448) rounded to nearest even; both divisions IEEE (div_rn), so the bytes are the eager ones on the CPU. (torch's
CUDA eager divides a tensor by a Python scalar as a multiply by its reciprocal: one ulp off in about half the scales.)
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny
# Tiles (benchmarks/NOTES.md, forty-fifth session): rows of up to ONE_PASS_UP_TO elements (padded to a power of two)
# one a program, read once; longer ones in two passes of TWO_PASS_BLOCK_K. The sweep's faster tiles for long rows
# (8 / 16 warps) made a LoRA update slower in place, so those keep the tiles the kernel had before.
ONE_PASS_UP_TO = 4096
TWO_PASS_BLOCK_K = 2048
WARPS = 4


@dataclasses.dataclass(frozen=True)
class QuantizeTiles:
    """A launch's tiles: block_r rows a program, block_k elements of a row per load; one_pass: the row is one block,
    read once and kept in registers (else a first pass for the amax and a second, mostly from L2, for the cast)."""
    block_r: int
    block_k: int
    one_pass: bool
    num_warps: int


def quantize_tiles(K: int) -> QuantizeTiles:
    """The tiles for rows of K elements."""
    block_k = triton.next_power_of_2(max(K, 1))
    if block_k <= ONE_PASS_UP_TO:
        return QuantizeTiles(1, block_k, True, WARPS)
    return QuantizeTiles(1, TWO_PASS_BLOCK_K, False, WARPS)


@triton.jit
def _max_with_nan(a, b):
    # NaN wins, as in torch's amax and clamp (Triton's default max drops it: a NaN weight would quantize finite)
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_rows_kernel(X, Q, SCALE, COLUMN_SCALE, R, stride_x, stride_q, K, BLOCK_R: tl.constexpr,
                          BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, HAS_COLUMN_SCALE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    cols = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        x = _load_block(X, COLUMN_SCALE, rows, live, stride_x, 0, cols, K, HAS_COLUMN_SCALE)
        scale = _row_scales(tl.abs(x))
        tl.store(SCALE + rows, scale, mask=live)
        _store_block(Q, x, scale, rows, live, stride_q, 0, cols, K)
    else:
        amax = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        for start in range(0, K, BLOCK_K):
            x = _load_block(X, COLUMN_SCALE, rows, live, stride_x, start, cols, K, HAS_COLUMN_SCALE)
            amax = _max_with_nan(amax, tl.abs(x))
        scale = _row_scales(amax)
        tl.store(SCALE + rows, scale, mask=live)
        for start in range(0, K, BLOCK_K):
            x = _load_block(X, COLUMN_SCALE, rows, live, stride_x, start, cols, K, HAS_COLUMN_SCALE)
            _store_block(Q, x, scale, rows, live, stride_q, start, cols, K)


@triton.jit
def _row_scales(amax):
    """[BLOCK_R, BLOCK_K] |x| (or running maxima) -> [BLOCK_R] scales: amax / 448, at least fp32's smallest normal."""
    return _max_with_nan(tl.div_rn(tl.reduce(amax, 1, _max_with_nan), FP8_MAX), FP32_TINY)


@triton.jit
def _load_block(X, COLUMN_SCALE, rows, live, stride_x, start, cols, K, HAS_COLUMN_SCALE: tl.constexpr):
    """A [BLOCK_R, BLOCK_K] block of rows in fp32 (0 outside), times each column's scale where given (one fp32
    multiply, IEEE: torch's bits)."""
    ok = start + cols < K
    x = tl.load(X + rows[:, None] * stride_x + (start + cols)[None, :], mask=live[:, None] & ok[None, :],
                other=0.0).to(tl.float32)
    if HAS_COLUMN_SCALE:
        x = x * tl.load(COLUMN_SCALE + start + cols, mask=ok, other=0.0)[None, :]
    return x


@triton.jit
def _store_block(Q, x, scale, rows, live, stride_q, start, cols, K):
    q = tl.minimum(_max_with_nan(tl.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(Q + rows[:, None] * stride_q + (start + cols)[None, :], q.to(tl.float8e4nv),
             mask=live[:, None] & (start + cols < K)[None, :])


def quantize_rows_fwd(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      column_scale: torch.Tensor | None = None, tiles: QuantizeTiles | None = None) -> None:
    """x [R, K] (unit-stride rows; fp16, bf16 or fp32) -> q [R, K] e4m3 (unit-stride rows) and scale [R] fp32
    (unit-stride), in place; with column_scale [K] fp32 (unit-stride), the rows of x * column_scale; tiles:
    quantize_tiles(K)'s unless given (benchmarks)."""
    R, K = x.shape
    if R:
        t = quantize_tiles(K) if tiles is None else tiles
        _quantize_rows_kernel[(triton.cdiv(R, t.block_r),)](
            x, q, scale, scale if column_scale is None else column_scale, R, x.stride(0), q.stride(0), K,
            BLOCK_R=t.block_r, BLOCK_K=t.block_k, ONE_PASS=t.one_pass, HAS_COLUMN_SCALE=column_scale is not None,
            num_warps=t.num_warps)
