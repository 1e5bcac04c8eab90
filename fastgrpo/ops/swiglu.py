"""Gated MLP activations (SwiGLU, GeGLU) as an autograd Function over the Triton kernels, with a torch path.

Saves only gate and up for the backward (eager PyTorch also keeps act(gate)): one [N, I] tensor less per MLP.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastgrpo._checks import check_choice, check_same_shape
from fastgrpo.ops._backend import use_triton

ACTIVATIONS = ("silu", "gelu_tanh")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., I] -> [N, I] with a unit column stride (a view when possible, e.g. a chunk of a fused gate_up)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):
        from fastgrpo.kernels.swiglu import glu_fwd

        a, b = _rows(gate), _rows(up)  # a, b: [N, I]
        ctx.save_for_backward(a, b)
        ctx.shape, ctx.activation = gate.shape, activation
        return glu_fwd(a, b, activation).view(gate.shape)

    @staticmethod
    def backward(ctx, dc):
        from fastgrpo.kernels.swiglu import glu_bwd

        a, b = ctx.saved_tensors
        da, db = glu_bwd(_rows(dc), a, b, ctx.activation)
        return da.view(ctx.shape), db.view(ctx.shape), None


def glu_torch(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for act in ("silu", "gelu_tanh"); gate and up [..., I] of one dtype."""
    check_choice("activation", activation, ACTIVATIONS)
    check_same_shape("up", up, "gate", gate)
    # fp64 stays in torch: the kernels compute in fp32.
    if gate.dtype != up.dtype or gate.dtype == torch.float64 or not use_triton(gate, up):
        return glu_torch(gate, up, activation)
    return GLUFunction.apply(gate, up, activation)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (Llama, Mistral, Qwen, Phi-3 MLPs)."""
    return glu(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma MLPs)."""
    return glu(gate, up, "gelu_tanh")
