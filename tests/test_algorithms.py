"""fastgrpo.loss.grpo, fastgrpo.course and the KL controller against hand computations in fp64, on the CPU."""
import math
import statistics

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo import course
from fastgrpo.loss import config as loss_config
from fastgrpo.loss import grpo
from fastgrpo.train.kl_control import AdaptiveKLController

f64 = torch.float64
PG_LOSS_TYPES = ["no_baseline", "reinforce_with_baseline", "grpo_clip"]


def lookup_reward_fn(rewards, extra=None):
    """reward_fn over responses named by their index: response "i" gets rewards[i]."""

    def reward_fn(response, ground_truth):
        score = {"reward": rewards[int(response)]}
        if extra is not None:
            score.update(extra(int(response)))
        return score

    return reward_fn


def group_rewards(rewards, group_size, normalize_by_std, eps=1e-6, extra=None):
    n = len(rewards)
    return course.compute_group_normalized_rewards(
        lookup_reward_fn(rewards, extra), [str(i) for i in range(n)], ["gt"] * n, group_size, eps, normalize_by_std
    )


# Quarter-integers are exact in fp32, so the hand computation in fp64 differs only by rounding.
quarter = st.integers(-20, 20).map(lambda k: k / 4)
reward_groups = st.integers(2, 6).flatmap(
    lambda g: st.tuples(st.just(g), st.lists(quarter, min_size=g, max_size=4 * g).filter(lambda r: len(r) % g == 0))
)


# --- Group-normalized rewards ------------------------------------------------------------------------------------


@given(reward_groups, st.booleans())
def test_advantages_sum_to_zero_within_every_group(groups, normalize_by_std):
    group_size, rewards = groups
    advantages, raw, _ = group_rewards(rewards, group_size, normalize_by_std)
    assert advantages.shape == raw.shape == (len(rewards),)
    assert raw.tolist() == rewards
    sums = advantages.view(-1, group_size).sum(-1)
    torch.testing.assert_close(sums, torch.zeros_like(sums), atol=1e-5, rtol=0)


@given(reward_groups, st.sampled_from([1e-6, 0.1]))
def test_advantages_match_a_hand_computation(groups, eps):
    group_size, rewards = groups
    normalized, _, meta = group_rewards(rewards, group_size, True, eps)
    centered, _, _ = group_rewards(rewards, group_size, False, eps)
    want_normalized, want_centered, zero_std = [], [], 0
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean, std = statistics.mean(group), statistics.stdev(group)  # stdev: Bessel's correction
        want_centered += [r - mean for r in group]
        want_normalized += [(r - mean) / (std + eps) for r in group]
        zero_std += std == 0
    torch.testing.assert_close(centered.double(), torch.tensor(want_centered, dtype=f64), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normalized.double(), torch.tensor(want_normalized, dtype=f64), rtol=1e-5, atol=1e-5)
    assert meta["frac_zero_std_groups"] == pytest.approx(zero_std / (len(rewards) // group_size))
    assert meta["reward_mean"] == pytest.approx(statistics.mean(rewards), abs=1e-5)
    assert meta["reward_std"] == pytest.approx(statistics.stdev(rewards), abs=1e-5)
    assert (meta["reward_max"], meta["reward_min"]) == (max(rewards), min(rewards))


def test_group_rewards_metadata_averages_the_other_reward_keys():
    extra = lambda i: {"format_reward": float(i % 2), "answer_reward": float(i == 3)}  # noqa: E731
    _, _, meta = group_rewards([0.0, 1.0, 1.0, 1.0], 2, False, extra=extra)
    assert meta["format_reward_mean"] == 0.5
    assert meta["answer_reward_mean"] == 0.25
    assert meta["frac_zero_std_groups"] == 0.5


# --- KL estimators -----------------------------------------------------------------------------------------------

small_logits = st.integers(2, 8).flatmap(
    lambda v: st.tuples(*(st.lists(st.floats(-4, 4), min_size=v, max_size=v) for _ in range(2)))
)


@given(small_logits)
def test_kl_estimators_against_closed_forms_on_a_small_vocab(logits):
    # Every token x of the vocab, weighted by p(x): the exact expectation of each estimator under the policy.
    logp = torch.log_softmax(torch.tensor(logits[0], dtype=f64), -1)
    ref = torch.log_softmax(torch.tensor(logits[1], dtype=f64), -1)
    p, q = logp.exp(), ref.exp()
    exact_kl = torch.distributions.kl_divergence(
        torch.distributions.Categorical(probs=p), torch.distributions.Categorical(probs=q)
    )
    k1, k2, k3 = (grpo.kl_penalty(logp, ref, e) for e in ("k1", "k2", "k3"))
    torch.testing.assert_close((p * k1).sum(), exact_kl, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close((p * k3).sum(), exact_kl, rtol=1e-9, atol=1e-12)  # unbiased: sum q = 1
    torch.testing.assert_close((p * k2).sum(), 0.5 * (p * torch.log(p / q) ** 2).sum(), rtol=1e-9, atol=1e-12)
    ratio = q / p
    torch.testing.assert_close(k3, ratio - 1 - torch.log(ratio), rtol=1e-9, atol=1e-12)
    assert bool((k2 >= 0).all()) and bool((k3 >= 0).all())


def test_k2_is_kl_to_second_order_for_nearby_policies():
    logits = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7], dtype=f64)
    direction = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], dtype=f64)
    for step in (1e-2, 1e-3):
        logp, ref = torch.log_softmax(logits, -1), torch.log_softmax(logits + step * direction, -1)
        p = logp.exp()
        exact = (p * (logp - ref)).sum()
        k2 = (p * grpo.kl_penalty(logp, ref, "k2")).sum()
        assert abs(k2 - exact) / exact < 10 * step  # the cubic term is the first that differs


