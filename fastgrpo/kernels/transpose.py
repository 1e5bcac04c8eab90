"""The transpose of a 2-D tensor of 1-byte elements, tile by tile: the column-major e4m3 operand that _scaled_mm
takes for a frozen base's input gradient (fastgrpo.ops.fp8_base.fp8_input_grad).

Why: torch's strided copy of a 1-byte tensor moved Llama-3.1-8B's 58 MB gate_proj copy in 0.34 ms on an H200, a third
of the FP8 GEMM it feeds (benchmarks/NOTES.md). Here each program loads a [BLOCK, BLOCK] tile along the source's rows
and stores its transpose along the destination's rows, both with unit-stride accesses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64


@triton.jit
def _transpose_kernel(SRC, DST, R, C, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tile = tl.load(SRC + rows[:, None].to(tl.int64) * C + cols[None, :],
                   mask=(rows[:, None] < R) & (cols[None, :] < C))
    tl.store(DST + cols[:, None].to(tl.int64) * R + rows[None, :], tl.trans(tile),
             mask=(cols[:, None] < C) & (rows[None, :] < R))


def transpose_bytes(src: torch.Tensor) -> torch.Tensor:
    """src [R, C] of 1-byte elements, contiguous -> its transpose [C, R], contiguous, of src's dtype."""
    R, C = src.shape
    dst = torch.empty(C, R, dtype=torch.uint8, device=src.device)
    if R and C:
        _transpose_kernel[(triton.cdiv(R, BLOCK), triton.cdiv(C, BLOCK))](src.view(torch.uint8), dst, R, C,
                                                                          BLOCK=BLOCK)
    return dst.view(src.dtype)
