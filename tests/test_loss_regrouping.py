"""The update groups a minibatch's rows into micro-batches by length only where the loss cannot tell: for every loss
type and the options that act per micro-batch (an adaptive entropy coefficient too, which rises from 0), the
minibatch's gradient with two groupings of its rows (as the trainer scales and accumulates micro-batches) is equal
exactly where rows_may_regroup says so, in fp64."""
import itertools

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from fastgrpo.loss.config import LOSS_TYPES
from fastgrpo.loss.model import grpo_loss, sequence_logprobs
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.loss_setup import (
    TOKEN_SUM_TYPES, AdaptiveEntropy, loss_config, micro_batch_scale, minibatch_config, rows_may_regroup,
)

N, MICRO = 6, 2


def tiny_model():
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64)


MODEL = tiny_model()


def rollout():
    """N rows [left-padded prompt | completion of 1-7 tokens | padding], advantages, old and reference log-probs off
    the policy."""
    g = torch.Generator().manual_seed(3)
    P, L = 4, 7
    mask, completion = torch.zeros(N, P + L, dtype=torch.long), torch.zeros(N, P + L, dtype=torch.long)
    for row, (prompt, length) in enumerate(zip([4, 2, 3, 4, 1, 2], [7, 1, 5, 2, 6, 3])):
        mask[row, P - prompt:P + length] = 1
        completion[row, P:P + length] = 1
    ids = torch.randint(1, 64, (N, P + L), generator=g).masked_fill(mask == 0, 0)
    own = sequence_logprobs(MODEL, ids, mask, completion).double()
    old, ref = (own + 0.3 * torch.randn(N, P + L, generator=g, dtype=torch.float64) * completion for _ in range(2))
    return ids, mask, completion, torch.randn(N, generator=g, dtype=torch.float64), old.clamp(max=0), ref.clamp(max=0)


BATCH = rollout()


def applied_coefficient(config) -> float:
    """The entropy coefficient of an update after one whose entropy was below target: an adaptive one rises from an
    entropy_coef of 0 (AdaptiveEntropy), a static one is entropy_coef."""
    control = AdaptiveEntropy(config)
    control.add({"entropy": torch.tensor(0.0)}, torch.tensor(1))
    control.step()
    return control.applied()


def minibatch_gradient(config, groups):
    """The trainer's update of one minibatch (all N rows), micro-batch by micro-batch over `groups` of rows."""
    ids, mask, completion, advantages, old, ref = BATCH
    base = loss_config(config, config.beta)
    num_items = int(completion.sum())
    MODEL.zero_grad(set_to_none=True)
    for rows in groups:
        rows = torch.tensor(rows)
        micro_config = minibatch_config(config, base, num_items, MICRO / N, applied_coefficient(config))
        loss, _ = grpo_loss(MODEL, ids[rows], mask[rows], completion[rows], advantages[rows], old_logps=old[rows],
                            ref_logps=ref[rows], config=micro_config, return_entropy=True)
        (loss * micro_batch_scale(config.loss_type, len(rows), N, 1)).backward()
    return torch.cat([p.grad.flatten() for p in MODEL.parameters() if p.grad is not None])


# Every loss type as it comes; the per-micro-batch options on a sequence-mean and a token-sum type.
CASES = [dict(loss_type=t) for t in LOSS_TYPES] + [
    dict(loss_type=t, top_entropy_quantile=q, entropy_coef=c)
    for t, (q, c) in itertools.product(("grpo", "dapo"), ((0.6, 0.0), (1.0, 0.05)))] + [
    dict(loss_type="grpo", entropy_coef=0.0, use_adaptive_entropy=True, entropy_target=1.0, entropy_coef_delta=0.05)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_regrouping_is_allowed_exactly_where_the_gradient_cannot_tell(case):
    config = GRPOConfig(**case, max_completion_length=7, beta=0.04, epsilon_low=0.1)
    in_order = minibatch_gradient(config, [[0, 1], [2, 3], [4, 5]])
    by_length = minibatch_gradient(config, [[1, 3], [5, 2], [4, 0]])
    gap = float((in_order - by_length).abs().max() / in_order.abs().max())
    if rows_may_regroup(config):
        # fp64 on both sides: the same terms summed in another order (~1e-16 relative each)
        assert gap <= 1e-12, f"{case}: the groupings' gradients differ by {gap:.2e} relative"
    else:  # what rows_may_regroup refuses does depend on the grouping (the exclusions are needed)
        assert gap > 1e-6, f"{case}: regrouping would be safe here ({gap:.2e})"


def test_token_sum_types_are_row_additive():
    assert set(TOKEN_SUM_TYPES) <= set(LOSS_TYPES)