@given(st.lists(st.tuples(st.floats(-40, 0), st.floats(-40, 0)), min_size=1, max_size=20))
def test_k3_is_nonnegative(pairs):
    for dtype in (torch.float32, f64):
        logp, ref = (torch.tensor(column, dtype=dtype) for column in zip(*pairs))
        assert bool((grpo.kl_penalty(logp, ref, "k3") >= 0).all())


# --- Masked reductions and aggregations ------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], dtype=f64)


@pytest.mark.parametrize(
    "mask, loss_type, kwargs, want",
    [
        ([[1, 1, 0, 0], [1, 1, 1, 0]], "grpo", {}, (3 / 2 + 18 / 3) / 2),
        ([[1, 1, 0, 0], [1, 1, 1, 0]], "bnpo", {}, 21 / 5),
        ([[1, 1, 0, 0], [1, 1, 1, 0]], "dr_grpo", {"max_completion_length": 4}, 21 / (2 * 4)),
        ([[1, 1, 0, 0], [1, 1, 1, 0]], "dr_grpo", {"max_completion_length": 10}, 21 / (2 * 10)),
        ([[1, 1, 0, 0], [1, 1, 1, 0]], "dapo", {}, 21 / 5),
        ([[1, 1, 0, 0], [1, 1, 1, 0]], "dapo", {"num_items_in_batch": 12}, 21 / 12),
        ([[0, 0, 0, 0], [1, 1, 1, 0]], "grpo", {}, (0 + 18 / 3) / 2),  # an empty row counts as 0, not nan
        ([[0, 0, 0, 0], [1, 1, 1, 0]], "bnpo", {}, 18 / 3),
        ([[0, 0, 0, 0], [0, 0, 0, 0]], "bnpo", {}, 0.0),
        ([[0, 0, 0, 1], [1, 0, 0, 1]], "grpo", {}, (4 + 13 / 2) / 2),
    ],
)
def test_aggregations_on_hand_made_cases(mask, loss_type, kwargs, want):
    for dtype in (torch.bool, torch.int64, f64):
        got = grpo.aggregate_loss(LOSS, torch.tensor(mask).to(dtype), loss_type, **kwargs)
        assert got.item() == pytest.approx(want, rel=1e-12)


@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_masked_mean_and_normalize_match_loops(rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=gen, dtype=f64)
    mask = torch.rand(rows, cols, generator=gen) < 0.6
    mask[0, 0] = True
    kept = [[values[i, j].item() if mask[i, j] else None for j in range(cols)] for i in range(rows)]
    flat = [v for row in kept for v in row if v is not None]
    assert grpo.masked_mean(values, mask).item() == pytest.approx(sum(flat) / len(flat), rel=1e-12)
    assert grpo.masked_normalize(values, mask, normalize_constant=3.0).item() == pytest.approx(sum(flat) / 3)
    row_sums = grpo.masked_normalize(values, mask, dim=-1, normalize_constant=2.0)
    want = [sum(v for v in row if v is not None) / 2 for row in kept]
    torch.testing.assert_close(row_sums, torch.tensor(want, dtype=f64), rtol=1e-12, atol=1e-12)
    col_means = grpo.masked_mean(values, mask, dim=0)
    for j in range(cols):
        col = [kept[i][j] for i in range(rows) if kept[i][j] is not None]
        assert math.isnan(col_means[j]) if not col else col_means[j].item() == pytest.approx(sum(col) / len(col))


