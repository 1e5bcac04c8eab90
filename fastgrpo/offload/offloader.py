"""ActivationOffloader: copies of checkpointed layers' inputs to (pinned) host memory and back, on a side CUDA
stream, from a HostBufferPool; the default offloaders (one per CUDA device) and release_host_memory.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from fastgrpo.offload.pool import HostBufferPool

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
        self._live: list[weakref.ref[OffloadedInput]] = []  # in forward order
        # Re-entrant: a handle's __del__ (gc may run anywhere, autograd's thread included) takes it too.
        self._lock = threading.RLock()

    def __deepcopy__(self, memo: dict) -> ActivationOffloader:
        return self  # a per-device resource (stream, host pool): a deepcopy of a model shares it

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether it offloads `tensor` (else plain checkpointing), which other_device found on its device."""
        return self.enabled and tensor.is_contiguous() and tensor.numel() > 0

    def other_device(self, device: torch.device, what: str) -> str | None:
        """Why this offloader cannot take `what` on `device`, or None: it copies one device's tensors, on that
        device's stream. A disabled one offloads nothing, so any device passes."""
        if not self.enabled or device == self.device:
            return None
        return f"the ActivationOffloader is for {self.device}, and {what} is on {device}; pass one made for {device}"

    @property
    def num_live(self) -> int:
        """Offloaded inputs whose autograd graph is still alive."""
        with self._lock:
            return sum(ref() is not None for ref in self._live)

    def copy_ms(self) -> float:
        """Copy-stream time of the copies since the last call (needs record_copy_times=True; synchronizes)."""
        return 0.0 if self._copies is None else self._copies.copy_ms()

    def offload(self, tensor: torch.Tensor) -> OffloadedInput:
        if self._copies is None:
            cuda = self.device.type == "cuda"
            self._copies = _CudaCopies(self.device, self.record_copy_times) if cuda else _SyncCopies()
        handle = OffloadedInput(self, tensor)
        with self._lock:
            newest = self._live[-1]() if self._live else None
            self._live.append(weakref.ref(handle))
        # The newest input stays on the device until the next one is offloaded: the last layer's input is the
        # first one backward needs, and during that layer's backward (the peak) it would be back anyway.
        if newest is not None:
            newest.drop_device_copy()
        return handle

    def _prefetch_before(self, handle: OffloadedInput) -> None:
        """Start bringing back the inputs recomputed after `handle`'s: those offloaded just before it."""
        with self._lock:
            live = [h for h in (ref() for ref in self._live) if h is not None]
        index = next(i for i, h in enumerate(live) if h is handle)
        for earlier in reversed(live[max(0, index - self.prefetch) : index]):
            # fetches < handle's: not yet brought back in this backward (retain_graph replays count up again).
            if earlier.fetches < handle.fetches:
                earlier.prefetch()

    def _forget(self, handle: OffloadedInput) -> None:
        with self._lock:
            self._live = [ref for ref in self._live if ref() is not None and ref() is not handle]


class OffloadedInput:
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
