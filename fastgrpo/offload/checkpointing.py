"""Async activation-offload checkpointing: a checkpointed layer keeps only its input, and keeps it in host memory.

Plain checkpointing keeps each layer's input hidden state on the GPU: 28 layers x 64K tokens x 1536 x 2 B = 5.6 GB
for Qwen2.5-1.5B at 8 x 8192 tokens. Here that input is copied to a pinned host buffer on a side CUDA stream while
the layer's forward runs, and its GPU memory is freed once the next layer's input is offloaded (so the last
layer's input, the first backward needs, never leaves). When a layer starts its recompute, the input of the layer
recomputed next (the one before it in forward order) starts coming back, so that copy runs under this layer's
recompute + backward.

How: torch's non-reentrant checkpoint keeps the arguments it is given. We give it an empty anchor tensor on the
input's device instead of the input, and the function it runs reads the input from an `OffloadedInput`: the real
tensor in forward (so autograd links the layer to it), the copy brought back from host memory in the recompute.
All else is torch.utils.checkpoint(use_reentrant=False), so the gradients are bitwise those of plain checkpointing.

HF gradient checkpointing on the same layers: enable_offload_checkpointing turns HF's per-layer flag off (it
checkpoints the same boundary, without offload) and disable_offload_checkpointing turns it back on. If HF's is
turned on again while ours is enabled, HF's runs alone and ours steps aside with a warning: never both.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastgrpo.hf.binding import bind_forward
from fastgrpo.offload.offloader import ActivationOffloader, OffloadedInput, default_offloader, release_host_memory

_STATE_ATTR = "_fastgrpo_offload"
# Layers enabled without an offloader of their own: the last one disabled releases the default offloaders' memory.
_DEFAULT_USERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# HF decoder layers take the KV cache under one of these names; a recomputed layer would write it a second time.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


class _Missing:
    """No instance attribute was there. One object, also in a deepcopy of a layer (the `is _MISSING` tests)."""

    def __deepcopy__(self, memo: dict) -> _Missing:
        return self


_MISSING = _Missing()


# --- The checkpoint ------------------------------------------------------------------------------------------


def _hidden_slot(args: tuple, kwargs: dict) -> int | str | None:
    """Where the input to offload is: the first tensor positional argument, else kwargs["hidden_states"]."""
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            return i
    return "hidden_states" if isinstance(kwargs.get("hidden_states"), torch.Tensor) else None


def _runner(function: Callable, handle: OffloadedInput, slot: int | str, args: tuple, kwargs: dict) -> Callable:
    """The function torch's checkpoint runs: `args`/`kwargs` hold None at `slot`, so only `handle` holds the input."""

    def run(_anchor: torch.Tensor) -> Any:
        hidden = handle.take()
        if isinstance(slot, int):
            return function(*args[:slot], hidden, *args[slot + 1 :], **kwargs)
        return function(*args, **{**kwargs, slot: hidden})

    return run


def offload_checkpoint(
    function: Callable, *args: Any, offloader: ActivationOffloader | None = None, **kwargs: Any
) -> Any:
    """function(*args, **kwargs), checkpointed like torch.utils.checkpoint.checkpoint(use_reentrant=False), its
    input kept in host memory until the recompute needs it.

    The input offloaded is the first tensor positional argument (else kwargs["hidden_states"]); other arguments are
    kept as they are (position embeddings and masks are shared by all layers). offloader: default_offloader of the
    input's device. Falls back to plain non-reentrant checkpointing for CPU tensors, a disabled offloader, or an
    input that is not contiguous. Under no_grad the function just runs.
    Raises OffloadMemoryError (naming the setting to change) when no host buffer can be had.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    slot = _hidden_slot(args, kwargs)
    hidden = None if slot is None else (args[slot] if isinstance(slot, int) else kwargs[slot])
    if offloader is None and hidden is not None and hidden.is_cuda:
        offloader = default_offloader(hidden.device)
    if hidden is None or offloader is None or not offloader.accepts(hidden):
        return checkpoint(functools.partial(function, **kwargs), *args, use_reentrant=False)

    anchor = hidden.new_empty(0)  # the device torch's checkpoint infers for RNG state and autocast
    if isinstance(slot, int):
        args = (*args[:slot], None, *args[slot + 1 :])
    else:
        kwargs = {**kwargs, slot: None}
    handle = offloader.offload(hidden)
    del hidden
    try:
        return checkpoint(_runner(function, handle, slot, args, kwargs), anchor, use_reentrant=False)
    except BaseException:
        handle.close()
        raise


# --- Instance-level wrapping of decoder layers --------------------------------------------------------------


@dataclass
class _LayerState:
    inner: Callable  # what layer.forward was: the class's forward (weakly bound) or an earlier instance-level one
    restore_forward: Callable[[], None]
    hf_turned_off: bool  # HF's gradient_checkpointing flag was on and we turned it off
    hf_flag: Any  # layer.__dict__["gradient_checkpointing"] before that, or _MISSING
    offloader: ActivationOffloader | None


def _without_cache(layer: nn.Module, kwargs: dict) -> dict:
    """HF's rule under checkpointing: no cache writes (the recompute would write them twice)."""
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if not getattr(layer, "_can_checkpoint_with_cache", False):
        for name in _CACHE_KWARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
    return kwargs


