"""The built-in engine: generates with the trainer's own modules (no second copy of the weights)."""
from __future__ import annotations

import torch

from fastgrpo.rollout.base import RolloutResult
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams


class BuiltinEngine:
    """fastgrpo's RolloutEngine over the model the trainer trains: the KV cache, buffers and CUDA graph of a call
    are freed when it returns, and the weights are the model's own (a decode copy, EngineConfig.weights, is freed
    with the call), so there is nothing to release or to load."""

    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig = EngineConfig()) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config

    def generate(self, prompts, *, num_generations: int, sampling: SamplingParams, stop=None,
                 seed: int | None = None, prompt_keys=None) -> RolloutResult:
        return generate_with_config(self.model, self.tokenizer, prompts, num_generations, sampling, stop=stop,
                                    seed=seed, prompt_keys=prompt_keys, config=self.config)

    def release_memory(self) -> None:
        """Nothing is kept between calls."""

    def reacquire_memory(self) -> None:
        """Nothing is kept between calls."""

    def load_weights(self, model: torch.nn.Module) -> None:
        if model is not self.model:
            raise ValueError("model: the built-in engine generates with the model it was built on; build another "
                             "BuiltinEngine for a different model")
