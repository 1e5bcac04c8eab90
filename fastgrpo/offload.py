"""Async activation-offload checkpointing: a checkpointed layer keeps only its input, and keeps it in host memory.

Plain checkpointing keeps each layer's input hidden state on the GPU: 28 layers x 64K tokens x 1536 x 2 B = 5.6 GB
for Qwen2.5-1.5B at 8 x 8192 tokens. Here that input is copied to a pinned host buffer on a side CUDA stream while
the layer's forward runs, and its GPU memory is freed once the next layer's input is offloaded (so the last
layer's input, the first backward needs, never leaves). When a layer starts its recompute, the input of the layer
recomputed next (the one before it in forward order) starts coming back, so that copy runs under this layer's
recompute + backward.

How: torch's non-reentrant checkpoint keeps the arguments it is given. We give it an empty anchor tensor on the
input's device instead of the input, and the function it runs reads the input from an `_OffloadedInput`: the real
tensor in forward (so autograd links the layer to it), the copy brought back from host memory in the recompute.
All else is torch.utils.checkpoint(use_reentrant=False), so the gradients are bitwise those of plain checkpointing.

HF gradient checkpointing on the same layers: enable_offload_checkpointing turns HF's per-layer flag off (it
checkpoints the same boundary, without offload) and disable_offload_checkpointing turns it back on. If HF's is
turned on again while ours is enabled, HF's runs alone and ours steps aside with a warning: never both.
"""
from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastgrpo._weak_method import WeakBoundMethod
from fastgrpo.offload_pool import HostBufferPool, OffloadMemoryError

__all__ = [
    "ActivationOffloader",
    "HostBufferPool",
    "OffloadMemoryError",
    "default_offloader",
    "disable_offload_checkpointing",
    "enable_offload_checkpointing",
    "offload_checkpoint",
    "release_host_memory",
]

_STATE_ATTR = "_fastgrpo_offload"
# HF decoder layers take the KV cache under one of these names; a recomputed layer would write it a second time.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


class _Missing:
    """No instance attribute was there. One object, also in a deepcopy of a layer (the `is _MISSING` tests)."""

    def __deepcopy__(self, memo: dict) -> _Missing:
        return self


_MISSING = _Missing()


# --- Copies: a side CUDA stream, or synchronous CPU copies to run the same logic without a GPU ----------------


class _CudaCopies:
    """Device <-> pinned host copies on one side stream; optionally timed with CUDA events."""

    def __init__(self, device: torch.device, record_times: bool) -> None:
        self.stream = torch.cuda.Stream(device)
        self.record_times = record_times
        self.times: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def to_host(self, src: torch.Tensor, host: torch.Tensor) -> None:
        # The copy reads src once the compute stream has produced it, while the layer's forward runs.
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream):
            start = self._start()
            host.copy_(src, non_blocking=True)
            self._stop(start)
        # src is freed as soon as forward moves on: the allocator must not hand its memory out before the copy.
        src.record_stream(self.stream)

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
        with torch.cuda.stream(self.stream):
            start = self._start()
            # Allocated on the copy stream, so the allocator orders its reuse after this copy.
            dev = torch.empty(host.shape, dtype=host.dtype, device=device)
            dev.copy_(host, non_blocking=True)
            self._stop(start)
            done = torch.cuda.Event()
            done.record(self.stream)
        return dev, done

    def wait(self, dev: torch.Tensor, done: torch.cuda.Event) -> None:
        stream = torch.cuda.current_stream(dev.device)
        stream.wait_event(done)
        dev.record_stream(stream)

    def copy_ms(self) -> float:
        """Total time the copies took on the copy stream since the last call (synchronizes)."""
        self.stream.synchronize()
        total = sum(start.elapsed_time(stop) for start, stop in self.times)
        self.times.clear()
        return total

    def _start(self) -> torch.cuda.Event | None:
        if not self.record_times:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        return start

    def _stop(self, start: torch.cuda.Event | None) -> None:
        if start is not None:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record(self.stream)
            self.times.append((start, stop))


class _SyncCopies:
    """CPU tensors to other CPU buffers, at once: runs the offload logic on a machine without CUDA (tests)."""

    def to_host(self, src: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(src)

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, None]:
        return host.to(device, copy=True), None

    def wait(self, dev: torch.Tensor, done: None) -> None:
        pass

    def copy_ms(self) -> float:
        return 0.0


# --- The offloader: pool, copies and the order of the live offloaded inputs ------------------------------------


