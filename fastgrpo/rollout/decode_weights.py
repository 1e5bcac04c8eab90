"""The weights the decode steps multiply (EngineConfig.weights): the model's own, or a copy of them made for the
decode of one rollout, "fp8" (e4m3) or "dense" (the model's dtype).

Why: a decode step of 64 rows reads every weight once for ~128 FLOPs per byte, so its GEMMs cost what the weight
reads cost (benchmarks/NOTES_rollout.md). "fp8": per-channel e4m3 copies (fastgrpo.ops.fp8_linear, W8A16) halve
those reads. "dense": a plain copy in the model's dtype, for models whose own linears do more than one GEMM per
step: a bitsandbytes 4-bit base (dequantized per call) then decodes with the GEMMs of a bf16 base of its shape,
and a LoRA layer with one GEMM instead of three.

When decoding starts, every dense linear of the model (hf.peft.dense_linears: nn.Linear, lm_head included, a
4-bit base dequantized, a LoRA layer with its adapters merged in fp32) gets a copy of its weight as it is now, and
its forward becomes one GEMM over that copy; when decoding ends the forwards come back and the copy is freed. So a
4-bit base is dequantized once per rollout, not per token, and the trainer's parameters and their grads are only
read. The prefill keeps the model's own weights (its GEMMs have B x P rows: not bandwidth-bound). Memory for the
call (copy_bytes): fp8, 1 byte per weight plus 4 per output channel, about half the bf16 weights; dense, the
element size per weight that had to be made (a plain weight of the model's dtype is not copied). The build holds
one layer's fp32 temporaries at a time.

The object installed as a module's forward is made once per module and kept (weakly) for the module's lifetime:
torch.compile guards on its identity, so the compiled decode step of one rollout serves the next; only its tensors
are new each rollout, and those are guarded by shape and dtype, not identity.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fastgrpo.hf.peft import dense_linears, dense_weight
from fastgrpo.ops.fp8_linear import fp8_linear, prepare_fp8_linear, quantize_fp8

WEIGHTS = ("model", "fp8", "dense")


class _CopyForward:
    """A linear module's forward during decoding: one GEMM over the copy of its weight (fp8 if q is set)."""

    def __init__(self) -> None:
        self.q: torch.Tensor | None = None  # [N, K] float8_e4m3fn
        self.scale: torch.Tensor | None = None  # [N] fp32
        self.weight: torch.Tensor | None = None  # [N, K] in the model's dtype ("dense")
        self.bias: torch.Tensor | None = None  # [N], the module's own

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.q is not None:
            return fp8_linear(x, self.q, self.scale, self.bias)
        return F.linear(x, self.weight, self.bias)

    def clear(self) -> None:
        self.q = self.scale = self.weight = self.bias = None


_FORWARDS: weakref.WeakKeyDictionary[torch.nn.Module, _CopyForward] = weakref.WeakKeyDictionary()


def decode_weights(model: torch.nn.Module, weights: str) -> contextlib.AbstractContextManager:
    """The context the engine decodes in: the model's own weights ("model") or a copy of them ("fp8", "dense")."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {list(WEIGHTS)}, got {weights!r}")
    return contextlib.nullcontext() if weights == "model" else copied_weights(model, weights)


@contextlib.contextmanager
def copied_weights(model: torch.nn.Module, kind: str = "fp8") -> Iterator[list[torch.nn.Module]]:
    """Within the block, each of dense_linears(model) (yielded) computes x W^T + b from a copy of its current weight
    W: e4m3 with a scale per output channel (kind "fp8") or in the model's dtype ("dense"); on exit every module's
    forward is what it was (patched ones included) and the copy is freed."""
    dtype = model.get_input_embeddings().weight.dtype
    modules = dense_linears(model)
    installed = []
    try:
        with torch.no_grad():
            for module in modules:
                forward = _FORWARDS.setdefault(module, _CopyForward())
                weight, forward.bias = dense_weight(module)
                if kind == "fp8":
                    forward.q, forward.scale = quantize_fp8(weight)
                    prepare_fp8_linear(forward.q.device)
                else:  # a plain weight of the model's dtype is used as it is (no copy)
                    forward.weight = weight.to(dtype)
                del weight  # a merged or dequantized weight is a temporary: one layer's at a time
                # accelerate's hooked modules call _old_forward (as hf.binding.bind_forward does)
                attr = "_old_forward" if hasattr(module, "_hf_hook") else "forward"
                installed.append((module, attr, module.__dict__.get(attr)))
                module.__dict__[attr] = forward
        yield modules
    finally:
        for module, attr, own in reversed(installed):
            if own is None:
                del module.__dict__[attr]
            else:
                module.__dict__[attr] = own
        for module in modules:  # the copy goes (also what a failed build had made)
            forward = _FORWARDS.get(module)
            if forward is not None:
                forward.clear()


def copy_bytes(model: torch.nn.Module, kind: str = "fp8") -> int:
    """Bytes of the copy copied_weights(model, kind) builds: fp8, 1 per weight and 4 per output channel; dense, the
    model dtype's size per weight of the layers whose weight is not already a plain one of that dtype (LoRA-merged,
    4-bit; biases are the modules' own)."""
    embedding = model.get_input_embeddings().weight
    total = 0
    for module in dense_linears(model):
        layer = getattr(module, "base_layer", module)
        n, k = layer.out_features, layer.in_features
        if kind == "fp8":
            total += n * (k + 4)
        elif module is not layer or layer.weight.dtype != embedding.dtype:
            total += n * k * embedding.element_size()
    return total
