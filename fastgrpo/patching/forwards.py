"""The forwards patch_model binds on module instances. Each one calls the module's own submodules and parameters,
so LoRA layers, 4-bit linears and tied weights keep working, and only the fused op replaces eager math.
"""
from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

from fastgrpo.hf.architectures import LORA_CLASSES, LoRAClass
from fastgrpo.hf.binding import copy_function
from fastgrpo.ops.fp8_base import drop_fp8_weight, fp8_weight_of
from fastgrpo.ops.glu_down import glu_down
from fastgrpo.ops.lora import lora_add, lora_delta, lora_linear_of_checked_values
from fastgrpo.ops.rms_norm import rms_norm
from fastgrpo.ops.rope import apply_rotary
from fastgrpo.ops.tiled_mlp import tiled_mlp

ROPE_GLOBAL = "apply_rotary_pos_emb"


def rms_norm_forward(eps_attr: str, offset: float, cast_before_weight: bool) -> Callable:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, getattr(self, eps_attr), offset, cast_before_weight)

    return forward


def mlp_forward(activation: str, fused_gate_up: bool) -> Callable:
    if fused_gate_up:
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)  # gate, up: [B, T, I] views
            return glu_down(self.down_proj, gate, up, activation)
    else:
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return glu_down(self.down_proj, self.gate_proj(x), self.up_proj(x), activation)

    return forward


