"""The rollout's logits filters and sampler against plain per-row references (fp64) and HF's own warpers."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fastgrpo.rollout.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    keyed_exponential,
    min_p_filter,
    mix32,
    process_logits,
    row_keys,
    sample,
    top_k_filter,
    top_p_filter,
)

NEG = float("-inf")


def ref_top_k(row: list[float], k: int) -> list[float]:
    kth = sorted(row, reverse=True)[min(k, len(row)) - 1]
    return [x if x >= kth else NEG for x in row]


def ref_top_p(row: list[float], p: float) -> list[float]:
    """Keep tokens from the most likely down until the kept mass reaches p (the tail of mass <= 1 - p goes)."""
    m = max(row)
    z = sum(math.exp(x - m) for x in row)
    order = sorted(range(len(row)), key=lambda i: row[i])  # ascending
    keep, tail = set(order), 0.0
    for i in order[:-1]:
        tail += math.exp(row[i] - m) / z
        if tail <= 1 - p:
            keep.discard(i)
    return [x if i in keep else NEG for i, x in enumerate(row)]


def ref_min_p(row: list[float], min_p: float) -> list[float]:
    m = max(row)
    return [x if math.exp(x - m) >= min_p else NEG for x in row]


def ref_penalty(row: list[float], seen: set[int], penalty: float) -> list[float]:
    return [(x * penalty if x < 0 else x / penalty) if i in seen else x for i, x in enumerate(row)]


def rows_of(logits: torch.Tensor) -> list[list[float]]:
    return logits.double().tolist()


def assert_rows_equal(got: torch.Tensor, want: list[list[float]]):
    want = torch.tensor(want, dtype=torch.float64)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "different tokens filtered"
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got.double()[finite], want[finite], rtol=1e-6, atol=1e-6)


def random_logits(seed: int, n: int, v: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g, dtype=torch.float32) * scale


@given(seed=st.integers(0, 2**16), v=st.integers(2, 97), k=st.integers(1, 120), scale=st.sampled_from([0.1, 1.0, 8.0]))
def test_top_k_matches_reference(seed, v, k, scale):
    logits = random_logits(seed, 3, v, scale)
    logits[0, : v // 2] = logits[0, 0]  # ties at the k-th value must all stay
    assert_rows_equal(top_k_filter(logits, k), [ref_top_k(r, k) for r in rows_of(logits)])


@given(seed=st.integers(0, 2**16), v=st.integers(2, 97), p=st.floats(0.01, 1.0), scale=st.sampled_from([0.1, 1.0, 8.0]))
def test_top_p_matches_reference(seed, v, p, scale):
    logits = random_logits(seed, 3, v, scale)
    got = top_p_filter(logits, p)
    want = [ref_top_p(r, p) for r in rows_of(logits)]
    # fp32 cumsum vs fp64: a token whose tail mass sits within 1e-6 of 1 - p may go either way; none here
    assert_rows_equal(got, want)


@given(seed=st.integers(0, 2**16), v=st.integers(2, 97), min_p=st.floats(0.0, 1.0),
       scale=st.sampled_from([0.1, 1.0, 8.0]))
def test_min_p_matches_reference(seed, v, min_p, scale):
    logits = random_logits(seed, 3, v, scale)
    assert_rows_equal(min_p_filter(logits, min_p), [ref_min_p(r, min_p) for r in rows_of(logits)])


@given(seed=st.integers(0, 2**16), v=st.integers(2, 97), penalty=st.floats(0.5, 3.0))
def test_repetition_penalty_matches_reference(seed, v, penalty):
    logits = random_logits(seed, 3, v, 2.0)
    g = torch.Generator().manual_seed(seed + 1)
    seen = torch.rand(3, v, generator=g) < 0.3
    want = [ref_penalty(r, set(s.nonzero()[:, 0].tolist()), penalty) for r, s in zip(rows_of(logits), seen)]
    assert_rows_equal(apply_repetition_penalty(logits, seen, penalty), want)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05, repetition_penalty=1.3),
        SamplingParams(temperature=1.5, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.0, min_p=0.2, repetition_penalty=0.8),
    ],
)
def test_process_logits_equals_hf_warpers_in_hf_order(params):
    torch.manual_seed(0)
    V = 50
    logits = torch.randn(4, V) * 3
    history = torch.randint(0, V, (4, 7))
    seen = torch.zeros(4, V, dtype=torch.bool).scatter_(1, history, True)
    want = logits.clone()
    if params.repetition_penalty != 1:
        want = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(history, want)
    warpers = [] if params.greedy else [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    for w in warpers:
        want = w(history, want)
    got = process_logits(logits, params, seen)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0)])
def test_process_logits_passes_raw_logits_through_where_no_filter_applies(params):
    """No filter, temperature 1 (or greedy): the model's bf16 logits themselves, no fp32 copy (on CUDA the sampling
    kernels read them in fp32); any filter: fp32."""
    logits = torch.randn(2, 9).bfloat16()
    assert process_logits(logits, params, None) is logits
    assert process_logits(logits, SamplingParams(temperature=0.9), None).dtype == torch.float32


def test_greedy_sample_is_argmax_with_log_softmax_logprobs():
    torch.manual_seed(1)
    logits = torch.randn(5, 40)
    tokens, logp = sample(logits, None)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logp.double(), logits.double().log_softmax(-1).gather(1, tokens[:, None])[:, 0])


def test_exponential_race_draws_from_softmax():
    """50k draws over 6 tokens (one filtered): frequencies within 5 sigma of softmax, never the filtered token."""
    g = torch.Generator().manual_seed(2)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, NEG, 0.5])
    n = 50_000
    noise = torch.empty(n, 6).exponential_(generator=g)
    tokens, logp = sample(logits.expand(n, 6), noise)
    probs = logits.double().softmax(-1)
    freq = torch.bincount(tokens, minlength=6).double() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert freq[4] == 0
    assert torch.all((freq - probs).abs() <= 5 * sigma + 1e-12), (freq, probs)
    torch.testing.assert_close(logp.double(), probs.log()[tokens], rtol=1e-6, atol=1e-6)


def test_zero_noise_never_picks_a_filtered_token():
    logits = torch.tensor([[0.0, NEG, 1.0]])
    tokens, logp = sample(logits, torch.tensor([[1.0, 0.0, 1.0]]))
    assert tokens.item() == 2 and torch.isfinite(logp).all()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_is_lowbias32_exactly():
    """The int64 torch ops give the 32-bit hash's exact bits (no product overflows), also at the extremes."""
    xs = torch.cat([torch.randint(0, 2**32, (20_000,), generator=torch.Generator().manual_seed(0)),
                    torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1])])
    assert mix32(xs).tolist() == [lowbias32(x) for x in xs.tolist()]


