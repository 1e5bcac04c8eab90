"""Async activation-offload checkpointing: a checkpointed layer keeps only its input, and keeps it in host memory.

Plain checkpointing keeps each layer's input hidden state on the GPU: 28 layers x 64K tokens x 1536 x 2 B = 5.6 GB
for Qwen2.5-1.5B at 8 x 8192 tokens. Here that input is copied to a pinned host buffer on a side CUDA stream while
the layer's forward runs, and its GPU memory is freed once the next layer's input is offloaded (so the last
layer's input, the first backward needs, never leaves). When a layer starts its recompute, the input of the layer
recomputed next (the one before it in forward order) starts coming back, so that copy runs under this layer's
recompute + backward.

How, for `offload_checkpoint` (any function): torch's non-reentrant checkpoint keeps the arguments it is given. We
give it an empty anchor tensor on the input's device instead of the input, and the function it runs reads the input
from an `OffloadedInput`: the real tensor in forward (so autograd links the layer to it), the copy brought back from
host memory in the recompute. All else is torch.utils.checkpoint(use_reentrant=False), so the gradients are bitwise
those of plain checkpointing.

Layers wrapped by enable_offload_checkpointing run their forward under no_grad instead, inside one autograd node
whose backward runs the layer again with grad and backpropagates through that run (torch's reentrant scheme). The
forward then builds no graph and packs no saved tensors (~57 per LoRA decoder layer): host work that bounds the LoRA
update (benchmarks/NOTES.md: Qwen2.5-1.5B's, and Llama-3.1-8B's whose micro-batches run its MLP tiled, on H200s;
full fine-tuning, whose update is bound by the GPU, gains nothing). The recompute runs the whole layer, where the
non-reentrant one stops at the last tensor the forward saved (before the MLP's down projection; before the whole MLP
when the MLP is tiled). A tiled MLP's forward is skipped in this recompute (fastgrpo.ops.tiled_mlp.outputs_unread)
where the layers add its output to the residual and nothing else reads it (`mlp_output_only_added`), so it runs
twice per step either way. The wrapper falls back to offload_checkpoint's scheme where this one cannot be used or
costs more:
- a layer FSDP2 shards (fully_shard on it or on its group: full fine-tuning, bound by the GPU, where this scheme
  gains nothing);
- another argument requires grad (its gradient would have to leave the layer's own backward);
- the micro-batch has more tokens than the layer's tiled MLP runs in one chunk and its output is not only added to
  the residual (Gemma2/3 normalize it): the MLP would run three times.
Both schemes give the same gradients, bit for bit (the same kernels on the same inputs, the same RNG draws). Under
DDP the parameters' gradients accumulate in the layer's own backward, inside the step's: DDP's hooks on their
accumulators fire there and the all-reduce averages them as usual (2 gloo processes, tests/test_offload.py). With
either scheme DDP needs find_unused_parameters=False (its default, and fastgrpo's): its search from the forward's
outputs misses what the offloaded layers read, and their gradients then come as a second "ready" (an error).

HF gradient checkpointing on the same layers: enable_offload_checkpointing turns HF's per-layer flag off (it
checkpoints the same boundary, without offload) and disable_offload_checkpointing turns it back on. If HF's is
turned on again while ours is enabled, HF's runs alone and ours steps aside with a warning: never both.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastgrpo._checks import check_positive_int
from fastgrpo._forward_state import ForwardState
from fastgrpo.hf.binding import bind_forward
from fastgrpo.offload.offloader import (
    ActivationOffloader, OffloadedInput, default_offloader, release_host_memory,
)
from fastgrpo.ops.tiled_mlp import outputs_unread

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


def _runner(function: Callable, slot: int | str, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], Any]:
    """run(hidden): function called with hidden at `slot`. args/kwargs keep None there, so that only the
    OffloadedInput holds the input."""
    if isinstance(slot, int):
        args = (*args[:slot], None, *args[slot + 1 :])
    else:
        kwargs = {**kwargs, slot: None}

    def run(hidden: torch.Tensor) -> Any:
        if isinstance(slot, int):
            return function(*args[:slot], hidden, *args[slot + 1 :], **kwargs)
        return function(*args, **{**kwargs, slot: hidden})

    return run


def _offload_target(
    args: tuple, kwargs: dict, offloader: ActivationOffloader | None, setting: str, what: str
) -> tuple[int | str, torch.Tensor, ActivationOffloader] | None:
    """(slot, input, offloader) of a call whose input can be offloaded (offloader None: default_offloader of a CUDA
    input's device); None where it is checkpointed plainly: no tensor input, a CPU input without an offloader, a
    disabled offloader, an input that is not contiguous. An offloader for another device than the input's is refused
    naming `setting`, `what` (the input's owner) and both devices."""
    slot = _hidden_slot(args, kwargs)
    if slot is None:
        return None
    hidden = args[slot] if isinstance(slot, int) else kwargs[slot]
    if offloader is None and hidden.is_cuda:
        offloader = default_offloader(hidden.device)
    if offloader is None:
        return None
    problem = offloader.other_device(hidden.device, what)
    if problem is not None:
        raise ValueError(f"{setting}: {problem}, or {_DEFAULT_VALUES[setting]}")
    if not offloader.accepts(hidden):
        return None
    return slot, hidden, offloader


# What gives each device its default offloader, per setting an offloader is passed as.
_DEFAULT_VALUES = {"offload_activations": "offload_activations=True (each device's default offloader)",
                   "offloader": "offloader=None (each device's default offloader)"}


def check_offloader_device(offloader: ActivationOffloader, layers: list[nn.Module], setting: str) -> None:
    """One line where a layer's weights are on another device than `offloader`'s, before any layer is wrapped (its
    inputs would be there too). Layers whose weights are all on "meta" are not placed yet: the first forward checks
    their inputs."""
    for i, layer in enumerate(layers):
        placed = (t.device for t in itertools.chain(layer.parameters(), layer.buffers()) if t.device.type != "meta")
        device = next(placed, None)
        problem = None if device is None else offloader.other_device(device, f"layer {i} ({type(layer).__name__})")
        if problem is not None:
            raise ValueError(f"{setting}: {problem}, or {_DEFAULT_VALUES[setting]}")


@contextlib.contextmanager
def _offloaded(offloader: ActivationOffloader, hidden: torch.Tensor) -> Iterator[OffloadedInput]:
    """hidden's OffloadedInput; its host buffer goes back to the pool if the forward fails."""
    handle = offloader.offload(hidden)
    try:
        yield handle
    except BaseException:
        handle.close()
        raise


def _plain_checkpoint(function: Callable, args: tuple, kwargs: dict) -> Any:
    return checkpoint(functools.partial(function, **kwargs), *args, use_reentrant=False)


def offload_checkpoint(
    function: Callable, *args: Any, offloader: ActivationOffloader | None = None, **kwargs: Any
) -> Any:
    """function(*args, **kwargs), checkpointed like torch.utils.checkpoint.checkpoint(use_reentrant=False), its
    input kept in host memory until the recompute needs it.

    The input offloaded is the first tensor positional argument (else kwargs["hidden_states"]); other arguments are
    kept as they are (position embeddings and masks are shared by all layers). offloader: default_offloader of the
    input's device; one for another device than the input's is refused. Falls back to plain non-reentrant
    checkpointing for CPU tensors, a disabled offloader, or an input that is not contiguous. Under no_grad the
    function just runs.
    Raises OffloadMemoryError (naming the setting to change) when no host buffer can be had.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    target = _offload_target(args, kwargs, offloader, "offloader", "the input")
    if target is None:
        return _plain_checkpoint(function, args, kwargs)
    return _checkpoint_offloaded(function, args, kwargs, *target)


def _checkpoint_offloaded(
    function: Callable, args: tuple, kwargs: dict, slot: int | str, hidden: torch.Tensor,
    offloader: ActivationOffloader,
) -> Any:
    anchor = hidden.new_empty(0)  # the device torch's checkpoint infers for RNG state and autocast
    run = _runner(function, slot, args, kwargs)
    with _offloaded(offloader, hidden) as handle:
        return checkpoint(lambda _anchor: run(handle.take()), anchor, use_reentrant=False)


class _RecomputedInBackward(torch.autograd.Function):
    """run(hidden) under no_grad, keeping only `handle` (the offloaded hidden) and the RNG / autocast state; the
    backward runs it again with grad on the copy brought back and backpropagates through that run: the parameters'
    gradients accumulate there, the input's is returned. `anchor` requires grad, so that this node is in the graph
    when hidden does not (the first layer, under a frozen embedding). mlp_unread: the recompute runs under
    outputs_unread (a tiled MLP's forward skipped)."""

    @staticmethod
    def forward(ctx, hidden, anchor, run, handle, mlp_unread):
        # Held by a saved tensor, not by ctx: autograd drops it after the backward (unless retain_graph), so the
        # host buffer goes back to the pool and the masks are freed before the next micro-batch.
        token = hidden.new_empty(0)
        token.recompute = (run, handle, ForwardState(hidden.device), mlp_unread)
        ctx.save_for_backward(token)
        return run(handle.take())

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError("offload checkpointing: double backward (create_graph=True) is not supported")
        run, handle, state, mlp_unread = ctx.saved_tensors[0].recompute
        hidden = handle.take()
        with state.rng_restored():
            with state.autocast(), outputs_unread() if mlp_unread else contextlib.nullcontext():
                outputs = run(hidden)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            pairs = [(out, grad) for out, grad in zip(outputs, grads)
                     if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None]
            if pairs:
                torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        return hidden.grad, None, None, None, None


_ANCHORS: dict[torch.device, torch.Tensor] = {}


def _anchor(device: torch.device) -> torch.Tensor:
    if device not in _ANCHORS:
        _ANCHORS[device] = torch.empty(0, device=device, requires_grad=True)
    return _ANCHORS[device]


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) and v.requires_grad for v in value)


def _sharded_by_fsdp2(layer: nn.Module) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(layer, FSDPModule)


def _recomputes_in_backward(
    layer: nn.Module, slot: int | str, hidden: torch.Tensor, args: tuple, kwargs: dict, max_tokens: int | None,
    mlp_output_only_added: bool,
) -> bool:
    """Whether an offloaded call runs through _RecomputedInBackward: not where the module docstring's conditions
    send it to the non-reentrant checkpoint."""
    if _sharded_by_fsdp2(layer):
        return False
    mlp_tiled = max_tokens is not None and hidden.numel() // max(hidden.shape[-1], 1) > max_tokens
    if mlp_tiled and not mlp_output_only_added:
        return False
    others = [v for i, v in enumerate(args) if i != slot] + [v for k, v in kwargs.items() if k != slot]
    return not any(_requires_grad(v) for v in others)


def _recompute_in_backward(
    function: Callable, args: tuple, kwargs: dict, slot: int | str, hidden: torch.Tensor,
    offloader: ActivationOffloader, mlp_unread: bool,
) -> Any:
    run = _runner(function, slot, args, kwargs)
    with _offloaded(offloader, hidden) as handle:
        return _RecomputedInBackward.apply(hidden, _anchor(hidden.device), run, handle, mlp_unread)


# --- Instance-level wrapping of decoder layers --------------------------------------------------------------


@dataclass
class _LayerState:
    inner: Callable  # what layer.forward was: the class's forward (weakly bound) or an earlier instance-level one
    restore_forward: Callable[[], None]
    hf_turned_off: bool  # HF's gradient_checkpointing flag was on and we turned it off
    hf_flag: Any  # layer.__dict__["gradient_checkpointing"] before that, or _MISSING
    offloader: ActivationOffloader | None
    tiled_mlp_chunk_tokens: int | None
    mlp_output_only_added: bool


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
    kwargs = _without_cache(self, kwargs)
    # Named as patch_model takes it; a layer's weights on another device were refused when it was wrapped.
    target = _offload_target(args, kwargs, state.offloader, "offload_activations", f"{type(self).__name__}'s input")
    if target is None:
        return _plain_checkpoint(state.inner, args, kwargs)
    slot, hidden, _ = target
    only_added = state.mlp_output_only_added
    if _recomputes_in_backward(self, slot, hidden, args, kwargs, state.tiled_mlp_chunk_tokens, only_added):
        return _recompute_in_backward(state.inner, args, kwargs, *target, mlp_unread=only_added)
    return _checkpoint_offloaded(state.inner, args, kwargs, *target)


def _check_layers(layers: Iterable[nn.Module]) -> list[nn.Module]:
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ValueError(f"layers: expected nn.Module items, got {type(layer).__name__} at index {i}")
    return layers


def enable_offload_checkpointing(
    layers: Iterable[nn.Module],
    *,
    offloader: ActivationOffloader | None = None,
    tiled_mlp_chunk_tokens: int | None = None,
    mlp_output_only_added: bool = False,
) -> None:
    """Checkpoint each layer with its input offloaded to host memory (on this instance only; idempotent).

    Active in training mode with grad enabled; in eval mode or under no_grad the layer runs as before. HF's own
    gradient checkpointing flag on these layers is turned off while this is on (restored by disable).
    offloader: None uses default_offloader of each input's device (CPU inputs: plain checkpointing). One for another
    device than the layers' is refused (here where their weights are placed, else at the first forward). Calling
    again with an offloader replaces the one in use.
    tiled_mlp_chunk_tokens: the layers' MLPs run tiled (fastgrpo.ops.tiled_mlp) in chunks of this many tokens; a
    micro-batch of more tokens is then checkpointed the non-reentrant way, whose recompute stops before the MLP (see
    the module docstring). None: untiled. Calling again sets it.
    mlp_output_only_added: the layers' last op adds their MLP's output to the residual as it is (Llama, Qwen,
    Mistral, Gemma; not Gemma2/3, which normalize it, nor Phi-3, whose residual dropout draws random numbers after
    the MLP's): a micro-batch above the tiled MLP's chunk is then recomputed in the backward too, without the MLP's
    forward. Were the output read, the gradients would be NaN. Calling again sets it.
    """
    if tiled_mlp_chunk_tokens is not None:
        check_positive_int("tiled_mlp_chunk_tokens", tiled_mlp_chunk_tokens)
    layers = _check_layers(layers)
    if offloader is not None:
        check_offloader_device(offloader, layers, "offloader")
    for layer in layers:
        state = layer.__dict__.get(_STATE_ATTR)
        if state is not None:
            state.offloader = offloader or state.offloader
            state.tiled_mlp_chunk_tokens = tiled_mlp_chunk_tokens
            state.mlp_output_only_added = mlp_output_only_added
        else:
            hf_on = bool(getattr(layer, "gradient_checkpointing", False))
            binding = bind_forward(layer, lambda previous: _offloaded_forward)
            state = layer.__dict__[_STATE_ATTR] = _LayerState(
                inner=binding.previous,
                restore_forward=binding.restore,
                hf_turned_off=hf_on,
                hf_flag=layer.__dict__.get("gradient_checkpointing", _MISSING),
                offloader=offloader,
                tiled_mlp_chunk_tokens=tiled_mlp_chunk_tokens,
                mlp_output_only_added=mlp_output_only_added,
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
    # Read from the states, not from _DEFAULT_USERS: a deepcopy's layers (fastgrpo's reference model, a user's copy)
    # use the default offloaders without having been registered there.
    disabled_a_user = False
    for layer in _check_layers(layers):
        state = layer.__dict__.pop(_STATE_ATTR, None)
        if state is None:
            continue
        disabled_a_user |= state.offloader is None
        _DEFAULT_USERS.discard(layer)
        state.restore_forward()
        # HF's flag goes back on only if nobody changed it meanwhile.
        if state.hf_turned_off and layer.__dict__.get("gradient_checkpointing") is False:
            if state.hf_flag is _MISSING:
                del layer.__dict__["gradient_checkpointing"]
            else:
                layer.__dict__["gradient_checkpointing"] = state.hf_flag
    if disabled_a_user and not _DEFAULT_USERS:
        release_host_memory()
