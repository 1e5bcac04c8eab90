"""The rotary modules HF updates by position, and their forward without that update.

HF decorates rotary forwards with modeling_rope_utils.dynamic_rope_update, which for rope types "dynamic" and
"longrope" updates the module's frequencies from the longest position it is given before computing cos/sin (other
types: no update). Other decorators may sit above it in the chain: transformers 5.17 stacks torch.no_grad() on top,
5.24 does not. The forward without the update is the chain with that one link taken out, the links above it
rebuilt around the function it wraps (functools.wraps' __wrapped__). Where the installed transformers has no such
decorator, or a link cannot be rebuilt, nothing is found.
"""
from __future__ import annotations

import functools
import types
from collections.abc import Callable

from torch import nn

from fastgrpo.hf.binding import copy_function


def position_updated_rotaries(model: nn.Module) -> list[tuple[nn.Module, Callable]]:
    """(module, its class's forward without the update) for each rotary module of `model` that HF updates by
    position (module docstring)."""
    found = []
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)  # gemma3's: one per layer type
        rope_types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        # the types the update acts on, tested as its wrapper tests them
        if not any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in rope_types):
            continue
        without = _without_update(type(module).forward)
        if without is not None:
            found.append((module, without))
    return found


@functools.cache  # one function per class: torch.compile's guards see the same one at every rollout
def _without_update(forward: Callable) -> Callable | None:
    """`forward` with its dynamic_rope_update link taken out; None if it has none or a link above cannot be
    rebuilt (a wrapper that does not hold the function it wraps in its closure)."""
    update = _update_code()
    if update is not None and getattr(forward, "__code__", None) is update:
        return forward.__wrapped__
    inner = getattr(forward, "__wrapped__", None)
    rebuilt = None if inner is None else _without_update(inner)
    if rebuilt is None or not isinstance(forward, types.FunctionType):
        return None
    cells = forward.__closure__ or ()
    holding = [i for i, cell in enumerate(cells) if _contents(cell) is inner]
    if len(holding) != 1:
        return None
    closure = tuple(types.CellType(rebuilt) if i == holding[0] else cell for i, cell in enumerate(cells))
    without = copy_function(forward, forward.__globals__, closure)
    without.__wrapped__ = rebuilt
    return without


@functools.cache
def _update_code() -> types.CodeType | None:
    """The code of the wrapper dynamic_rope_update puts around every forward it decorates (one code object)."""
    try:
        from transformers.modeling_rope_utils import dynamic_rope_update
    except ImportError:
        return None
    return dynamic_rope_update(lambda module, x, position_ids: None).__code__


def _contents(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