def test_masked_reductions_ignore_non_finite_values_at_masked_positions():
    values = torch.tensor([[1.0, -math.inf, math.nan], [2.0, 4.0, math.inf]], requires_grad=True)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    assert grpo.masked_mean(values, mask).item() == pytest.approx(7 / 3)
    torch.testing.assert_close(grpo.masked_normalize(values, mask, dim=1), torch.tensor([1.0, 6.0]))
    grpo.masked_mean(values, mask).backward()
    torch.testing.assert_close(values.grad, mask.float() / 3)


# --- Prompt-only padding ---------------------------------------------------------------------------------------


def pad_left(tensor, width, fill):
    return torch.cat([fill(tensor.shape[0], width).to(tensor.dtype), tensor], dim=1)


@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_prompt_only_padding_leaves_loss_and_kl_unchanged(rows, cols, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, cols, generator=gen, dtype=f64) * 3
    old = logp + 0.3 * torch.randn(rows, cols, generator=gen, dtype=f64)
    ref = logp + 0.3 * torch.randn(rows, cols, generator=gen, dtype=f64)
    mask = torch.rand(rows, cols, generator=gen) < 0.7
    mask[0, 0] = True
    advantages = torch.randn(rows, 1, generator=gen, dtype=f64)
    # Prompt positions hold arbitrary log-probs (here up to -20): only the mask may decide they do not count.
    garbage = lambda b, w: -20 * torch.rand(b, w, generator=gen, dtype=f64)  # noqa: E731
    padded = {
        "logp": pad_left(logp, pad, garbage),
        "old": pad_left(old, pad, garbage),
        "ref": pad_left(ref, pad, garbage),
        "mask": pad_left(mask, pad, lambda b, w: torch.zeros(b, w, dtype=torch.bool)),
    }
    kl = grpo.masked_mean(grpo.kl_penalty(logp, ref, "k3"), mask)
    kl_padded = grpo.masked_mean(grpo.kl_penalty(padded["logp"], padded["ref"], "k3"), padded["mask"])
    torch.testing.assert_close(kl_padded, kl, rtol=1e-12, atol=1e-12)
    for loss_type in PG_LOSS_TYPES:
        results = []
        for inputs in ({"logp": logp, "old": old, "mask": mask}, padded):
            leaf = inputs["logp"].clone().requires_grad_()
            per_token, _ = course.compute_policy_gradient_loss(
                leaf, loss_type, advantages, advantages, inputs["old"], 0.2
            )
            aggregated = [
                grpo.aggregate_loss(per_token, inputs["mask"], agg, max_completion_length=16)
                for agg in loss_config.LOSS_TYPES
            ]
            step_loss, _ = course.grpo_microbatch_train_step(
                leaf, inputs["mask"], 2, loss_type, advantages, advantages, inputs["old"], 0.2
            )
            results.append((torch.stack(aggregated + [step_loss]), leaf.grad))
        (losses, grad), (losses_padded, grad_padded) = results
        torch.testing.assert_close(losses_padded, losses, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad_padded[:, pad:], grad, rtol=1e-12, atol=1e-12)
        assert bool((grad_padded[:, :pad] == 0).all())


# --- Policy-gradient losses ------------------------------------------------------------------------------------


def test_grpo_clip_loss_on_known_ratios():
    # Tokens: ratios 0.5, 1.0, 1.5 for A = +1 (row 0) and A = -1 (row 1), cliprange 0.2.
    ratios = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]], dtype=f64)
    old = torch.full_like(ratios, -1.0)
    logp = (old + ratios.log()).requires_grad_()
    advantages = torch.tensor([[1.0], [-1.0]], dtype=f64)
    loss, meta = course.compute_grpo_clip_loss(advantages, logp, old, 0.2)
    want = torch.tensor([[-0.5, -1.0, -1.2], [0.8, 1.0, 1.5]], dtype=f64)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    assert meta["clipped"].tolist() == [[False, False, True], [True, False, False]]
    assert meta["clipped_high"].tolist() == [[False, False, True], [False, False, False]]
    assert meta["clipped_low"].tolist() == [[False, False, False], [True, False, False]]
    torch.testing.assert_close(meta["ratio"], ratios, rtol=1e-12, atol=1e-12)
    loss.sum().backward()
    # d(-r A)/dlogp = -r A on the unclipped branch; the clipped branch has no gradient.
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]], dtype=f64))