def _offloaded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _LayerState = self.__dict__[_STATE_ATTR]
    if not (self.training and torch.is_grad_enabled()):
        return state.inner(*args, **kwargs)
    if getattr(self, "gradient_checkpointing", False):
        warnings.warn(
            f"{type(self).__name__}: HF gradient checkpointing was turned on after enable_offload_checkpointing; "
            "HF's checkpointing runs alone (no offload). Call gradient_checkpointing_disable() on the model, then "
            "enable_offload_checkpointing, to offload.",
            stacklevel=2,
        )
        return state.inner(*args, **kwargs)
    return offload_checkpoint(state.inner, *args, offloader=state.offloader, **_without_cache(self, kwargs))


def _check_layers(layers: Iterable[nn.Module]) -> list[nn.Module]:
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ValueError(f"layers: expected nn.Module items, got {type(layer).__name__} at index {i}")
    return layers


def enable_offload_checkpointing(
    layers: Iterable[nn.Module], *, offloader: ActivationOffloader | None = None
) -> None:
    """Checkpoint each layer with its input offloaded to host memory (on this instance only; idempotent).

    Active in training mode with grad enabled; in eval mode or under no_grad the layer runs as before. HF's own
    gradient checkpointing flag on these layers is turned off while this is on (restored by disable).
    offloader: None uses default_offloader of each input's device (CPU inputs: plain checkpointing). Calling again
    with an offloader replaces the one in use.
    """
    for layer in _check_layers(layers):
        state = layer.__dict__.get(_STATE_ATTR)
        if state is not None:
            state.offloader = offloader or state.offloader
        else:
            hf_on = bool(getattr(layer, "gradient_checkpointing", False))
            binding = bind_forward(layer, lambda previous: _offloaded_forward)
            state = layer.__dict__[_STATE_ATTR] = _LayerState(
                inner=binding.previous,
                restore_forward=binding.restore,
                hf_turned_off=hf_on,
                hf_flag=layer.__dict__.get("gradient_checkpointing", _MISSING),
                offloader=offloader,
            )
            if hf_on:
                layer.gradient_checkpointing = False
        if state.offloader is None:
            _DEFAULT_USERS.add(layer)
        else:
            _DEFAULT_USERS.discard(layer)


def disable_offload_checkpointing(layers: Iterable[nn.Module]) -> None:
    """Undo enable_offload_checkpointing on these layers exactly (layers never enabled are left alone).

    When this disables the last layer that used the default offloaders, their host memory is released
    (release_host_memory()); an offloader passed to enable is left as it is.
    """
    had_users = bool(_DEFAULT_USERS)
    for layer in _check_layers(layers):
        state = layer.__dict__.pop(_STATE_ATTR, None)
        if state is None:
            continue
        _DEFAULT_USERS.discard(layer)
        state.restore_forward()
        # HF's flag goes back on only if nobody changed it meanwhile.
        if state.hf_turned_off and layer.__dict__.get("gradient_checkpointing") is False:
            if state.hf_flag is _MISSING:
                del layer.__dict__["gradient_checkpointing"]
            else:
                layer.__dict__["gradient_checkpointing"] = state.hf_flag
    if had_users and not _DEFAULT_USERS:
        release_host_memory()
