"""fastgrpo: fused Triton kernels and a small trainer for GRPO post-training on one GPU.

The public names below are imported on first use, so `import fastgrpo` stays cheap and has no side effects.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "fused_linear_logprobs": "fastgrpo.ops.fused_linear",
    "fused_linear_grpo_loss": "fastgrpo.loss.fused",
    "GRPOLossConfig": "fastgrpo.loss.config",
    "patch_model": "fastgrpo.patching",
    "unpatch_model": "fastgrpo.patching",
    "grpo_loss": "fastgrpo.loss.model",
    "sequence_logprobs": "fastgrpo.loss.model",
    "offload_checkpoint": "fastgrpo.offload",
    "enable_offload_checkpointing": "fastgrpo.offload",
    "disable_offload_checkpointing": "fastgrpo.offload",
    "tiled_mlp": "fastgrpo.ops.tiled_mlp",
    "generate": "fastgrpo.rollout",
    "RolloutResult": "fastgrpo.rollout",
    "RolloutEngine": "fastgrpo.rollout",
    "BuiltinEngine": "fastgrpo.rollout",
    "AdaptiveKLController": "fastgrpo.train.kl_control",
    "compute_group_normalized_rewards": "fastgrpo.course",
    "GRPOConfig": "fastgrpo.train.config",
    "GRPOTrainer": "fastgrpo.train.trainer",
    "sft_loss": "fastgrpo.loss.sft",
    "SFTConfig": "fastgrpo.train.sft_config",
    "SFTTrainer": "fastgrpo.train.sft",
    "EIConfig": "fastgrpo.train.ei_config",
    "ExpertIteration": "fastgrpo.train.expert_iteration",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'fastgrpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
