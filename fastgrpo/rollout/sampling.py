"""Sampling parameters, the logits filters and a sync-free sampler, all on static [N, V] shapes.

The filters follow HF `generate`'s order and semantics (repetition penalty, temperature, top_k, top_p, min_p), so
a user's generation config means the same thing here. Filtered tokens get -inf; every filter keeps at least the
top token. Sampling uses the exponential race, argmax(logp - log E) with E ~ Exp(1), which draws from softmax(logp)
without torch.multinomial's host sync. E comes from a counter-based hash of (row key, token position, vocabulary id)
(`keyed_exponential`, in plain int64 torch ops; on CUDA `keyed_sample` hashes it in uint32 inside the sampling
kernels): no generator state, so it is computed inside the compiled, CUDA-graphed decode step, and a sample's
randomness depends on its own key only, not on which rows share the call.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch

from fastgrpo._checks import check_int_at_least

MASK32 = 0xFFFFFFFF


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
        check_int_at_least("max_new_tokens", self.max_new_tokens, 1)
        check_int_at_least("top_k", self.top_k, 0)
        # inf would sample uniformly (temperature) or push every seen token to -inf / 0 (penalty)
        _check_number("temperature", self.temperature, "a finite number >= 0", lambda v: 0 <= v < math.inf)
        _check_number("top_p", self.top_p, "a number in (0, 1]", lambda v: 0 < v <= 1)
        _check_number("min_p", self.min_p, "a number in [0, 1]", lambda v: 0 <= v <= 1)
        _check_number("repetition_penalty", self.repetition_penalty, "a finite number > 0", lambda v: 0 < v < math.inf)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_seen_tokens(self) -> bool:
        return self.repetition_penalty != 1.0


def _check_number(name: str, value, expected: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


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
    """Raw [N, V] logits -> the logits of the sampling distribution (temperature 1 when greedy): fp32, or the raw
    logits themselves where no filter applies (keyed_sample reads them in fp32: on CUDA no fp32 copy is written)."""
    # each filter takes fp32 (.float() of fp32 is the tensor itself): with none, the raw logits come back
    if params.uses_seen_tokens:
        logits = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty)
    if not params.greedy and params.temperature != 1.0:
        logits = logits.float() / params.temperature
    if params.top_k > 0:
        logits = top_k_filter(logits.float(), params.top_k)
    if params.top_p < 1.0:
        logits = top_p_filter(logits.float(), params.top_p)
    if params.min_p > 0.0:
        logits = min_p_filter(logits.float(), params.min_p)
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


# ---- counter-based noise: 32-bit words held in int64 tensors ----
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32): split c in 16-bit halves so that no product passes 2**48 (int64
    overflow is undefined behaviour in C++ and differs between backends; these products are exact everywhere)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' lowbias32) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _fold(h: torch.Tensor, word) -> torch.Tensor:
    """Hash `word` (tensor or int in [0, 2**32)) into the running key h."""
    return mix32(((h ^ mix32(torch.as_tensor(word, dtype=torch.int64) & MASK32)) + 0x9E3779B9) & MASK32)


def row_keys(seed: int, prompt_keys: Sequence[int], num_generations: int) -> torch.Tensor:
    """The key [B * G] int64 (CPU) of each sample: a hash of (seed, its prompt's key, its index in the group).

    A sample's noise depends on these three alone, so a prompt's completions are the same whichever prompts share
    the call or the process (the trainer passes each prompt's position in the step's whole batch). Ints of any
    sign are taken mod 2**64."""
    words = [(int(k) & MASK32, (int(k) >> 32) & MASK32) for k in prompt_keys]
    lo, hi = (torch.tensor(w, dtype=torch.int64) for w in zip(*words))
    h = _fold(_fold(torch.tensor(0x2545F491), seed & MASK32), (seed >> 32) & MASK32)
    h = _fold(_fold(h, lo), hi)  # h: [B]
    return _fold(h.repeat_interleave(num_generations), torch.arange(len(words) * num_generations) % num_generations)


def step_words(keys: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two words [N] int64 in [0, 2**32) that key each row's noise for the token at output column `position`
    ([1] int64): a hash of (keys[n], position), and a second word hashed from it."""
    step_keys = _fold(keys, position)  # [N]
    second = mix32(step_keys ^ 0x85EBCA6B)  # a second word: rows whose step keys xor to a vocab key's still differ
    return step_keys, second


def keyed_uniform(keys: torch.Tensor, position: torch.Tensor, vocab_keys: torch.Tensor) -> torch.Tensor:
    """The uniforms u [N, V] in (0, 1] fp32 behind keyed_exponential's draws (-log u)."""
    step_keys, second = step_words(keys, position)
    bits = mix32(mix32(step_keys[:, None] ^ vocab_keys[None, :]) ^ second[:, None])  # bits: [N, V] in [0, 2**32)
    return ((bits >> 8).float() + 0.5) * 2.0**-24  # exact in fp32 (2**24 - 0.5 rounds to 2**24: u = 1)


def keyed_exponential(keys: torch.Tensor, position: torch.Tensor, vocab_keys: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws [N, V] fp32 for the token at output column `position` ([1] int64) of each row.

    keys: [N] from row_keys; vocab_keys: [V] = mix32(arange(V)). Element (n, v) is a hash of (keys[n], position, v):
    24 of its bits make a uniform u in (0, 1], and -log(u) is the draw. Every op is elementwise on static shapes,
    with no generator and no host sync, so it runs inside the CUDA graph.
    """
    return -torch.log(keyed_uniform(keys, position, vocab_keys))


def keyed_sample(logits: torch.Tensor, keys: torch.Tensor | None,
                 position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sample(logits.float(), keyed_exponential(keys, position, mix32(arange(V)))), greedy when keys is None: next
    tokens [N] and their fp32 log-probs [N].

    On CUDA one custom op, fastgrpo::keyed_sample (the Triton kernels of fastgrpo.kernels.sampling; the compiled
    torch ops took 123 us at 64 x 151936 on an H200, one program per row: benchmarks/bench_sampling.py times both),
    which torch.compile calls as an extern kernel and a CUDA graph captures; elsewhere the torch ops (the kernels'
    log-probs may differ from these in the last bits, and a near-tie of the two best scores resolve the other way).
    """
    if logits.is_cuda:
        words = (None, None) if keys is None else step_words(keys, position)
        return _keyed_sample_op(logits, *words)
    if keys is None:
        return sample(logits.float(), None)
    return sample(logits.float(), keyed_exponential(keys, position, _vocab_keys(logits.shape[-1], logits.device)))


@functools.lru_cache(maxsize=4)
def _vocab_keys(V: int, device: torch.device) -> torch.Tensor:
    """mix32(arange(V)), kept: hashing the vocabulary took most of a one-row CPU step at V = 151936."""
    return mix32(torch.arange(V, device=device))


def _unit_stride(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


@torch.library.custom_op("fastgrpo::keyed_sample", mutates_args=())
def _keyed_sample_op(logits: torch.Tensor, step_keys: torch.Tensor | None,
                     second: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from fastgrpo.kernels.sampling import keyed_sample as keyed_sample_kernels

    return keyed_sample_kernels(_unit_stride(logits), step_keys, second)


@_keyed_sample_op.register_fake
def _(logits, step_keys, second):
    N = logits.shape[0]
    return logits.new_empty(N, dtype=torch.int64), logits.new_empty(N, dtype=torch.float32)
