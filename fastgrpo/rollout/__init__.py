"""Rollout engines: `generate` runs the trainer's own modules over a static KV cache; `vllm` adapts a vLLM engine."""
from fastgrpo.rollout.generate import RolloutResult, generate

__all__ = ["RolloutResult", "generate"]
