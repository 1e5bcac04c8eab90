"""Decode attention for one query token per row: the Triton flash-decoding kernel, or plain torch on the CPU.

`decode_attention(q, k, v, visible, length, scale)` attends the G query rows of each K/V head (q [N, Hkv, G, D],
rollout/attention.py's layout) over the cache slots < length (a device tensor [1]: no host sync, so a CUDA graph
can replay the call) that `visible` marks. With `prefix_k/prefix_v/prefix_visible` the S = N // B rows of each group
share one prompt's K/V and the cache holds only their suffixes. No autograd: the rollout runs under no_grad.
`decode_attention_torch` is the eager masked softmax (any dtype; the tests run it in fp64).
"""
from __future__ import annotations

import math

import torch

from fastgrpo._checks import check_dtype, check_shape
from fastgrpo.ops._backend import use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def decode_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, length: torch.Tensor,
    scale: float | None = None, prefix_k: torch.Tensor | None = None, prefix_v: torch.Tensor | None = None,
    prefix_visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T scale, masked) v in q's dtype (fp32 math for half types); a row with no visible key gives 0.

    Masked slots are replaced, not multiplied, so whatever they hold (NaN included) never reaches the output."""
    N, H, G, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    work = torch.promote_types(q.dtype, torch.float32)
    keep = visible & (torch.arange(k.shape[2], device=k.device) < length.reshape(()))  # keep: [N, M]
    if prefix_k is not None:
        S = N // prefix_k.shape[0]
        k = torch.cat([prefix_k.repeat_interleave(S, dim=0), k], dim=2)
        v = torch.cat([prefix_v.repeat_interleave(S, dim=0), v], dim=2)
        keep = torch.cat([prefix_visible.repeat_interleave(S, dim=0), keep], dim=1)
    keep = keep[:, None, None, :]  # [N, 1, 1, M']
    k = torch.where(keep[:, :, 0, :, None], k.to(work), 0.0)
    v = torch.where(keep[:, :, 0, :, None], v.to(work), 0.0)
    scores = torch.where(keep, q.to(work) @ k.transpose(-1, -2) * scale, float("-inf"))  # [N, H, G, M']
    top = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(work).min)
    p = torch.exp(scores - top)
    total = p.sum(-1, keepdim=True)
    out = (p @ v) / torch.where(total > 0, total, 1.0)
    return out.to(q.dtype)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, length: torch.Tensor,
    scale: float | None = None, prefix_k: torch.Tensor | None = None, prefix_v: torch.Tensor | None = None,
    prefix_visible: torch.Tensor | None = None, splits: int | None = None,
) -> torch.Tensor:
    """q [N, Hkv, G, D], k/v [N, Hkv, M, D], visible [N, M] bool, length [1] int -> [N, Hkv, G, D] in q's dtype.

    Reads cache slots < length only. Optional shared prefix: prefix_k/prefix_v [N // S, Hkv, P, D] and
    prefix_visible [N // S, P] for rows n*S..n*S+S-1; keys are the prefix's then the row's own cache slots.
    scale defaults to D^-0.5; splits (Triton only) overrides the number of key-range splits per (group, head).
    """
    N, H, G, D = q.shape
    M = k.shape[2]
    check_dtype("q", q, _FLOATS)
    check_shape("k", k, (N, H, M, D))
    check_shape("v", v, (N, H, M, D))
    check_shape("visible", visible, (N, M))
    check_shape("length", length, (1,))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"decode_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if prefix_k is not None:
        B, P = prefix_k.shape[0], prefix_k.shape[2]
        if B == 0 or N % B:
            raise ValueError(f"decode_attention: {N} rows do not split into groups of prefix_k's {B} prompts")
        check_shape("prefix_k", prefix_k, (B, H, P, D))
        check_shape("prefix_v", prefix_v, (B, H, P, D))
        check_shape("prefix_visible", prefix_visible, (B, P))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not use_triton(q, k, v, visible, length):
        return decode_attention_torch(q, k, v, visible, length, scale, prefix_k, prefix_v, prefix_visible)
    from fastgrpo.kernels.decode_attention import decode_attention_fwd

    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if visible.stride(-1) != 1:
        visible = visible.contiguous()
    if prefix_k is not None:
        prefix_k, prefix_v, prefix_visible = (
            t if t.stride(-1) == 1 else t.contiguous() for t in (prefix_k, prefix_v, prefix_visible)
        )
    return decode_attention_fwd(q, k, v, visible, length, scale, prefix_k, prefix_v, prefix_visible, splits)
