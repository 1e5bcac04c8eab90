"""Rotary embedding (HF rotate-half convention) applied to q and k in one Triton launch, and its backward.

out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1). The backward is the transpose rotation:
dx1 = g1 * cos1 + g2 * sin2, dx2 = g2 * cos2 - g1 * sin1. A program handles BLOCK_T (sequence, position) rows,
every head of q and of k, so cos/sin are read once per position.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_qob, stride_qoh, stride_qot, stride_kob, stride_koh, stride_kot,
    stride_cb, stride_ct, stride_sb, stride_st,
    n_rows, seq_len, n_q_heads, n_k_heads, half,
    BLOCK_T: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
):
    row = (tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None, None]  # row: [BT, 1, 1]
    b = row // seq_len
    t = row % seq_len
    heads = tl.arange(0, BLOCK_HEADS)[None, :, None]
    dims = tl.arange(0, BLOCK_HALF)[None, None, :]
    cs_mask = (row < n_rows) & (dims < half)
    cos_row = COS + b * stride_cb + t * stride_ct + dims
    sin_row = SIN + b * stride_sb + t * stride_st + dims
    cos1 = tl.load(cos_row, mask=cs_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + half, mask=cs_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row, mask=cs_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + half, mask=cs_mask, other=0.0).to(tl.float32)
    if BACKWARD:
        sin1, sin2 = -sin2, -sin1  # the transpose rotation: same formula with -sin, halves swapped
    # q, then k: same rotation, own heads and strides.
    mask = cs_mask & (heads < n_q_heads)
    src = Q + b * stride_qb + t * stride_qt + heads * stride_qh + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = QO + b * stride_qob + t * stride_qot + heads * stride_qoh + dims
    tl.store(dst, (x1 * cos1 - x2 * sin1).to(QO.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos2 + x1 * sin2).to(QO.dtype.element_ty), mask=mask)
    mask = cs_mask & (heads < n_k_heads)
    src = K + b * stride_kb + t * stride_kt + heads * stride_kh + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = KO + b * stride_kob + t * stride_kot + heads * stride_koh + dims
    tl.store(dst, (x1 * cos1 - x2 * sin1).to(KO.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos2 + x1 * sin2).to(KO.dtype.element_ty), mask=mask)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, T, D], k: [B, Hk, T, D] (unit stride on D, any other strides), cos/sin: [B or 1, T, D].

    Returns new tensors laid out like q and k. backward=True applies the transpose rotation (for gradients).
    """
    B, n_q, T, D = q.shape
    n_k = k.shape[1]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0:
        return q_out, k_out
    block_heads, block_half = triton.next_power_of_2(max(n_q, n_k)), triton.next_power_of_2(D // 2)
    # One position per program on a GPU (32 heads x 64 = 2K elements); many under the interpreter (cost per op).
    budget = 1 << 16 if os.environ.get("TRITON_INTERPRET") == "1" else 1
    block_t = min(triton.next_power_of_2(B * T), max(1, budget // (block_heads * block_half)))
    cos_b = cos.stride(0) if cos.shape[0] > 1 else 0
    sin_b = sin.stride(0) if sin.shape[0] > 1 else 0
    # (sequence, position) rows on grid axis 0 (2^31 limit).
    _rope_kernel[(triton.cdiv(B * T, block_t),)](
        q, k, q_out, k_out, cos, sin,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos_b, cos.stride(1), sin_b, sin.stride(1),
        B * T, T, n_q, n_k, D // 2,
        BLOCK_T=block_t, BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, BACKWARD=backward,
    )
    return q_out, k_out
