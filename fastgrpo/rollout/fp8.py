"""FP8 decode weights (EngineConfig.weights="fp8"): the decode steps of a rollout multiply an e4m3 copy of the
model's current weights.

Why: a decode step of 64 rows reads every weight once for ~128 FLOPs per byte, so its GEMMs cost what the weight
reads cost (benchmarks/NOTES_rollout.md); e4m3 weights (fastgrpo.ops.fp8_linear, W8A16) halve those reads.

When decoding starts, every dense linear of the model (hf.peft.dense_linears: nn.Linear, lm_head included, a
4-bit base dequantized, a LoRA layer with its adapters merged) gets a per-channel e4m3 copy of its weight as it is
now, and its forward becomes fp8_linear over that copy; when decoding ends the forwards come back and the copy is
freed. So a 4-bit base is dequantized once per rollout, not per token, and the trainer's parameters and their
grads are only read. The prefill keeps the model's own weights (its GEMMs have B x P rows and are not
bandwidth-bound). Memory for the call: 1 byte per weight plus 4 per output channel (fp8_bytes), about half the
bf16 weights; the build holds one layer's fp32 temporaries at a time.

The object installed as a module's forward is made once per module and kept (weakly) for the module's lifetime:
torch.compile guards on its identity, so the compiled decode step of one rollout serves the next; only its tensors
are new each rollout, and those are guarded by shape and dtype, not identity.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from fastgrpo.hf.peft import dense_linears, dense_weight
from fastgrpo.ops.fp8_linear import fp8_linear, prepare_fp8_linear, quantize_fp8

WEIGHTS = ("model", "fp8")


class _Fp8Forward:
    """A linear module's forward during decoding: fp8_linear over the e4m3 copy of its weight."""

    def __init__(self) -> None:
        self.q: torch.Tensor | None = None  # [N, K] float8_e4m3fn
        self.scale: torch.Tensor | None = None  # [N] fp32
        self.bias: torch.Tensor | None = None  # [N], the module's own

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return fp8_linear(x, self.q, self.scale, self.bias)


_FORWARDS: weakref.WeakKeyDictionary[torch.nn.Module, _Fp8Forward] = weakref.WeakKeyDictionary()


def decode_weights(model: torch.nn.Module, weights: str) -> contextlib.AbstractContextManager:
    """The context the engine decodes in: the model's own weights ("model") or an FP8 copy of them ("fp8")."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {list(WEIGHTS)}, got {weights!r}")
    return fp8_weights(model) if weights == "fp8" else contextlib.nullcontext()


@contextlib.contextmanager
def fp8_weights(model: torch.nn.Module) -> Iterator[list[torch.nn.Module]]:
    """Within the block, each of dense_linears(model) (yielded) computes x (q scale)^T + b from an e4m3 copy of its
    current weight; on exit every module's forward is what it was (patched ones included) and the copy is freed."""
    modules = dense_linears(model)
    installed = []
    try:
        with torch.no_grad():
            for module in modules:
                forward = _FORWARDS.setdefault(module, _Fp8Forward())
                weight, forward.bias = dense_weight(module)
                forward.q, forward.scale = quantize_fp8(weight)
                del weight  # a merged or dequantized weight is a temporary: one layer's at a time
                prepare_fp8_linear(forward.q.device)
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
                forward.q = forward.scale = forward.bias = None


def fp8_bytes(model: torch.nn.Module) -> int:
    """Bytes of the FP8 copy fp8_weights(model) builds: 1 per weight and 4 per output channel (biases are shared)."""
    total = 0
    for module in dense_linears(model):
        layer = getattr(module, "base_layer", module)
        total += layer.out_features * (layer.in_features + 4)
    return total