@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_policy_gradient_losses_match_their_formulas(rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, cols, generator=gen, dtype=f64) * 3
    old = logp + 0.4 * torch.randn(rows, cols, generator=gen, dtype=f64)
    rewards, advantages = torch.rand(rows, 1, generator=gen, dtype=f64), torch.randn(rows, 1, generator=gen, dtype=f64)
    naive, meta = course.compute_policy_gradient_loss(logp, "no_baseline", raw_rewards=rewards)
    torch.testing.assert_close(naive, -rewards * logp)
    assert meta == {}
    baseline, _ = course.compute_policy_gradient_loss(logp, "reinforce_with_baseline", advantages=advantages)
    torch.testing.assert_close(baseline, -advantages * logp)
    clip, _ = course.compute_policy_gradient_loss(
        logp, "grpo_clip", advantages=advantages, old_log_probs=old, cliprange=0.1
    )
    ratio = torch.exp(logp - old)
    want = -torch.minimum(ratio * advantages, ratio.clamp(0.9, 1.1) * advantages)
    torch.testing.assert_close(clip, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(course.compute_naive_policy_gradient_loss(advantages.view(-1), logp), baseline)


# --- Microbatch train steps ------------------------------------------------------------------------------------


def test_sft_microbatch_step_matches_its_formula_and_accumulates():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -4.0]], dtype=f64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    loss, meta = course.sft_microbatch_train_step(logp, mask, gradient_accumulation_steps=4, normalize_constant=2.0)
    assert loss.item() == pytest.approx(((1 + 2) / 2 + (0.25 + 4) / 2) / 2 / 4)
    assert meta["response_tokens"].item() == 4
    once = -mask.to(f64) / (2.0 * 2 * 4)  # -1 / (normalize_constant * B * gradient_accumulation_steps)
    torch.testing.assert_close(logp.grad, once)
    course.sft_microbatch_train_step(logp, mask, gradient_accumulation_steps=4, normalize_constant=2.0)
    torch.testing.assert_close(logp.grad, 2 * once)


@pytest.mark.parametrize("loss_type", PG_LOSS_TYPES)
def test_grpo_microbatch_steps_accumulate_like_one_full_batch(loss_type):
    gen = torch.Generator().manual_seed(0)
    rows, cols = 6, 5
    theta = (-torch.rand(rows, cols, generator=gen, dtype=f64) * 2).requires_grad_()
    old = theta.detach() + 0.3 * torch.randn(rows, cols, generator=gen, dtype=f64)
    mask = torch.rand(rows, cols, generator=gen) < 0.7
    mask[:, 0] = True
    rewards = torch.rand(rows, 1, generator=gen, dtype=f64)
    advantages = rewards - rewards.mean()
    # Two microbatches of 3 with gradient_accumulation_steps=2 == one batch of 6 with 1.
    total = 0.0
    for part in (slice(0, 3), slice(3, 6)):
        loss, _ = course.grpo_microbatch_train_step(
            theta[part], mask[part], 2, loss_type, rewards[part], advantages[part], old[part], 0.2
        )
        total += loss.item()
    accumulated = theta.grad.clone()
    theta.grad = None
    full, _ = course.grpo_microbatch_train_step(theta, mask, 1, loss_type, rewards, advantages, old, 0.2)
    torch.testing.assert_close(accumulated, theta.grad, rtol=1e-12, atol=1e-14)
    assert total == pytest.approx(full.item(), rel=1e-12)
    per_token, _ = course.compute_policy_gradient_loss(theta.detach(), loss_type, rewards, advantages, old, 0.2)
    assert full.item() == pytest.approx(grpo.masked_mean(per_token, mask, dim=-1).mean().item(), rel=1e-12)
    if loss_type == "reinforce_with_baseline":
        want = -advantages * mask / (mask.sum(-1, keepdim=True) * rows)
        torch.testing.assert_close(theta.grad, want, rtol=1e-12, atol=1e-14)


