"""Boundaries of the rollout's pure functions that the other tests' random inputs never reach (found by a mutation
audit: each test below failed with one small change of the code it names): top_p's tail of mass exactly 1 - p, min_p's
threshold exactly a token's probability,
the high words of a sample's seed and prompt key, the length and longrope limits at an exact fit, vLLM's seed range.
"""
import math
from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopPLogitsWarper

from fastgrpo.rollout.kv_cache import attention_masks
from fastgrpo.rollout.requests import check_lengths
from fastgrpo.rollout.rope_limits import check_rope_switch
from fastgrpo.rollout.sampling import min_p_filter, row_keys, top_p_filter
from fastgrpo.rollout.vllm_requests import request_seeds

MASK64 = 2**64 - 1


@pytest.mark.parametrize("V, p", [(4, 0.5), (8, 0.25), (8, 0.75), (16, 0.5)])
def test_top_p_drops_a_tail_of_mass_exactly_one_minus_p_as_hf_does(V, p):
    """Uniform logits: every probability and tail mass is exact in fp32 (1/V, k/V), and 1 - p equals one of them.
    HF drops the tokens whose ascending cumulative mass is <= 1 - p: p * V tokens stay, not one more."""
    logits = torch.zeros(2, V)
    got = top_p_filter(logits, p)
    want = TopPLogitsWarper(p)(torch.zeros(2, 1, dtype=torch.long), logits.clone())
    kept = torch.isfinite(got).sum(-1)
    assert kept.tolist() == [int(p * V)] * 2, (kept, torch.isfinite(want).sum(-1))
    assert torch.equal(torch.isfinite(got).sum(-1), torch.isfinite(want).sum(-1))


@pytest.mark.parametrize("min_p", [1.0, 0.5])
def test_min_p_keeps_a_token_whose_probability_is_exactly_the_threshold_as_hf_does(min_p):
    """HF drops probabilities below min_p x the top one: at min_p = 1 every token tied with the top stays (the top
    one always does), and a token of exactly half the top's probability stays at min_p = 0.5 (exact in fp32)."""
    logits = torch.tensor([[1.0, 1.0, 0.0, -3.0], [math.log(2.0), 0.0, 0.0, -1.0]])
    got = min_p_filter(logits, min_p)
    want = MinPLogitsWarper(min_p)(torch.zeros(2, 1, dtype=torch.long), logits.clone())
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), (got, want)
    assert torch.isfinite(got).sum(-1).tolist() == ([2, 1] if min_p == 1.0 else [2, 3])


def test_sample_keys_use_all_64_bits_of_the_seed_and_the_prompt_key():
    """Keys that differ only above bit 31 (a trainer's seed drawn from 2**62, prompt keys of any int) draw other
    samples; ints of any sign are taken mod 2**64."""
    base = row_keys(5, [1], 2)
    assert not torch.equal(row_keys(5, [1 + 2**32], 2), base)
    assert not torch.equal(row_keys(5 + 2**32, [1], 2), base)
    assert torch.equal(row_keys(5, [-1], 2), row_keys(5, [MASK64], 2))
    assert torch.equal(row_keys(-3, [1], 2), row_keys(MASK64 - 2, [1], 2))


def test_a_prompt_that_exactly_fills_the_positions_is_accepted():
    config = SimpleNamespace(max_position_embeddings=10)
    check_lengths(config, [[3] * 2, [3] * 6], 4)  # 6 + 4 = 10 positions: 0..9
    with pytest.raises(ValueError, match=r"^prompts\[1\]: 7 tokens \+ max_new_tokens 4 = 11 exceeds the model's "
                                         r"max_position_embeddings 10; "):
        check_lengths(config, [[3] * 2, [3] * 7], 4)


def longrope(original: int):
    return SimpleNamespace(rope_parameters=dict(rope_type="longrope", original_max_position_embeddings=original))


def test_longrope_limit_at_an_exact_fit():
    """HF's longrope takes the long factors when a forward's sequence (max position + 1) passes the limit. A row of
    exactly `limit` tokens stays on the short ones in the trainer's forward and in every engine step: accepted. A
    prompt of exactly `limit` tokens is prefilled on the short factors and decoded past the limit on the long ones
    (HF's forward over that row: long everywhere): refused. A prompt one longer is on the long factors throughout."""
    check_rope_switch(longrope(20), [3, 12], 8)  # 12 + 8 = 20
    with pytest.raises(ValueError, match="original_max_position_embeddings'] 20: "):
        check_rope_switch(longrope(20), [3, 12], 9)
    with pytest.raises(ValueError, match="prompts of 20 to 25 tokens"):
        check_rope_switch(longrope(20), [20, 25], 4)
    check_rope_switch(longrope(20), [21, 25], 4)


def _unxorshift31(y: int) -> int:
    """The h with h ^ (h >> 31) == y (64 bits)."""
    h = y
    for _ in range(3):
        h = y ^ (h >> 31)
    return h & MASK64


def test_vllm_seeds_leave_room_for_the_group_index_at_the_top_of_the_range():
    """vLLM seeds sample g of a request with seed + g, a positive int64: every request seed must stay below
    2**62 - G. A prompt key whose hash lands on 2**62 - 1 mod 2**62 (solved for below) must not give that seed."""
    seed, G = 7, 8
    h = _unxorshift31(2**62 - 1)  # the hash before its final xorshift
    key = (h - seed * 0x9E3779B97F4A7C15) * pow(0xBF58476D1CE4E5B9, -1, 2**64) & MASK64
    (got,) = request_seeds(seed, [key], G)
    assert 0 <= got < 2**62 - G, got


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_every_prefill_query_sees_at_least_its_own_slot(implementation):
    """A left-pad query has no real key before it: the mask still shows it its own slot, so no attention row is
    empty (attention_masks' rule: an all-masked softmax row can be NaN, and a pad's NaN K/V in the next layer
    would reach the real tokens as 0 x NaN). torch 2.13's CPU SDPA returns 0 for such rows, so the engine tests
    on the CPU pass without the rule: checked on the mask itself."""
    config = SimpleNamespace(_attn_implementation=implementation, sliding_window=None)
    slots = torch.arange(5)
    visible = slots[None, :] >= torch.tensor([3, 0])[:, None]  # row 0: 3 left pads
    mask = attention_masks(config, visible, slots, slots, torch.float32)[:, 0]  # [N, Q, M]
    seen = mask if implementation == "sdpa" else mask == 0
    assert torch.equal(seen.diagonal(dim1=1, dim2=2), torch.ones(2, 5, dtype=torch.bool))
    assert torch.equal(seen[0, 4], visible[0])  # a real query sees the real keys up to it, no pad