class ActivationOffloader:
    """Where checkpointed inputs go and how they come back; one per device.

    device: the CUDA device of the activations. "cpu" offloads CPU tensors to other CPU buffers with synchronous
        copies: no use for training, it runs the same logic on a machine without CUDA (tests).
    pool: the host buffers (default: pinned, unbounded; HostBufferPool(max_bytes=...) bounds them).
    prefetch: how many layers ahead backward brings inputs back. 1 suffices: one Qwen2.5-1.5B input at 64K tokens
        is 201 MB, ~8 ms at 25 GB/s, against tens of ms for that layer's recompute + backward.
    enabled: False checkpoints without offload (plain non-reentrant checkpointing).
    record_copy_times: time each copy with CUDA events; copy_ms() returns the total (benchmarks).
    """

    def __init__(
        self,
        device: torch.device | str = "cuda",
        *,
        pool: HostBufferPool | None = None,
        prefetch: int = 1,
        enabled: bool = True,
        record_copy_times: bool = False,
    ) -> None:
        device = torch.device(device)
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"device: expected a cuda device (or 'cpu' for tests), got {device}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device: CUDA is not available; offload needs a CUDA device (or 'cpu' for tests)")
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch: expected an int >= 0, got {prefetch!r}")
        self.device = device
        self.pool = pool if pool is not None else HostBufferPool(pin_memory=device.type == "cuda")
        self.prefetch = prefetch
        self.enabled = enabled
        self.record_copy_times = record_copy_times
        self._copies: _CudaCopies | _SyncCopies | None = None
        self._live: list[weakref.ref[_OffloadedInput]] = []  # in forward order
        # Re-entrant: a handle's __del__ (gc may run anywhere, autograd's thread included) takes it too.
        self._lock = threading.RLock()

    def __deepcopy__(self, memo: dict) -> ActivationOffloader:
        return self  # a per-device resource (stream, host pool): a deepcopy of a model shares it

    def accepts(self, tensor: torch.Tensor) -> bool:
        return (
            self.enabled
            and tensor.device == self.device
            and tensor.is_contiguous()
            and tensor.numel() > 0
        )

    @property
    def num_live(self) -> int:
        """Offloaded inputs whose autograd graph is still alive."""
        with self._lock:
            return sum(ref() is not None for ref in self._live)

    def copy_ms(self) -> float:
        """Copy-stream time of the copies since the last call (needs record_copy_times=True; synchronizes)."""
        return 0.0 if self._copies is None else self._copies.copy_ms()

    def offload(self, tensor: torch.Tensor) -> _OffloadedInput:
        if self._copies is None:
            cuda = self.device.type == "cuda"
            self._copies = _CudaCopies(self.device, self.record_copy_times) if cuda else _SyncCopies()
        handle = _OffloadedInput(self, tensor)
        with self._lock:
            newest = self._live[-1]() if self._live else None
            self._live.append(weakref.ref(handle))
        # The newest input stays on the device until the next one is offloaded: the last layer's input is the
        # first one backward needs, and during that layer's backward (the peak) it would be back anyway.
        if newest is not None:
            newest.drop_device_copy()
        return handle

    def _prefetch_before(self, handle: _OffloadedInput) -> None:
        """Start bringing back the inputs recomputed after `handle`'s: those offloaded just before it."""
        with self._lock:
            live = [h for h in (ref() for ref in self._live) if h is not None]
        index = next(i for i, h in enumerate(live) if h is handle)
        for earlier in reversed(live[max(0, index - self.prefetch) : index]):
            # fetches < handle's: not yet brought back in this backward (retain_graph replays count up again).
            if earlier.fetches < handle.fetches:
                earlier.prefetch()

    def _forget(self, handle: _OffloadedInput) -> None:
        with self._lock:
            self._live = [ref for ref in self._live if ref() is not None and ref() is not handle]


