"""Rollout engines behind one interface (RolloutEngine): the built-in engine generates with the trainer's own
modules over a static KV cache (`generate`, `BuiltinEngine`); `fastgrpo.rollout.vllm` adapts a vLLM engine."""
from fastgrpo.rollout.base import RolloutEngine, RolloutResult
from fastgrpo.rollout.builtin import BuiltinEngine
from fastgrpo.rollout.generate import generate
from fastgrpo.rollout.sampling import SamplingParams

__all__ = ["BuiltinEngine", "RolloutEngine", "RolloutResult", "SamplingParams", "generate"]
