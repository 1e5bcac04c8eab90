"""A reusable pool of host buffers for activation offload: no pinned allocation per step once warm.

cudaHostAlloc is slow (milliseconds per 100 MB) and synchronizes the device, so buffers are kept and handed out
again. Sizes are rounded up to size classes so that the varying sequence lengths of GRPO batches reuse buffers
instead of growing the pool with one buffer per exact size: powers of two for pinned memory (torch's pinned
allocator rounds every allocation up to a power of two anyway, so that is what the host really gives), 8 classes
per power of two (at most 12.5% slack) for pageable memory.
The allocator is pluggable so the pool logic runs on a CPU-only machine (plain CPU tensors, pin_memory=False).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

import torch

GIB = 1024**3
MIB = 1024**2
# Below 1 MiB a class per size is not worth it: small inputs share 1 MiB buffers.
_MIN_CLASS_BYTES = 1 << 20


class OffloadMemoryError(RuntimeError):
    """Host memory for offloaded activations could not be had; the message names the setting to change."""


def size_class(nbytes: int, steps: int = 8) -> int:
    """The buffer size for a request of `nbytes`: the next of `steps` sizes per power of two (>= 1 MiB).

    steps=8 wastes at most 12.5%, steps=1 rounds up to a power of two. steps must be a power of two.
    """
    if nbytes <= _MIN_CLASS_BYTES:
        return _MIN_CLASS_BYTES
    step = 1 << max(0, nbytes.bit_length() - steps.bit_length())
    return -(-nbytes // step) * step


def _amount(nbytes: int) -> str:
    """nbytes for a message, in the unit that shows it: 0.00 GiB said nothing of a 1 MiB buffer or bound."""
    for unit, size in (("GiB", GIB), ("MiB", MIB)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes / 1024:.2f} KiB"


def _can_pin() -> bool:
    return torch.cuda.is_available() or torch.accelerator.is_available()


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _pageable_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class HostBufferPool:
    """Flat uint8 host buffers handed out by size class and returned for reuse.

    max_bytes bounds what the pool may hold (in use + free); None means no bound other than the allocator's.
    When a new buffer would pass the bound, free buffers of other sizes are dropped first.
    pin_memory=False (or a custom `allocator(nbytes) -> uint8 tensor`) makes the pool usable without CUDA.
    """

    def __init__(
        self,
        max_bytes: int | None = None,
        *,
        pin_memory: bool = True,
        allocator: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
            raise ValueError(f"max_bytes: expected a positive int or None, got {max_bytes!r}")
        if pin_memory and allocator is None and not _can_pin():
            # else the first step fails, naming the pool's size and the offload switch, which are not the cause
            raise ValueError("pin_memory: True needs CUDA (or another accelerator) to pin host memory, which this "
                             "machine lacks; pass HostBufferPool(pin_memory=False) (with ActivationOffloader('cpu'))")
        self.max_bytes = max_bytes
        self.pin_memory = pin_memory
        self.class_steps = 1 if pin_memory else 8
        self._allocate = allocator or (_pinned_bytes if pin_memory else _pageable_bytes)
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        # data_ptr of each buffer in use -> the clear() count when it was handed out: older ones are dropped on return.
        self._in_use: dict[int, int] = {}
        self._clears = 0
        # Buffers come back from autograd's backward thread, or from a __del__ that gc runs inside acquire().
        self._lock = threading.RLock()
        self.bytes_in_use = 0
        self.bytes_free = 0
        self.num_allocations = 0  # buffers ever allocated: flat once the pool is warm

    @property
    def bytes_held(self) -> int:
        return self.bytes_in_use + self.bytes_free

    @property
    def num_free(self) -> int:
        return sum(len(bufs) for bufs in self._free.values())

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` (its length is the size class); give it back with release()."""
        if nbytes < 0:
            raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
        size = size_class(nbytes, self.class_steps)
        with self._lock:
            free = self._free[size]
            if free:
                buf = free.pop()
                self.bytes_free -= size
            else:
                self._make_room(size)
                buf = self._allocate_or_raise(size)
                self.num_allocations += 1
            self.bytes_in_use += size
            self._in_use[buf.data_ptr()] = self._clears
        return buf

    def release(self, buf: torch.Tensor) -> None:
        size = buf.numel()
        with self._lock:
            self.bytes_in_use -= size
            if self._in_use.pop(buf.data_ptr()) == self._clears:
                self._free[size].append(buf)
                self.bytes_free += size

    def clear(self) -> None:
        """Drop the free buffers now, and those in use when they are released: the pool then holds nothing.

        A buffer in use stays with its holder (an offloaded input whose graph is alive) until it is released.
        """
        with self._lock:
            self._free.clear()
            self.bytes_free = 0
            self._clears += 1

    def _make_room(self, size: int) -> None:
        if self.max_bytes is None:
            return
        # Drop the largest free buffers first: they are the least likely to match the next request.
        for cls in sorted(self._free, reverse=True):
            while self._free[cls] and self.bytes_held + size > self.max_bytes:
                self._free[cls].pop()
                self.bytes_free -= cls
        if self.bytes_held + size > self.max_bytes:
            # What is in use belongs to live autograd graphs: this forward's, and any an earlier one left alive.
            raise OffloadMemoryError(
                f"activation offload needs {_amount(size)} more host memory but the pool already holds "
                f"{_amount(self.bytes_held)} in use of its max_bytes={self.max_bytes} ({_amount(self.max_bytes)}): "
                "raise max_bytes, use shorter or fewer sequences per step, free the outputs / losses of forwards "
                "whose backward did not run or failed (their graphs hold their inputs' buffers), or turn activation "
                "offload off (offload_activations=False / disable_offload_checkpointing)"
            )

    def _allocate_or_raise(self, size: int) -> torch.Tensor:
        try:
            return self._allocate(size)
        except (RuntimeError, MemoryError) as err:
            kind = "pinned" if self.pin_memory else "host"
            raise OffloadMemoryError(
                f"could not allocate {_amount(size)} of {kind} host memory for activation offload "
                f"(the pool holds {_amount(self.bytes_held)}): use fewer or shorter sequences per micro-batch, "
                "or turn activation offload off (offload_activations=False / disable_offload_checkpointing); "
                f"HostBufferPool(max_bytes=...) makes this an explicit limit. Cause: {err}"
            ) from err
