"""Rotary embedding (HF rotate-half convention) applied to q and k in one Triton launch, and its backward.

out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1). The backward is the transpose rotation:
dx1 = g1 * cos1 + g2 * sin2, dx2 = g2 * cos2 - g1 * sin1. One program per (batch, position) handles every head.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_heads(
    IN, OUT, b, t, stride_b, stride_h, stride_t, stride_ob, stride_oh, stride_ot, n_heads,
    cos1, cos2, sin1, sin2, half, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < half)
    src = IN + b * stride_b + t * stride_t + heads * stride_h + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    dst = OUT + b * stride_ob + t * stride_ot + heads * stride_oh + dims
    tl.store(dst, y1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(dst + half, y2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_qob, stride_qoh, stride_qot, stride_kob, stride_koh, stride_kot,
    stride_cb, stride_ct, stride_sb, stride_st,
    seq_len, n_q_heads, n_k_heads, half,
    BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    t = pid % seq_len
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < half
    cos_row = COS + b * stride_cb + t * stride_ct + dims
    sin_row = SIN + b * stride_sb + t * stride_st + dims
    cos1 = tl.load(cos_row, mask=dmask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + half, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + half, mask=dmask, other=0.0).to(tl.float32)[None, :]
    _rope_heads(Q, QO, b, t, stride_qb, stride_qh, stride_qt, stride_qob, stride_qoh, stride_qot, n_q_heads,
                cos1, cos2, sin1, sin2, half, BLOCK_Q_HEADS, BLOCK_HALF, BACKWARD)
    _rope_heads(K, KO, b, t, stride_kb, stride_kh, stride_kt, stride_kob, stride_koh, stride_kot, n_k_heads,
                cos1, cos2, sin1, sin2, half, BLOCK_K_HEADS, BLOCK_HALF, BACKWARD)


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
    cos_b = cos.stride(0) if cos.shape[0] > 1 else 0
    sin_b = sin.stride(0) if sin.shape[0] > 1 else 0
    _rope_kernel[(B * T,)](
        q, k, q_out, k_out, cos, sin,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos_b, cos.stride(1), sin_b, sin.stride(1),
        T, n_q, n_k, D // 2,
        BLOCK_Q_HEADS=triton.next_power_of_2(n_q), BLOCK_K_HEADS=triton.next_power_of_2(n_k),
        BLOCK_HALF=triton.next_power_of_2(D // 2), BACKWARD=backward,
    )
    return q_out, k_out
