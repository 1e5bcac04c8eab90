"""Rotary position embedding of q and k as an autograd Function over the Triton kernel, with a torch path.

`apply_rotary(q, k, cos, sin, unsqueeze_dim=1)` has the signature and result of Hugging Face's
`apply_rotary_pos_emb`, including partial rotary (cos narrower than the head dim: the rest passes through, Phi-3).
cos/sin are constants (they come from the rotary buffer); when they need a gradient the torch path runs.
"""
from __future__ import annotations

import torch

from fastgrpo._checks import check_shape
from fastgrpo.ops._backend import use_triton


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        from fastgrpo.kernels.rope import rope

        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return rope(_unit_last_stride(q), _unit_last_stride(k), cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        from fastgrpo.kernels.rope import rope

        cos, sin = ctx.saved_tensors
        dq, dk = _unit_last_stride(dq), _unit_last_stride(dk)
        return (*rope(dq, dk, cos, sin, backward=True), None, None)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_torch(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _fits_kernel(q, k, cos, sin) -> bool:
    return (
        use_triton(q, k, cos, sin)
        and not (cos.requires_grad or sin.requires_grad)
        and q.dtype == k.dtype
        and q.dtype != torch.float64  # the kernel computes in fp32
        and cos.dim() == 3
        and cos.shape[0] in (1, q.shape[0])
        and cos.shape[1] == q.shape[2]  # the kernel reads one cos row per position: no broadcast of [*, 1, R]
        and cos.shape == sin.shape
    )


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D], k [B, Hk, T, D] (unsqueeze_dim=2: [B, T, H, D]), cos/sin [B or 1, T, R], R <= D even."""
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim: expected 1 or 2, got {unsqueeze_dim}")
    if unsqueeze_dim == 2:
        q_out, k_out = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    check_shape("q", q, (None, None, None, None))
    B, _, T, D = q.shape
    check_shape("k", k, (B, None, T, D))
    rotary = cos.shape[-1]
    if rotary > D or rotary % 2:
        raise ValueError(f"cos: expected an even last dim <= head dim {D}, got {list(cos.shape)}")
    if rotary < D:
        q_rot, k_rot = apply_rotary(q[..., :rotary], k[..., :rotary], cos, sin)
        return torch.cat((q_rot, q[..., rotary:]), dim=-1), torch.cat((k_rot, k[..., rotary:]), dim=-1)
    if not _fits_kernel(q, k, cos, sin):
        return _apply_torch(q, k, cos, sin)
    return RopeFunction.apply(q, k, cos, sin)
