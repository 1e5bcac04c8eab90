"""down(act(gate) * up), the end of a gated MLP, with the product not kept for the backward: recomputed there from
gate and up, which the GLU's own backward keeps anyway.

Why: the down projection saves its input, the product [N, I], for its weight gradient (a trained weight, or a LoRA
A), while the GLU saves gate and up: three [N, I] tensors per MLP where two carry all of it. At Llama-3.1-8B's
I = 14336 the product is 231 MiB per layer of a micro-batch of 8,448 tokens, about a fifth of what each layer that
keeps its activations holds (every layer without offload; those past patch_model's recompute_layers with it). The
backward runs the forward's kernel on the same gate and up again: the same bits, one elementwise pass per layer.

How: the down projection's forward runs under saved-tensor hooks whose pack swaps any saved tensor on the product's
storage for a recipe (gate, up, and the view's geometry), and whose unpack recomputes it. Only where that frees
memory and takes nothing from another hook: with grad, where gate or up requires grad (so the GLU keeps them), and
where no saved-tensor hooks are active already (torch calls only the innermost: a non-reentrant checkpoint's or
save_on_cpu's would not see the tensors ours took). Elsewhere it is down(glu(gate, up)).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from fastgrpo.ops.swiglu import glu


class _Recipe(NamedTuple):
    gate: torch.Tensor
    up: torch.Tensor
    activation: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def glu_down(down: nn.Module, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """down(glu(gate, up, activation)), the product recomputed in the backward where that frees memory."""
    product = glu(gate, up, activation)
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)) or _other_hooks_active():
        return down(product)
    # The hooks live as long as what they saved: they hold the product's address, not the product.
    storage, dtype = product.untyped_storage().data_ptr(), product.dtype

    def pack(t: torch.Tensor):
        # a plain tensor on the product's storage (the product or a view of it); parameters and subclasses pass
        if type(t) is not torch.Tensor or t.dtype != dtype or t.untyped_storage().data_ptr() != storage:
            return t
        return _Recipe(gate, up, activation, t.size(), t.stride(), t.storage_offset())

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        return down(product)


def _unpack(packed):
    if not isinstance(packed, _Recipe):
        return packed
    with torch.no_grad():
        product = glu(packed.gate, packed.up, packed.activation)
    return product.as_strided(packed.size, packed.stride, packed.offset)


def _other_hooks_active() -> bool:
    """Whether saved-tensor hooks are active (a torch without the query: assumed so, and the product is kept)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None
