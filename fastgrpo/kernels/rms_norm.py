"""RMSNorm in Triton: y = x * rstd * (offset + w) over rows of H, and its backward.

CAST_BEFORE_WEIGHT=True is Llama's rounding (x * rstd rounded to x's dtype, then times w); False is Gemma's
(everything in fp32, one rounding at the end). Both accumulate in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD,
    stride_x, stride_y,
    n_cols, eps, offset,
    BLOCK_H: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    x_hat = x * rstd
    if CAST_BEFORE_WEIGHT:
        x_hat = x_hat.to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x_hat * (offset + w)).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    stride_dy, stride_x, stride_dx,
    n_rows, n_cols, rows_per_program, offset,
    BLOCK_H: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
):
    # Each program walks `rows_per_program` rows and keeps its share of dw in fp32 registers.
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        x_hat = x * rstd
        if CAST_BEFORE_WEIGHT:
            dw += dy * x_hat.to(X.dtype.element_ty).to(tl.float32)
        else:
            dw += dy * x_hat
        dx_hat = dy * w
        # d/dx of x * rstd(x): rstd * (dx_hat - x_hat * mean(dx_hat * x_hat))
        dx = rstd * (dx_hat - x_hat * (tl.sum(dx_hat * x_hat, axis=0) / n_cols))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def _block(n_cols: int) -> int:
    return triton.next_power_of_2(n_cols)


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast_before_weight: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, H] (unit column stride), weight: [H] -> y [N, H] of out_dtype, rstd [N] fp32."""
    n_rows, n_cols = x.shape
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        _rms_norm_fwd_kernel[(n_rows,)](
            x, weight, y, rstd, x.stride(0), y.stride(0), n_cols, eps, offset,
            BLOCK_H=_block(n_cols), CAST_BEFORE_WEIGHT=cast_before_weight,
        )
    return y, rstd


def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x: [N, H] -> dx [N, H] (dtype of x), dw [H] fp32."""
    n_rows, n_cols = x.shape
    dx = torch.empty_like(x)
    # ~4 programs per SM keeps the fp32 dw partials small ([programs, H]) and the GPU busy.
    programs = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    programs = max(1, min(programs, n_rows))
    rows_per_program = triton.cdiv(n_rows, programs)
    dw_partial = torch.zeros((programs, n_cols), dtype=torch.float32, device=x.device)
    if n_rows:
        _rms_norm_bwd_kernel[(programs,)](
            dy, x, weight, rstd, dx, dw_partial, dy.stride(0), x.stride(0), dx.stride(0),
            n_rows, n_cols, rows_per_program, offset,
            BLOCK_H=_block(n_cols), CAST_BEFORE_WEIGHT=cast_before_weight,
        )
    return dx, dw_partial.sum(0)
