"""A decode step's RMSNorm + gate/up GEMM + gated activation as one op: h = act(norm(x) Wg^T) * (norm(x) Wu^T).

`fold_norm_weight(gate_w, up_w, norm_weight, offset)` -> w_gu [2N, K]: gate's rows then up's, each column times the
norm's weight (offset + w: 0 for Llama / Qwen / Mistral, 1 for Gemma's (1 + w); per-architecture data), rounded
once to the weights' dtype. `decode_glu(x, w_gu, eps, activation)` -> h [..., N]: the Triton kernel
(fastgrpo.kernels.decode_glu) on CUDA tensors or under TRITON_INTERPRET=1, else `decode_glu_torch`, the same math in
plain torch. With the norm weight folded into W, norm(x) W^T = r (x W'^T), r = rsqrt(mean x^2 + eps) per row: the
kernel needs only each row's sum of squares. Its rounding differs from Hugging Face's (which rounds the normalized x
to x's dtype, then its product with the norm weight): here the folded weight is rounded instead, and x is not.
Inference only (no autograd): the op serves the rollout's decode steps, under no_grad. A torch.library custom op, so
torch.compile keeps it as one opaque call (the kernel's split-K tickets are none of the compiler's business).
"""
from __future__ import annotations

import numbers

import torch

from fastgrpo._checks import check_choice, check_dtype, check_floating, check_same_shape, check_shape
from fastgrpo.ops._backend import use_triton
from fastgrpo.ops.swiglu import ACTIVATIONS, glu_torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.no_grad()
def fold_norm_weight(gate_w: torch.Tensor, up_w: torch.Tensor, norm_weight: torch.Tensor,
                     offset: float = 0.0) -> torch.Tensor:
    """gate_w, up_w [N, K] (one float dtype), norm_weight [K] -> w_gu [2N, K] in the weights' dtype:
    [gate_w; up_w] (offset + norm_weight), the product in fp32 (offset + norm_weight as Hugging Face's Gemma computes
    it, in fp32) rounded once (exact before that for 16-bit weights and norm weights)."""
    check_floating("gate_w", gate_w)
    check_shape("gate_w", gate_w, (None, None))
    check_same_shape("up_w", up_w, "gate_w", gate_w)
    check_dtype("up_w", up_w, (gate_w.dtype,))
    check_floating("norm_weight", norm_weight)
    check_shape("norm_weight", norm_weight, (gate_w.shape[1],))
    scale = offset + norm_weight.to(torch.promote_types(norm_weight.dtype, torch.float32))  # scale: [K]
    N = gate_w.shape[0]
    w_gu = gate_w.new_empty(2 * N, gate_w.shape[1])
    torch.mul(gate_w, scale, out=w_gu[:N])  # computed in scale's dtype, rounded into w_gu's
    torch.mul(up_w, scale, out=w_gu[N:])
    return w_gu


def decode_glu_torch(x: torch.Tensor, w_gu: torch.Tensor, eps: float, activation: str = "silu") -> torch.Tensor:
    """The kernel's math in plain torch, in fp32 (fp64 for fp64 x): x [..., K], w_gu [2N, K] -> [..., N] in x's
    dtype."""
    work = torch.promote_types(x.dtype, torch.float32)
    xw = x.to(work)
    r = torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)  # r: [..., 1]
    gate, up = ((xw @ w_gu.to(work).T) * r).chunk(2, dim=-1)
    return glu_torch(gate, up, activation).to(x.dtype)


@torch.library.custom_op("fastgrpo::decode_glu", mutates_args=())
def _decode_glu_op(x: torch.Tensor, w_gu: torch.Tensor, eps: float, activation: str) -> torch.Tensor:
    if not use_triton(x, w_gu):
        return decode_glu_torch(x, w_gu, eps, activation)
    from fastgrpo.kernels.decode_glu import decode_glu_fwd

    return decode_glu_fwd(x, w_gu, eps, activation)


@_decode_glu_op.register_fake
def _(x, w_gu, eps, activation):
    return x.new_empty(x.shape[0], w_gu.shape[0] // 2)


def decode_glu(x: torch.Tensor, w_gu: torch.Tensor, eps: float, activation: str = "silu") -> torch.Tensor:
    """x [..., K] (fp16, bf16 or fp32), w_gu [2N, K] of x's dtype (fold_norm_weight's), eps >= 0, activation "silu"
    (Llama, Qwen, Mistral) or "gelu_tanh" (Gemma) -> act(r x Wg'^T) * (r x Wu'^T) [..., N] in x's dtype."""
    check_dtype("x", x, _DTYPES)
    check_shape("w_gu", w_gu, (None, x.shape[-1]))
    check_dtype("w_gu", w_gu, (x.dtype,))
    if w_gu.shape[0] % 2:
        raise ValueError(f"w_gu: expected gate's rows then as many of up's (an even count), got {w_gu.shape[0]}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps: expected a number >= 0, got {eps!r}")
    check_choice("activation", activation, ACTIVATIONS)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w_gu if w_gu.stride(-1) == 1 else w_gu.contiguous()
    return _decode_glu_op(x2, w, float(eps), activation).reshape(*lead, w_gu.shape[0] // 2)
