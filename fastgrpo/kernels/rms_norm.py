"""RMSNorm in Triton: y = x * rstd * (offset + w) over rows of H, and its backward.

CAST_BEFORE_WEIGHT=True is Llama's rounding (x * rstd rounded to x's dtype, then times w); False is Gemma's
(everything in fp32, one rounding at the end). Both accumulate in fp32. Each program takes BLOCK_ROWS rows.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastgrpo.kernels.cards import sm_count


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD,
    stride_x, stride_y,
    n_rows, n_cols, eps, offset,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # rstd: [BLOCK_ROWS]
    x_hat = x * rstd[:, None]
    if CAST_BEFORE_WEIGHT:
        x_hat = x_hat.to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = x_hat * (offset + w)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    stride_dy, stride_x, stride_dx,
    n_rows, n_cols, blocks_per_program, offset,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
):
    # Each program walks `blocks_per_program` blocks of rows and keeps its share of dw in fp32 registers.
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for block in range(pid * blocks_per_program, (pid + 1) * blocks_per_program):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)[:, None]
        x_hat = x * rstd
        if CAST_BEFORE_WEIGHT:
            dw += tl.sum(dy * x_hat.to(X.dtype.element_ty).to(tl.float32), axis=0)
        else:
            dw += tl.sum(dy * x_hat, axis=0)
        dx_hat = dy * w[None, :]
        # d/dx of x * rstd(x): rstd * (dx_hat - x_hat * mean(dx_hat * x_hat))
        dx = rstd * (dx_hat - x_hat * (tl.sum(dx_hat * x_hat, axis=1) / n_cols)[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_mask)


def _blocks(n_cols: int) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_H): ~4K elements per program on a GPU; 64K under the interpreter, whose cost is per op."""
    block_h = triton.next_power_of_2(n_cols)
    budget = 1 << 16 if os.environ.get("TRITON_INTERPRET") == "1" else 1 << 12
    return max(1, budget // block_h), block_h


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast_before_weight: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, H] (unit column stride), weight: [H] -> y [N, H] of out_dtype, rstd [N] fp32."""
    n_rows, n_cols = x.shape
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_rows, block_h = _blocks(n_cols)
    if n_rows:
        _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_rows),)](
            x, weight, y, rstd, x.stride(0), y.stride(0), n_rows, n_cols, eps, offset,
            BLOCK_ROWS=block_rows, BLOCK_H=block_h, CAST_BEFORE_WEIGHT=cast_before_weight,
        )
    return y, rstd


def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x: [N, H] -> dx [N, H] (dtype of x), dw [H] fp32."""
    n_rows, n_cols = x.shape
    dx = torch.empty_like(x)
    block_rows, block_h = _blocks(n_cols)
    n_blocks = triton.cdiv(n_rows, block_rows)
    # ~4 programs per SM keeps the fp32 dw partials small ([programs, H]) and the GPU busy.
    programs = 4 * sm_count(x.device) if x.is_cuda else 1
    programs = max(1, min(programs, n_blocks))
    blocks_per_program = triton.cdiv(n_blocks, programs)
    dw_partial = torch.zeros((programs, n_cols), dtype=torch.float32, device=x.device)
    if n_rows:
        _rms_norm_bwd_kernel[(programs,)](
            dy, x, weight, rstd, dx, dw_partial, dy.stride(0), x.stride(0), dx.stride(0),
            n_rows, n_cols, blocks_per_program, offset,
            BLOCK_ROWS=block_rows, BLOCK_H=block_h, CAST_BEFORE_WEIGHT=cast_before_weight,
        )
    return dx, dw_partial.sum(0)
