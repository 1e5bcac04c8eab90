"""The CUDA caching allocator's setting fastgrpo's commands start with: expandable segments.

A GRPO step allocates in two patterns, the rollout's (KV cache, decode buffers) and the update's (activations,
gradients). With fixed-size segments the caching allocator keeps the rollout's cached segments where the update's
tensors do not fit them and reserves new ones beside them; expandable segments grow and shrink one mapping instead.
Measured on an H200 (bench_loop, Qwen2.5-1.5B LoRA, 64 x (256 + 1024), recompute_layers=20): the card's peak was
14.3 GiB for 9.9 GiB that torch ever had allocated, and 11.0 GiB with expandable segments.

The variable is read at the process's first CUDA allocation, so commands set it right after parsing their
config. A PYTORCH_CUDA_ALLOC_CONF of the user's own is left as it is, and vLLM as the engine gets none: its
sleep-mode memory pool refuses expandable segments.
"""
from __future__ import annotations

import os

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def allocator_env(rollout_engine: str = "builtin") -> dict[str, str]:
    """The variables a fastgrpo process adds to its environment: none where the user set their own or vLLM runs."""
    if rollout_engine == "vllm" or ALLOC_CONF in os.environ:
        return {}
    return {ALLOC_CONF: EXPANDABLE_SEGMENTS}


def use_expandable_segments(rollout_engine: str = "builtin") -> None:
    """Set allocator_env(rollout_engine) in this process's environment (before its first CUDA allocation)."""
    os.environ.update(allocator_env(rollout_engine))