def test_grpo_microbatch_step_reports_the_clip_fraction():
    logp = torch.tensor([[0.0, 0.0, 0.0]], dtype=f64, requires_grad=True)
    old = torch.tensor([[0.0, -1.0, -1.0]], dtype=f64)  # ratios 1, e, e: both e's clip for A > 0
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    _, meta = course.grpo_microbatch_train_step(logp, mask, 1, "grpo_clip", advantages=torch.ones(1, 1, dtype=f64),
                                             old_log_probs=old, cliprange=0.2)
    assert meta["clip_fraction"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("loss_type", PG_LOSS_TYPES)
def test_toy_length_reward_pushes_longer_completions_up(loss_type):
    """reward = min(length, cap); one gradient step raises the log-probs of the longer completions."""
    cap, lengths = 4, [1, 2, 3, 5, 6, 2]
    # A one-parameter-pair policy: each step emits "continue" (index 0) or "stop" (index 1) with shared logits.
    theta = torch.zeros(2, dtype=f64, requires_grad=True)
    tokens = torch.ones(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for row, n in enumerate(lengths):
        tokens[row, : n - 1] = 0  # n - 1 continues, then a stop
        mask[row, :n] = True
    responses = ["x" * n for n in lengths]
    advantages, raw, _ = course.compute_group_normalized_rewards(
        lambda response, _: {"reward": float(min(len(response), cap))}, responses, [""] * len(lengths),
        group_size=len(lengths), advantage_eps=1e-6, normalize_by_std=True,
    )
    assert raw.tolist() == [1.0, 2.0, 3.0, 4.0, 4.0, 2.0]

    def sequence_logp(params):
        return torch.log_softmax(params, -1)[tokens].masked_fill(~mask, 0.0)  # [B, T]

    logp = sequence_logp(theta)
    logp.retain_grad()
    course.grpo_microbatch_train_step(
        logp, mask, 1, loss_type, raw_rewards=raw.view(-1, 1).double(), advantages=advantages.view(-1, 1).double(),
        old_log_probs=logp.detach(), cliprange=0.2,
    )
    if loss_type != "no_baseline":
        # Per token: the loss falls where log-probs rise exactly for the above-average (longer) completions.
        assert torch.equal(torch.sign(-logp.grad[mask]), torch.sign(advantages.view(-1, 1).expand_as(mask)[mask]))
    with torch.no_grad():
        stepped = theta - 0.5 * theta.grad
        gain = (sequence_logp(stepped) - sequence_logp(theta)).sum(-1)  # change of each sequence's log-prob
        assert gain[lengths.index(6)] > 0 > gain[lengths.index(1)]
        assert torch.softmax(stepped, -1)[0] > 0.5  # "continue" became likelier


# --- Entropy, tokenization and log-probs of a tiny real model --------------------------------------------------


@given(st.integers(1, 3), st.integers(2, 9), st.integers(0, 2**31 - 1), st.sampled_from([0.1, 1.0, 30.0]))
def test_compute_entropy_matches_the_definition(rows, vocab, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(rows, 2, vocab, generator=gen, dtype=f64)
    p = torch.softmax(logits, -1)
    want = -(p * torch.log(p)).nan_to_num().sum(-1)  # nan_to_num: 0 * log 0
    got = course.compute_entropy(logits)
    assert got.shape == (rows, 2) and got.dtype == f64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    shifted = (logits + 1e4).float()  # fp32 would overflow exp(1e4) in a naive softmax
    torch.testing.assert_close(course.compute_entropy(shifted).double(), course.compute_entropy(shifted.double()),
                               rtol=1e-4, atol=1e-5)


def test_compute_entropy_edge_cases():
    assert course.compute_entropy(torch.zeros(7)).item() == pytest.approx(math.log(7))
    logits = torch.tensor([0.0, 0.0, -math.inf], requires_grad=True)
    entropy = course.compute_entropy(logits)
    assert entropy.item() == pytest.approx(math.log(2))
    entropy.backward()
    assert bool(torch.isfinite(logits.grad).all())
    assert course.compute_entropy(torch.tensor([1e4, 0.0])).item() == 0.0
    assert course.compute_entropy(torch.zeros(2, 3, dtype=torch.bfloat16)).dtype == torch.float32


CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 +=?.")


def char_tokenizer(with_pad=True):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    # BPE without merges = one token per character.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    pad = {"pad_token": "<pad>"} if with_pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>", **pad)


def char_ids(text):
    return [CHARS.index(c) + 3 for c in text]


def test_tokenize_prompt_and_output_layout():
    out = course.tokenize_prompt_and_output(["12+1=", "ab", "z"], ["13", "cde", ""], char_tokenizer())
    rows = [char_ids("12+1=13"), char_ids("abcde") + [0, 0], char_ids("z") + [0] * 6]
    full = torch.tensor(rows)
    assert set(out) == {"input_ids", "labels", "response_mask"}
    assert torch.equal(out["input_ids"], full[:, :-1]) and torch.equal(out["labels"], full[:, 1:])
    assert out["response_mask"].dtype == torch.bool
    assert out["response_mask"].tolist() == [
        [False, False, False, False, True, True],
        [False, True, True, True, False, False],
        [False] * 6,
    ]
    no_pad = course.tokenize_prompt_and_output(["ab"], ["c"], char_tokenizer(with_pad=False))
    longer = course.tokenize_prompt_and_output(["ab", "abcd"], ["c", "e"], char_tokenizer(with_pad=False))
    assert no_pad["labels"].tolist() == [char_ids("bc")]
    assert longer["labels"][0].tolist() == char_ids("bc") + [1, 1]  # padded with eos


def tiny_llama(vocab_size):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def test_get_response_log_probs_of_a_tiny_llama():
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer))
    alone = course.tokenize_prompt_and_output(["1+1="], ["2"], tokenizer)
    batch = course.tokenize_prompt_and_output(["1+1=", "what is 12+30?"], ["2", " 42."], tokenizer)
    with torch.no_grad():
        out = course.get_response_log_probs(model, batch["input_ids"], batch["labels"], return_token_entropy=True)
        logits = model(batch["input_ids"]).logits.double()
        single = course.get_response_log_probs(model, alone["input_ids"], alone["labels"])
    assert out["log_probs"].shape == out["token_entropy"].shape == batch["labels"].shape
    want = torch.log_softmax(logits, -1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out["log_probs"].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["token_entropy"].double(), course.compute_entropy(logits), rtol=1e-5, atol=1e-5)
    assert "token_entropy" not in single
    # Row 0 gains right padding in the batch; its response log-probs and SFT loss must not move.
    width = alone["labels"].shape[1]
    mask = alone["response_mask"]
    torch.testing.assert_close(out["log_probs"][:1, :width][mask], single["log_probs"][mask], rtol=1e-5, atol=1e-6)
    sft = grpo.masked_normalize(-single["log_probs"], mask, dim=-1)
    sft_batch = grpo.masked_normalize(-out["log_probs"], batch["response_mask"], dim=-1)[:1]
    torch.testing.assert_close(sft_batch, sft, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="labels"):
        course.get_response_log_probs(model, batch["input_ids"], batch["labels"] + len(tokenizer))
    with pytest.raises(ValueError, match="labels"):
        course.get_response_log_probs(model, batch["input_ids"], batch["labels"][:, 1:])


# --- Adaptive KL ---------------------------------------------------------------------------------------------


def test_adaptive_kl_controller_follows_its_update_rule():
    controller = AdaptiveKLController(init_beta=0.1, target_kl=0.05)
    assert controller.beta == 0.1
    assert controller.update(0.06) == pytest.approx(0.1 * math.exp(0.2))  # error 0.2: at the bound
    assert controller.update(torch.tensor(0.055)) == pytest.approx(0.1 * math.exp(0.2) * math.exp(0.1))
    beta = controller.beta
    assert controller.update(1.0) == pytest.approx(beta * math.exp(0.2))  # error 19: clipped
    beta = controller.beta
    assert controller.update(0.0) == pytest.approx(beta * math.exp(-0.2))  # error -1: clipped
    assert controller.update(0.05) == pytest.approx(beta * math.exp(-0.2))  # on target: unchanged


# --- Bad input -------------------------------------------------------------------------------------------------

X = torch.zeros(2, 3)
BAD_MASKS = {
    "fractional": torch.full((2, 3), 0.5),
    "integer two": torch.full((2, 3), 2, dtype=torch.int64),
    "complex": torch.ones(2, 3, dtype=torch.complex64),
    "shape": torch.ones(2, 4, dtype=torch.bool),
}


@pytest.mark.parametrize("bad", BAD_MASKS)
@pytest.mark.parametrize(
    "call, name",
    [
        (lambda m: grpo.masked_mean(X, m), "mask"),
        (lambda m: grpo.masked_normalize(X, m, dim=-1), "mask"),
        (lambda m: grpo.aggregate_loss(X, m, "grpo"), "mask"),
        (lambda m: course.sft_microbatch_train_step(X.requires_grad_(), m, 1), "response_mask"),
        (lambda m: course.grpo_microbatch_train_step(X, m, 1, "no_baseline", raw_rewards=torch.ones(2, 1)),
         "response_mask"),
    ],
)
def test_bad_masks_raise_naming_the_argument(call, name, bad):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        call(BAD_MASKS[bad])


def pg(**kwargs):
    args = {"policy_log_probs": X, "loss_type": "grpo_clip", "raw_rewards": torch.ones(2, 1),
            "advantages": torch.ones(2, 1), "old_log_probs": X, "cliprange": 0.2}
    return course.compute_policy_gradient_loss(**{**args, **kwargs})


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: group_rewards([0.0, 1.0, 2.0, 3.0], 3, False), "group_size"),
        (lambda: group_rewards([0.0, 1.0], 0, False), "group_size"),
        (lambda: group_rewards([0.0, 1.0], 1, True), "group_size"),
        (lambda: course.compute_group_normalized_rewards(lookup_reward_fn([1.0]), ["0"], [], 1, 1e-6, False),
         "repeated_ground_truths"),
        (lambda: course.compute_group_normalized_rewards(lambda r, g: {"score": 1.0}, ["0"], ["g"], 1, 1e-6, False),
         "reward_fn"),
        (lambda: group_rewards([0.0, math.nan], 2, True), "reward_fn"),  # a NaN would make the group's advantages NaN
        (lambda: group_rewards([math.inf, 1.0], 2, False), "reward_fn"),
        (lambda: group_rewards([None, 1.0], 2, False), "reward_fn"),
        (lambda: grpo.kl_penalty(X, X, "k4"), "estimator"),
        (lambda: grpo.kl_penalty(X, X[:, :2]), "ref_logp"),
        (lambda: grpo.aggregate_loss(X, X.bool(), "mean"), "loss_type"),
        (lambda: grpo.aggregate_loss(X, X.bool(), "dr_grpo"), "max_completion_length"),
        (lambda: pg(loss_type="ppo"), "loss_type"),
        (lambda: pg(loss_type="no_baseline", raw_rewards=None), "raw_rewards"),
        (lambda: pg(loss_type="reinforce_with_baseline", advantages=None), "advantages"),
        (lambda: pg(old_log_probs=None), "old_log_probs"),
        (lambda: pg(cliprange=None), "cliprange"),
        (lambda: pg(cliprange=-0.1), "cliprange"),
        (lambda: pg(old_log_probs=X[:, :2]), "old_log_probs"),
        (lambda: pg(advantages=torch.ones(3, 1)), "advantages"),
        (lambda: pg(advantages=torch.ones(2, 3)), "advantages"),
        (lambda: pg(loss_type="no_baseline", raw_rewards=torch.ones(2, 1, dtype=torch.long)), "raw_rewards"),
        (lambda: pg(policy_log_probs=torch.zeros(2, 3, 4)), "policy_log_probs"),
        (lambda: course.compute_naive_policy_gradient_loss(torch.ones(2, 1), X.long()), "policy_log_probs"),
        (lambda: course.sft_microbatch_train_step(X, X.bool(), 0), "gradient_accumulation_steps"),
        (lambda: course.sft_microbatch_train_step(X, X.bool(), 1, normalize_constant=0.0), "normalize_constant"),
        (lambda: course.compute_entropy(torch.ones(3, dtype=torch.long)), "logits"),
        (lambda: course.tokenize_prompt_and_output(["a", "b"], ["c"], char_tokenizer()), "output_strs"),
        (lambda: course.tokenize_prompt_and_output([], [], char_tokenizer()), "prompt_strs"),
        (lambda: AdaptiveKLController(0.1, 0.0), "target_kl"),
        (lambda: AdaptiveKLController(-1.0, 0.1), "init_beta"),
        (lambda: AdaptiveKLController(0.1, 0.1).update(math.nan), "observed_kl"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        call()