def test_keyed_race_draws_from_softmax():
    """The exponential race on keyed noise: 60k draws (rows x positions) within 5 sigma of softmax, never the
    filtered token; draws of different rows and positions are independent enough to pass the same bound."""
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, NEG, 0.5])
    keys, vocab = row_keys(11, range(2000), 6), mix32(torch.arange(6))
    tokens = torch.cat([sample(logits.expand(len(keys), 6), keyed_exponential(keys, torch.tensor([t]), vocab))[0]
                        for t in range(5)])
    n = tokens.numel()
    probs = logits.double().softmax(-1)
    freq = torch.bincount(tokens, minlength=6).double() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert freq[4] == 0
    assert torch.all((freq - probs).abs() <= 5 * sigma + 1e-12), (freq, probs)


def test_keyed_noise_is_a_function_of_the_sample_key_alone():
    """A sample's noise depends on (seed, prompt key, index in group, position) only: the same key in another call
    (another batch, another prompt order) draws the same; another seed, key, index or position draws differently."""
    vocab = mix32(torch.arange(40))
    pos = torch.tensor([3])
    both = keyed_exponential(row_keys(5, [10, 20], 3), pos, vocab)  # rows: 10/0, 10/1, 10/2, 20/0, 20/1, 20/2
    alone = keyed_exponential(row_keys(5, [20], 3), pos, vocab)
    assert torch.equal(both[3:], alone)
    assert torch.equal(keyed_exponential(row_keys(5, [20, 10], 3), pos, vocab)[3:], both[:3])
    others = [keyed_exponential(row_keys(6, [20], 3), pos, vocab), keyed_exponential(row_keys(5, [21], 3), pos, vocab),
              keyed_exponential(row_keys(5, [20], 3), torch.tensor([4]), vocab)]
    for other in others:
        assert not torch.isclose(other, alone).any(dim=1).all()
    assert len({tuple(row.tolist()) for row in alone}) == 3  # the samples of a group differ
    assert torch.all(alone > 0) and torch.all(torch.isfinite(alone))