def tiled_mlp_forward(previous: Callable, chunk_tokens: int) -> Callable:
    """`previous` (the MLP's forward, fused or not) over chunks of tokens; see fastgrpo.ops.tiled_mlp."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_mlp(self, x, chunk_tokens=chunk_tokens, forward=previous)

    return forward


def lora_linear_forward(
    previous: Callable, lora_class: LoRAClass = LORA_CLASSES[0], lora_dtype: str = "input", fp8_base: bool = False
) -> Callable:
    """PEFT's LoRA forward of `lora_class` with fastgrpo.ops.lora's branch where PEFT would run its vanilla branch
    alone; `previous` (PEFT's own forward) for everything else. lora_dtype "input": in x's dtype (autocast's math),
    lora_linear where the base is a frozen nn.Linear it can stand in for, else base_layer(x) then lora_add; "adapter":
    lora_delta in the adapter's dtype (bitwise PEFT). fp8_base (with "input"): lora_linear's base GEMMs in FP8
    (fastgrpo.ops.fp8_base), with the adapters disabled too (a reference model's forward)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if fp8_base and self.merged:
            # PEFT merges and unmerges through weight.data, which moves no version counter fp8_weight_of could see:
            # the copy of the unmerged weight goes now, and the one made after unmerging is of the weight PEFT left.
            drop_fp8_weight(self.base_layer)
        adapters = _vanilla_adapters(self, x, args, kwargs, one_dtype=lora_dtype == "adapter")
        if adapters is None and fp8_base and _base_alone(self, args, kwargs) and _frozen_plain_linear(
                self.base_layer, x):
            adapters = []  # PEFT would run base_layer(x) alone: the FP8 product stands in for it
        if adapters is None:
            return previous(x, *args, **kwargs)
        base = self.base_layer
        if lora_dtype == "input" and _frozen_plain_linear(base, x):
            # One op for the base and the adapters: the layer's input gradient is written once (lora_linear).
            # _frozen_plain_linear and _vanilla_adapters checked what lora_linear would: a PEFT layer's own weights
            return lora_linear_of_checked_values(x, base.weight, base.bias,
                                                 [(a.weight, b.weight, s) for a, b, s in adapters],
                                                 fp8_weight_of(base) if fp8_base else None)
        result = base(x)
        if lora_dtype == "input":
            # The base output is added into (saving a copy of [N, out]) when it is ours alone: not a view (autograd
            # refuses in-place ops on a custom Function's view output, as bitsandbytes' are; nn.Linear's 3-D output
            # with a bias is a view too) and not seen by a forward hook that may keep it. Else the first add copies.
            own = result._base is None and not (base._forward_hooks or nn.modules.module._global_forward_hooks)
            for i, (lora_a, lora_b, scaling) in enumerate(adapters):
                result = lora_add(result, x, lora_a.weight, lora_b.weight, scaling, inplace=own or i > 0)
            if lora_class.clone_base and not adapters:
                result = result.clone()
            # Each delta is added in result's dtype whatever delta_in_result_dtype says: it is x's dtype here.
            return result
        if lora_class.clone_base:
            result = result.clone()
        result_dtype = result.dtype
        for lora_a, lora_b, scaling in adapters:
            delta = lora_delta(x, lora_a.weight, lora_b.weight, scaling)
            result = result + (delta.to(result_dtype) if lora_class.delta_in_result_dtype else delta)
        return result.to(result_dtype)

    return forward


def _frozen_plain_linear(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether lora_linear can stand in for layer(x), bits and all: layer is an nn.Linear itself (not a bitsandbytes
    or other subclass) whose call runs nothing but its forward (no hooks of its own or global ones: torch's own test
    for its call's fast path), weight and bias of x's dtype and not trained (lora_linear computes no gradient for
    them), x contiguous with 2 or more dims (where F.linear adds the bias in the GEMM, as lora_linear does)."""
    if type(layer) is not nn.Linear or x.dim() < 2 or not x.is_contiguous():
        return False
    module = nn.modules.module
    hooks = (layer._forward_hooks, layer._forward_pre_hooks, layer._backward_hooks, layer._backward_pre_hooks,
             module._global_forward_hooks, module._global_forward_pre_hooks, module._global_backward_hooks,
             module._global_backward_pre_hooks)
    if any(hooks) or "forward" in layer.__dict__:
        return False
    params = [p for p in (layer.weight, layer.bias) if p is not None]
    return not any(p.requires_grad or p.dtype != x.dtype for p in params)


def _base_alone(layer: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether PEFT's LoRA forward would return base_layer(x) and nothing else: adapters disabled (not merged),
    no arguments for the base layer."""
    return layer.disable_adapters and not layer.merged and not args and not kwargs


def _vanilla_adapters(
    layer: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict, *, one_dtype: bool
) -> list[tuple] | None:
    """(lora_A, lora_B, scaling) of each active adapter when the forward of PEFT's LORA_CLASSES (0.21) would add
    lora_B(lora_A(x.to(A.dtype))) * scaling for each to base_layer(x) and do nothing else; None when it would not.
    one_dtype: also None when the adapters' dtypes differ (for lora_delta, which casts x once)."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None  # arguments for the base layer or adapter_names (a mixed batch); base alone; merged weights
    if not getattr(layer, "cast_input_dtype_enabled", True):
        return None  # x not cast
    # lora_A / lora_B run in the autocast dtype; PEFT's bitsandbytes layers test CUDA's autocast, whatever x's device.
    if torch.is_autocast_enabled(x.device.type) or torch.is_autocast_enabled("cuda"):
        return None
    adapters, dtypes = [], set()
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        lora_a, lora_b, dropout = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
        if name in layer.lora_variant or not (_plain_linear(lora_a) and _plain_linear(lora_b)):
            return None  # DoRA and other variants; lora_bias; hooked or replaced adapter linears
        if not (type(dropout) is nn.Identity or (type(dropout) is nn.Dropout and not dropout.training)):
            return None  # a dropout mask would have to be kept for the backward
        adapters.append((lora_a, lora_b, layer.scaling[name]))
        dtypes |= {lora_a.weight.dtype, lora_b.weight.dtype}
    # PEFT casts x to each adapter's dtype in turn (fp32 -> bf16 -> fp32 would round); lora_delta casts once.
    return adapters if len(dtypes) <= 1 or not one_dtype else None


def _plain_linear(module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and module.bias is None
        and not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)
    )


def _cell_holds(cell: types.CellType, obj: object) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def with_globals(fn: types.FunctionType, overrides: dict[str, object]) -> types.FunctionType | None:
    """A copy of `fn` in which the global names in `overrides` resolve to the given objects.

    Used for RoPE: the attention forward of every supported architecture calls the module-level
    `apply_rotary_pos_emb`, so the same compiled code, run against a copy of its module's globals with that one
    name replaced, is the library's attention with the fused rotary, whatever the installed transformers version
    (5.17 and 5.24 differ in the cache argument's name). Decorator layers (functools.wraps chains) are copied
    with it. Returns None when `fn` does not look the name up, or a wrapper does not hold its inner function.
    """
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        if not set(overrides) <= set(fn.__code__.co_names):
            return None
        return copy_function(fn, {**fn.__globals__, **overrides}, fn.__closure__)
    new_inner = with_globals(inner, overrides)
    cells = fn.__closure__ or ()
    if new_inner is None or not any(_cell_holds(c, inner) for c in cells):
        return None
    closure = tuple(types.CellType(new_inner) if _cell_holds(c, inner) else c for c in cells)
    copy = copy_function(fn, fn.__globals__, closure)
    copy.__wrapped__ = new_inner
    return copy


def rope_attention_forward(attention_class: type) -> Callable | None:
    """The class's forward with the fused rotary embedding, or None if it can't be had (see with_globals)."""
    forward = attention_class.forward
    if not isinstance(forward, types.FunctionType):
        return None
    return with_globals(forward, {ROPE_GLOBAL: apply_rotary})
