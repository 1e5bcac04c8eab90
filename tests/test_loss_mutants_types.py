"""Every loss type through each branch of its formula, on a fixed grid rather than drawn examples: grpo_objective's
loss and its gradients in the log-probs and the entropies against the transcription of TRL 1.16's
GRPOTrainer._compute_loss in test_loss_options, in fp64.

The drawn examples of test_loss_options reach a branch only by chance: a mutation audit found cispo's weight
min(r, epsilon_high) left undetached (TRL detaches it) passing them, because no example had a cap above the ratio.
"""
from __future__ import annotations

import pytest
import torch

from fastgrpo import GRPOLossConfig
from fastgrpo.loss.config import LOSS_TYPES
from tests.test_loss_options import ours_and_trls, per_token_inputs

B, T = 3, 6
# Each case puts a branch on the path: a cap / clip above every ratio (cispo and the PPO clip unclamped, their
# gradient through the ratio), on-policy ratios exp(logp - sg(logp)), delta and sequence-level ratios with token
# weights, the masks of the entropy quantile and the off-policy threshold with the entropy bonus.
CASES = {
    "wide-clip": dict(options=dict(epsilon_high=3.0, beta=0.04, use_bias_correction_kl=True), on_policy=False),
    "wide-clip-on-policy": dict(options=dict(epsilon_high=3.0, beta=0.04), on_policy=True),
    "delta-sequence-weighted": dict(options=dict(epsilon_high=0.28, delta=1.3, importance_sampling_level="sequence",
                                                 beta=0.04), on_policy=False, weighted=True),
    # row 1 (A < 0, 4 of 6 tokens valid) drifts by -0.070 on average over its valid tokens, -0.047 over all 6
    "masks-and-bonus": dict(options=dict(top_entropy_quantile=0.5, off_policy_mask_threshold=-0.06,
                                         entropy_coef=0.05), on_policy=False, sampled=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_branch_matches_trl(loss_type, case):
    spec = CASES[case]
    g = torch.Generator().manual_seed(11)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    mask, old, ref, weights, sampling = per_token_inputs(g, B, T, logps, spec.get("weighted", False),
                                                         spec.get("sampled", False))
    mask[0, :2] = True  # rows of 2+, 0+ and no valid tokens (per_token_inputs empties the last)
    if weights is not None:  # a rollout correction's weights are 1 off the mask (TRL's vespo sums all their logs)
        weights = torch.where(mask, weights, 1.0)
    old = None if spec["on_policy"] else old
    adv = torch.tensor([0.8, -1.1, 0.5], dtype=torch.float64)
    cfg = GRPOLossConfig(loss_type=loss_type, max_completion_length=T + 1, num_items_in_batch=7.0,
                         **spec["options"])
    results = [(float(loss.detach()), *(torch.zeros_like(logps) if d is None else d * mask for d in grads))
               for loss, *grads in ours_and_trls(logps, entropy, mask, adv, old, ref, cfg, weights, sampling)]
    (ours, d_lp, d_ent), (theirs, t_lp, t_ent) = results
    # fp64, O(1) terms summed in another order: ~1e-15; 1e-12 fails on any formula or masking difference.
    assert abs(ours - theirs) <= 1e-12 * max(1.0, abs(theirs)), (ours, theirs)
    assert torch.allclose(d_lp, t_lp, rtol=1e-10, atol=1e-13), (d_lp, t_lp)
    assert torch.allclose(d_ent, t_ent, rtol=1e-10, atol=1e-13), (d_ent, t_ent)
