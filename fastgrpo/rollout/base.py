"""The rollout-engine interface: what the trainer asks of any engine (the built-in one, vLLM, ...)."""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from fastgrpo.rollout.sampling import SamplingParams


@dataclasses.dataclass
class RolloutResult:
    """N = len(prompts) x num_generations rows; the samples of prompt i are rows [i*G, (i+1)*G)."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] int64, 1 on real tokens
    completion_ids: torch.Tensor  # [N, L] right-padded with the pad id; L = the longest completion
    completion_mask: torch.Tensor  # [N, L] int64, 1 up to and including the stop token / stop string's last token
    logprobs: torch.Tensor  # [N, L] fp32 log-prob of each sampled token under the sampling distribution, 0 on pads
    texts: list[str]  # decode of the masked completion ids, special tokens skipped
    finish_reasons: list[str]  # "stop" (stop token or string) or "length"
    num_generations: int


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates completions for the trainer and shares the GPU with it.

    generate: `num_generations` samples of each prompt (texts or token id lists), rows grouped by prompt, with the
    log-prob of each sampled token under the sampling distribution. release_memory / reacquire_memory: give back
    what the engine keeps between rollouts (KV cache, graphs) for the training phase, and take it again before the
    next rollout. load_weights: make the next rollout use the model's current weights.

    prompt_keys (optional; engines written before it are called without it, see `accepts_prompt_keys`): one int
    per prompt. An engine that takes it makes sample g of a prompt a function of (seed, that key, g) alone, so
    data-parallel ranks that each generate their share of a batch sample what one process would.
    """

    def generate(self, prompts, *, num_generations: int, sampling: SamplingParams, stop=None,
                 seed: int | None = None, prompt_keys: Sequence[int] | None = None) -> RolloutResult: ...

    def release_memory(self) -> None: ...

    def reacquire_memory(self) -> None: ...

    def load_weights(self, model: torch.nn.Module) -> None: ...


def accepts_prompt_keys(engine) -> bool:
    """Whether engine.generate takes `prompt_keys` (by name or through **kwargs)."""
    try:
        params = inspect.signature(engine.generate).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "prompt_keys" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
