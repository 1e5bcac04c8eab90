"""Sampling parameters, the logits filters and a sync-free sampler, all on static [N, V] shapes.

The filters follow HF `generate`'s order and semantics (repetition penalty, temperature, top_k, top_p, min_p), so
a user's generation config means the same thing here. Filtered tokens get -inf; every filter keeps at least the
top token. Sampling uses the exponential race, argmax(logp - log E) with E ~ Exp(1), which draws from softmax(logp)
without torch.multinomial's host sync and fits inside a CUDA graph when E is drawn into a static buffer.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One generation config per call; validated on construction (ValueError naming the argument)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        _check_int("max_new_tokens", self.max_new_tokens, low=1)
        _check_int("top_k", self.top_k, low=0)
        _check_number("temperature", self.temperature, ">= 0", lambda v: v >= 0)
        _check_number("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        _check_number("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        _check_number("repetition_penalty", self.repetition_penalty, "> 0", lambda v: v > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_seen_tokens(self) -> bool:
        return self.repetition_penalty != 1.0


def _check_int(name: str, value, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")


def _check_number(name: str, value, expected: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{name}: expected a number {expected}, got {value!r}")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's rule on the tokens already seen (prompt and completion): divide positive logits, multiply negative."""
    # logits: [N, V] fp32, seen: [N, V] bool
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th)."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches p (HF: drop the tail of mass <= 1 - p)."""
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
    tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = tail_mass <= 1 - p
    drop_sorted[:, -1] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's (the top token always stays)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None) -> torch.Tensor:
    """Raw [N, V] logits -> the logits of the sampling distribution (temperature 1 when greedy)."""
    logits = logits.float()
    if params.uses_seen_tokens:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if not params.greedy and params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k > 0:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p < 1.0:
        logits = top_p_filter(logits, params.top_p)
    if params.min_p > 0.0:
        logits = min_p_filter(logits, params.min_p)
    return logits


def sample(logits: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [N] and their fp32 log-probs [N] under softmax(logits); greedy when noise is None.

    noise: [N, V] fp32 draws of Exp(1). argmax(logp - log E) is a draw from softmax(logp) (exponential race).
    """
    logp = torch.log_softmax(logits, dim=-1)
    # a draw of exactly 0 would give -inf - log(0) = nan on a filtered token, and argmax picks nan
    score = logp if noise is None else logp - noise.clamp_min(torch.finfo(noise.dtype).tiny).log()
    tokens = score.argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]
