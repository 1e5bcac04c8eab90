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

How the forward is swapped: the module's class becomes a subclass of it whose forward is the one GEMM (made once
per class), and the copy's tensors are attributes of the module; an instance-level forward (patch_model's) is
moved aside meanwhile. torch.compile then guards on the class and on the tensors' shapes and dtypes, both the same
for every layer and every rollout: a callable object installed per module would be guarded by identity, a new
trace per layer (for per-layer compiled code) and per rollout.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fastgrpo.hf.peft import dense_linears, dense_weight
from fastgrpo.ops.fp8_linear import fp8_linear, prepare_fp8_linear, quantize_fp8

WEIGHTS = ("auto", "model", "fp8", "dense")
# "auto" makes the dense copy only with this much device memory to spare after it (the decode step's temporaries)
AUTO_HEADROOM_BYTES = 1 << 30
# the copy's attributes on a module: e4m3 weight [N, K] and fp32 scale [N] ("fp8"), weight [N, K] ("dense"), bias [N]
_ATTRS = ("fastgrpo_copy_q", "fastgrpo_copy_scale", "fastgrpo_copy_weight", "fastgrpo_copy_bias")


def _copy_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A dense linear's forward during decoding: one GEMM over the copy of its weight."""
    if self.fastgrpo_copy_q is not None:
        return fp8_linear(x, self.fastgrpo_copy_q, self.fastgrpo_copy_scale, self.fastgrpo_copy_bias)
    return F.linear(x, self.fastgrpo_copy_weight, self.fastgrpo_copy_bias)


@functools.cache
def _copy_class(base: type) -> type:
    """`base` with the copy's forward: one subclass per class, shared by every module of that class (its name kept,
    for code that looks classes up by name)."""
    return type(base.__name__, (base,), {"forward": _copy_forward, "__module__": __name__})


def decode_weights(model: torch.nn.Module, weights: str) -> contextlib.AbstractContextManager:
    """The context the engine decodes in: the model's own weights ("model") or a copy of them ("fp8", "dense");
    "auto" is resolved_weights'."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {list(WEIGHTS)}, got {weights!r}")
    weights = resolved_weights(model, weights)
    return contextlib.nullcontext() if weights == "model" else copied_weights(model, weights)


def resolved_weights(model: torch.nn.Module, weights: str) -> str:
    """"auto": "dense" for a model on CUDA with LoRA or 4-bit layers whose copy fits the memory free now with
    AUTO_HEADROOM_BYTES to spare, else "model". (A LoRA rollout of Qwen2.5-1.5B shapes on an H100 took 3.97 s with
    the dense copy and the Triton attention, 7.42 s with neither, at 11.1 against 10.0 GiB peak; README. The copy
    alone was not measured.) Anything else is returned as it is."""
    if weights != "auto":
        return weights
    device = model.get_input_embeddings().weight.device
    if device.type != "cuda":
        return "model"
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # the allocator's cached blocks
    return "dense" if dense_copy_fits(copy_bytes(model, "dense"), free) else "model"


def dense_copy_fits(copy: int, free: int) -> bool:
    """Whether "auto" makes a dense copy of `copy` bytes with `free` bytes of device memory: only when there is
    one to make (a model without LoRA or 4-bit layers has none) and it leaves the headroom."""
    return 0 < copy and copy + AUTO_HEADROOM_BYTES <= free


@contextlib.contextmanager
def copied_weights(model: torch.nn.Module, kind: str = "fp8") -> Iterator[list[torch.nn.Module]]:
    """Within the block, each of dense_linears(model) (yielded) computes x W^T + b from a copy of its current weight
    W: e4m3 with a scale per output channel (kind "fp8") or in the model's dtype ("dense"); on exit every module is
    what it was (class, patched forward) and the copy is freed."""
    if kind not in ("fp8", "dense"):
        raise ValueError(f"kind: expected 'fp8' or 'dense', got {kind!r}")
    device = model.get_input_embeddings().weight.device
    if kind == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"weights: 'fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper) for e4m3; "
                         f"{torch.cuda.get_device_name(device)} is {torch.cuda.get_device_capability(device)}")
    dtype = model.get_input_embeddings().weight.dtype
    modules = dense_linears(model)
    swapped = []
    try:
        with torch.no_grad():
            for module in modules:
                weight, bias = dense_weight(module)  # a merged or dequantized weight: one layer's at a time
                if kind == "fp8":
                    q, scale = quantize_fp8(weight)
                    prepare_fp8_linear(q.device)
                    copy = (q, scale, None, bias)
                else:  # the layer's own dtype (a plain weight is used as it is: no copy); 4-bit: the compute dtype
                    layer = getattr(module, "base_layer", module)
                    own = layer.weight.dtype if layer.weight.is_floating_point() else dtype
                    copy = (None, None, weight.to(own), bias)
                del weight
                base, own = type(module), module.__dict__.pop("forward", None)
                module.__dict__.update(zip(_ATTRS, copy))
                module.__class__ = _copy_class(base)
                swapped.append((module, base, own))
        yield modules
    finally:
        for module, base, own in reversed(swapped):
            module.__class__ = base
            for name in _ATTRS:
                del module.__dict__[name]
            if own is not None:
                module.__dict__["forward"] = own


def copy_bytes(model: torch.nn.Module, kind: str = "fp8") -> int:
    """Bytes of the copy copied_weights(model, kind) builds: fp8, 1 per weight and 4 per output channel; dense, the
    model dtype's size per weight of the LoRA and 4-bit layers (the others decode with their own weight; biases are
    the modules' own)."""
    embedding = model.get_input_embeddings().weight
    total = 0
    for module in dense_linears(model):
        layer = getattr(module, "base_layer", module)
        n, k = layer.out_features, layer.in_features
        if kind == "fp8":
            total += n * (k + 4)
        elif module is not layer or not layer.weight.is_floating_point():
            total += n * k * embedding.element_size()
    return total