class _OffloadedInput:
    """One checkpointed input: its host copy, and the tensor itself until the next input is offloaded."""

    def __init__(self, offloader: ActivationOffloader, tensor: torch.Tensor) -> None:
        self._offloader = offloader
        self._copies = offloader._copies
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.requires_grad = tensor.requires_grad
        self.fetches = 0  # runs of the layer after the forward one
        self._prefetched: tuple[torch.Tensor, Any] | None = None
        self._buffer: torch.Tensor | None = None  # set before acquire: __del__ runs even if acquire raises
        nbytes = tensor.numel() * tensor.element_size()
        self._buffer = offloader.pool.acquire(nbytes)
        self._host = self._buffer[:nbytes].view(self.dtype).view(self.shape)
        with torch.no_grad():  # else copy_ from a tensor that requires grad puts the host copy in the graph
            self._copies.to_host(tensor, self._host)
        self._tensor: torch.Tensor | None = tensor
        self._forward_taken = False

    def take(self) -> torch.Tensor:
        """The input for one run of the layer: the tensor itself in forward; in a recompute the tensor if it is
        still on the device, else the copy brought back from the host."""
        if not self._forward_taken:
            self._forward_taken = True
            return self._tensor
        if self._buffer is None:
            raise RuntimeError("offload_checkpoint: the offloaded input was released before its recompute")
        self.fetches += 1
        if self._tensor is not None:
            dev, self._tensor = self._tensor.detach(), None
        else:
            self.prefetch()
            dev, done = self._prefetched
            self._prefetched = None
            self._copies.wait(dev, done)
        self._offloader._prefetch_before(self)
        return dev.requires_grad_(self.requires_grad)

    def prefetch(self) -> None:
        if self._prefetched is None and self._tensor is None and self._buffer is not None:
            with torch.no_grad():
                self._prefetched = self._copies.to_device(self._host, self.device)

    def drop_device_copy(self) -> None:
        self._tensor = None

    def close(self) -> None:
        """Give the host buffer back to the pool; the graph that needed it is gone (or its forward failed)."""
        buffer, self._buffer = self._buffer, None
        self._host = self._tensor = self._prefetched = None
        if buffer is not None:
            self._offloader._forget(self)
            self._offloader.pool.release(buffer)

    def __del__(self) -> None:
        self.close()


_DEFAULT_OFFLOADERS: dict[torch.device, ActivationOffloader] = {}
# Layers enabled without an offloader of their own: the last one disabled releases the default offloaders' memory.
_DEFAULT_USERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def default_offloader(device: torch.device | str) -> ActivationOffloader:
    """The offloader used when none is given: one per CUDA device, created on first use (its pool is pinned,
    unbounded; to bound it, pass ActivationOffloader(pool=HostBufferPool(max_bytes=...)) instead)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _DEFAULT_OFFLOADERS:
        _DEFAULT_OFFLOADERS[device] = ActivationOffloader(device)
    return _DEFAULT_OFFLOADERS[device]


def release_host_memory(offloader: ActivationOffloader | None = None) -> None:
    """Give the host memory of `offloader`'s pool back (None: of every default offloader's pool).

    Safe at any time: a buffer that holds an offloaded input whose graph is still alive stays with it, and leaves
    the pool when that graph is freed. The pool grows again on the next offload. Pinned buffers freed by torch
    go to its pinned-memory cache first; that cache is emptied too, so the pages go back to the OS.
    disable_offload_checkpointing (and unpatch_model) calls this for the default offloaders once no layer uses them.
    """
    if offloader is not None and not isinstance(offloader, ActivationOffloader):
        raise ValueError(f"offloader: expected an ActivationOffloader or None, got {type(offloader).__name__}")
    for each in [offloader] if offloader is not None else list(_DEFAULT_OFFLOADERS.values()):
        each.pool.clear()
    if torch.cuda.is_initialized():  # else no pinned memory was ever allocated
        # newer torch: torch.accelerator.empty_host_cache; older: only the private name.
        empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()


# --- The checkpoint ------------------------------------------------------------------------------------------


def _hidden_slot(args: tuple, kwargs: dict) -> int | str | None:
    """Where the input to offload is: the first tensor positional argument, else kwargs["hidden_states"]."""
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            return i
    return "hidden_states" if isinstance(kwargs.get("hidden_states"), torch.Tensor) else None


def _runner(function: Callable, handle: _OffloadedInput, slot: int | str, args: tuple, kwargs: dict) -> Callable:
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
    instance_forward: Any  # layer.__dict__["forward"] before, or _MISSING
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
            own = layer.__dict__.get("forward", _MISSING)
            state = layer.__dict__[_STATE_ATTR] = _LayerState(
                # Weakly bound (and so is the forward below): a layer -> forward -> layer cycle would keep the
                # model's memory after `del model` until gc runs.
                inner=own if own is not _MISSING else WeakBoundMethod(type(layer).forward, layer),
                instance_forward=own,
                hf_turned_off=hf_on,
                hf_flag=layer.__dict__.get("gradient_checkpointing", _MISSING),
                offloader=offloader,
            )
            if hf_on:
                layer.gradient_checkpointing = False
            layer.forward = WeakBoundMethod(_offloaded_forward, layer)
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
        if state.instance_forward is _MISSING:
            del layer.__dict__["forward"]
        else:
            layer.__dict__["forward"] = state.instance_forward
        # HF's flag goes back on only if nobody changed it meanwhile.
        if state.hf_turned_off and layer.__dict__.get("gradient_checkpointing") is False:
            if state.hf_flag is _MISSING:
                del layer.__dict__["gradient_checkpointing"]
            else:
                layer.__dict__["gradient_checkpointing"] = state.hf_flag
    if had_users and not _DEFAULT_USERS:
        release_host_memory()
