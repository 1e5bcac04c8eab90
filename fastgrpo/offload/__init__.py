"""Activation memory: checkpointed layers keep their inputs in (pinned) host memory, copied asynchronously.

`enable_offload_checkpointing(layers)` (or patch_model(offload_activations=...)) wraps decoder layers;
`ActivationOffloader` does the copies from a `HostBufferPool`; `release_host_memory` gives the pool's memory back.
"""
from fastgrpo.offload.checkpointing import (
    disable_offload_checkpointing,
    enable_offload_checkpointing,
    offload_checkpoint,
)
from fastgrpo.offload.offloader import ActivationOffloader, default_offloader, release_host_memory
from fastgrpo.offload.pool import HostBufferPool, OffloadMemoryError

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
