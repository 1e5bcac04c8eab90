"""The loss options taken from TRL (cispo, sapo, luspo, vespo, top_entropy_quantile, off_policy_mask_threshold,
use_bias_correction_kl, entropy_coef, per-token weights): the per-token math against a transcription of TRL 1.16's
GRPOTrainer._compute_loss in fp64, and fused_linear_grpo_loss against the eager reference in fp64 on both backends
(the triton one under TRITON_INTERPRET=1), odd shapes and masks, and the chunk passes each option takes.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo import GRPOLossConfig
from fastgrpo.loss import fused as fused_loss
from fastgrpo.loss import reference
from fastgrpo.loss.fused import fused_linear_grpo_loss
from fastgrpo.loss.grpo import grpo_objective, high_entropy_mask, loss_metrics
from fastgrpo.ops import fused_linear
from fastgrpo.ops.fused_linear import chunk_rows

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors reach Triton only under TRITON_INTERPRET=1",
    )),
]
NEW_LOSS_TYPES = ["cispo", "sapo", "luspo", "vespo"]
# fp64 throughout: the fused loss and the reference differ in summation order only (~1e-15 relative); 1e-10 leaves
# room for the log-sum-exp of V = 300 terms and still fails on any formula or masking difference.
TOL = 1e-10


def trl_loss(logps, entropy, mask, adv, old, ref, cfg: GRPOLossConfig, is_ratio=None, sampling=None):
    """TRL 1.16 GRPOTrainer._compute_loss (with get_off_policy_mask, get_high_entropy_mask, get_gamma_weights)
    transcribed for one process and one micro-batch (GA = steps_per_generation = 1): logps, entropy [B, T]."""
    mask = mask.to(logps.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    old = logps.detach() if old is None else old
    entropy_mask = None
    if cfg.top_entropy_quantile < 1.0:
        values = entropy[mask.bool()].detach()
        entropy_mask = torch.zeros_like(mask, dtype=torch.bool)
        if values.numel():
            threshold = torch.quantile(values, 1 - cfg.top_entropy_quantile)
            entropy_mask = (entropy.detach() * mask >= threshold) & mask.bool()
    if cfg.off_policy_mask_threshold is not None:
        samp = old if sampling is None else sampling
        kl_div = torch.nan_to_num(samp - logps.detach(), nan=0.0)
        avg = (kl_div * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        opsm = ((adv >= 0) | (avg <= cfg.off_policy_mask_threshold)).to(mask.dtype)
    log_ratio = logps - old
    if cfg.importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    if cfg.beta != 0.0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if cfg.use_bias_correction_kl:
            kl = kl * coef_1
    eps_hi = cfg.clip_high
    if cfg.loss_type == "cispo":
        ptl = -torch.clamp(coef_1, max=eps_hi).detach() * adv * logps
    elif cfg.loss_type == "sapo":
        # TRL's torch.where of two Python floats rounds tau to fp32 (1.05 -> 1.0499999523); its runs are fp32
        # anyway. Full precision here, as fastgrpo computes it, so that fp64 compares the formula.
        tau = torch.where(adv > 0, _scalar(cfg.sapo_temperature_pos, adv), _scalar(cfg.sapo_temperature_neg, adv))
        ptl = -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * adv
    elif cfg.loss_type == "vespo":
        with torch.no_grad():
            seq = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
            if is_ratio is not None:
                seq = seq + torch.clamp(torch.log(is_ratio), math.log(1e-8), 20.0).sum(-1, keepdim=True)
            lw = torch.clamp(seq, math.log(1e-8), 20.0)
            k = torch.where(adv >= 0, _scalar(cfg.vespo_k_pos, adv), _scalar(cfg.vespo_k_neg, adv))
            lam = torch.where(adv >= 0, _scalar(cfg.vespo_lambda_pos, adv), _scalar(cfg.vespo_lambda_neg, adv))
            lam = lam.clamp(min=1e-4)
            phi = torch.exp(lam + k * lw - lam * torch.exp(lw)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        ptl = -phi * adv * logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon_low, 1 + eps_hi)
        if cfg.delta is not None:
            coef_1 = torch.clamp(coef_1, max=cfg.delta)
        ptl = -torch.min(coef_1 * adv, coef_2 * adv)
    if cfg.off_policy_mask_threshold is not None:
        ptl = ptl * opsm
    if entropy_mask is not None:
        ptl = ptl * entropy_mask
    if is_ratio is not None and cfg.loss_type != "vespo":
        ptl = ptl * is_ratio
    if cfg.beta != 0.0:
        ptl = ptl + cfg.beta * kl
    if cfg.loss_type in ("grpo", "sapo"):
        loss = ((ptl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif cfg.loss_type == "bnpo":
        loss = (ptl * mask).sum() / mask.sum().clamp(min=1.0)
    elif cfg.loss_type == "dr_grpo":
        loss = (ptl * mask).sum() / (ptl.size(0) * cfg.max_completion_length)
    elif cfg.loss_type == "luspo":
        loss = (ptl * mask).sum(-1).mean()
    else:  # dapo, cispo, vespo with num_items_in_batch
        loss = (ptl * mask).sum() / cfg.num_items_in_batch
    if cfg.entropy_coef != 0:
        eff = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - cfg.entropy_coef * (entropy * eff).sum() / eff.sum().clamp(min=1.0)
    return loss


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=like.dtype)


OPTION_CASES = st.fixed_dictionaries({
    "loss_type": st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo"] + NEW_LOSS_TYPES),
    "importance_sampling_level": st.sampled_from(["token", "sequence"]),
    "beta": st.sampled_from([0.0, 0.04]),
    "use_bias_correction_kl": st.booleans(),
    "epsilon_high": st.sampled_from([None, 0.28, 3.0]),
    "delta": st.sampled_from([None, 1.3]),
    "top_entropy_quantile": st.sampled_from([1.0, 1.0, 0.8, 0.3]),
    "off_policy_mask_threshold": st.sampled_from([None, None, 0.0, 0.05]),
    "entropy_coef": st.sampled_from([0.0, 0.0, 0.01, -0.3]),
    "sapo_temperature_neg": st.sampled_from([1.05, 2.0]),
    "vespo_k_pos": st.sampled_from([2.0, 0.5]),
    "vespo_lambda_neg": st.sampled_from([2.0, 0.0]),
})


def per_token_inputs(g, B, T, logps, with_weights, with_sampling):
    """Mask with an all-masked row, old / ref / sampler log-probs near the policy's (<= 0, as the loss checks),
    token weights in [0, 2]."""
    mask = torch.rand(B, T, generator=g) < 0.75
    if B > 1:
        mask[-1] = False
    old = (logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).clamp(max=0.0)
    ref = (logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).clamp(max=0.0)
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) * 2 if with_weights else None
    sampling = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1).clamp(max=0.0) if with_sampling \
        else None
    return mask, old, ref, weights, sampling


def ours_and_trls(logps, entropy, mask, adv, old, ref, cfg: GRPOLossConfig, weights, sampling) -> list[tuple]:
    """[(loss, d/dlogps, d/dentropy)] of grpo_objective, then of trl_loss, on the same inputs (a gradient is None
    where the loss does not read that input)."""
    results = []
    for compute in ("fastgrpo", "trl"):
        lp, ent = logps.clone().requires_grad_(), entropy.clone().requires_grad_()
        if compute == "fastgrpo":
            loss = grpo_objective(lp, mask.double(), adv, old, ref, cfg, entropy=ent, token_weights=weights,
                                  sampling_logps=sampling).loss
        else:
            loss = trl_loss(lp, ent, mask, adv, old, ref, cfg, weights, sampling)
        results.append((loss, *torch.autograd.grad(loss, (lp, ent), allow_unused=True)))
    return results


@settings(max_examples=40)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 4), T=st.integers(1, 7), case=OPTION_CASES,
       on_policy=st.booleans(), weighted=st.booleans(), sampled=st.booleans(), per_token_adv=st.booleans())
def test_objective_matches_trl_transcription(seed, B, T, case, on_policy, weighted, sampled, per_token_adv):
    """grpo_objective's loss and d/dlogps, d/dentropy equal TRL's _compute_loss written out, in fp64."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    mask, old, ref, weights, sampling = per_token_inputs(g, B, T, logps, weighted, sampled)
    old = None if on_policy else old
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=g, dtype=torch.float64)
    cfg = GRPOLossConfig(max_completion_length=T + 1, num_items_in_batch=7.0, **case)
    (ours, d_lp, d_ent), (theirs, t_lp, t_ent) = ours_and_trls(logps, entropy, mask, adv, old, ref, cfg, weights,
                                                               sampling)
    ours, theirs = float(ours.detach()), float(theirs.detach())
    assert abs(ours - theirs) <= TOL * max(1.0, abs(theirs)), (ours, theirs)
    for got, want in ((d_lp, t_lp), (d_ent, t_ent)):
        got = torch.zeros_like(logps) if got is None else got
        want = torch.zeros_like(logps) if want is None else want
        # TRL's sum over masked positions reaches their gradient only through * mask (= 0): compare valid ones.
        assert torch.allclose(got * mask, want * mask, rtol=1e-9, atol=1e-12), (got, want)


def make_problem(seed, B, T, H, V, temperature):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5).requires_grad_()
    bias = (torch.randn(V, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        logps = reference.linear_logprobs(hidden, weight, targets, temperature, bias)
    return g, hidden, weight, bias, targets, logps


# Each option forced on in its own run (the others drawn as above), so that each meets both fused paths: the
# one-pass (token-local) one and the two-pass (whole-sequence) one.
FOCUS = {
    "cispo": dict(loss_type="cispo"), "sapo": dict(loss_type="sapo"), "luspo": dict(loss_type="luspo"),
    "vespo": dict(loss_type="vespo"), "top_entropy_quantile": dict(top_entropy_quantile=0.6),
    "off_policy_mask": dict(off_policy_mask_threshold=0.02), "bias_correction_kl": dict(use_bias_correction_kl=True,
                                                                                        beta=0.04),
    "entropy_coef": dict(entropy_coef=0.05), "token_weights": dict(),
}


@pytest.mark.parametrize("focus", sorted(FOCUS))
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=3)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 3), T=st.integers(1, 6), H=st.sampled_from([5, 48]),
       V=st.sampled_from([37, 300]), case=OPTION_CASES, on_policy=st.booleans(), weighted=st.booleans(),
       sampled=st.booleans(), frozen=st.booleans(), rows=st.sampled_from([1, 3, None]),
       temperature=st.sampled_from([1.0, 0.7]), token_level=st.booleans())
def test_fused_matches_reference(focus, backend, seed, B, T, H, V, case, on_policy, weighted, sampled, frozen, rows,
                                 temperature, token_level):
    case = {**case, **FOCUS[focus]}
    weighted = weighted or focus == "token_weights"
    if token_level:  # the one-pass path where the focus option allows it
        case.update(importance_sampling_level="token", top_entropy_quantile=case["top_entropy_quantile"]
                    if focus == "top_entropy_quantile" else 1.0, off_policy_mask_threshold=None
                    if focus != "off_policy_mask" else case["off_policy_mask_threshold"])
    g, hidden, weight, bias, targets, logps = make_problem(seed, B, T, H, V, temperature)
    weight.requires_grad_(not frozen)
    mask, old, ref, weights, sampling = per_token_inputs(g, B, T, logps, weighted, sampled)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    kwargs = dict(case, old_logps=None if on_policy else old, ref_logps=ref, token_weights=weights,
                  sampling_logps=sampling, temperature=temperature, bias=bias, max_completion_length=T + 2,
                  num_items_in_batch=5.0, return_entropy=True)
    want_loss, want_metrics = reference.grpo_loss(hidden, weight, targets, mask, advantages, **kwargs)
    with chunk_rows(rows):
        loss, metrics = fused_linear_grpo_loss(hidden, weight, targets, mask, advantages, backend=backend, **kwargs)
    assert abs(float(loss) - float(want_loss)) <= TOL * max(1.0, abs(float(want_loss))), (float(loss), float(want_loss))
    assert sorted(metrics) == sorted(want_metrics)
    for key, value in want_metrics.items():
        assert abs(float(metrics[key]) - float(value)) <= TOL, (key, float(metrics[key]), float(value))
    params = [t for t in (hidden, weight, bias) if t.requires_grad]
    for name, got, want in zip(("hidden", "weight", "bias"), torch.autograd.grad(loss, params),
                               torch.autograd.grad(want_loss, params)):
        err = float((got - want).norm() / want.norm().clamp(min=1e-30))
        assert err <= 1e-9 or float((got - want).abs().max()) <= 1e-13, (name, err)


def test_known_values_of_the_new_loss_types():
    """On-policy (ratio 1) every loss type's gradient is -A per token times its aggregation weight, except cispo's
    cap below 1 (scales it) and vespo's phi(1) = 1; sapo's value is -2 A / tau."""
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    for loss_type, scale in (("sapo", 1 / 4), ("luspo", 1 / 2), ("vespo", 1 / 4), ("cispo", 0.5 / 4)):
        cfg = GRPOLossConfig(loss_type=loss_type, epsilon_high=0.5, num_items_in_batch=4.0)
        objective = grpo_objective(logps, mask, adv, None, None, cfg)
        (grad,) = torch.autograd.grad(objective.loss, logps)
        expected = -adv[:, None].expand(2, 2) * scale
        assert torch.allclose(grad, expected, rtol=1e-12), (loss_type, grad, expected)
        if loss_type == "sapo":  # -mean over sequences of (2 A / tau): tau 1 for A > 0, 1.05 for A <= 0
            assert objective.loss.item() == pytest.approx(-(2 * 1.0 / 1.0 + 2 * -2.0 / 1.05) / 2, rel=1e-12)
        if loss_type == "vespo":
            assert float(loss_metrics(mask, objective)["vespo_phi"]) == pytest.approx(1.0, rel=1e-12)


def test_entropy_mask_keeps_the_top_quantile_of_valid_tokens():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.8]], dtype=torch.float64)
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()  # the masked 7.0 must not set the threshold
    kept = high_entropy_mask(entropy, valid, 1 - 0.5)  # top_entropy_quantile 0.5: 7 valid values, median 0.5
    assert kept.tolist() == [[False, True, True, False], [False, True, False, True]]
    assert not high_entropy_mask(entropy, torch.zeros_like(valid), 0.5).any()


class _CountPasses:
    """Counts the rows the chunk loop's stats pass sees (each pass over the valid rows reads them once)."""

    def __init__(self, monkeypatch):
        self.rows = 0
        inner = fused_linear.row_kernels("torch")

        def stats(logits, *args):
            self.rows += logits.shape[0]
            return inner.stats(logits, *args)

        monkeypatch.setattr(fused_loss, "row_kernels", lambda _: fused_linear.RowKernels(stats, inner.grad))


@pytest.mark.parametrize("options, passes", [
    (dict(loss_type="cispo"), 1), (dict(loss_type="sapo"), 1), (dict(loss_type="luspo"), 1),
    (dict(entropy_coef=0.01, beta=0.04, use_bias_correction_kl=True), 1), (dict(token_weights=True), 1),
    (dict(loss_type="vespo"), 2), (dict(top_entropy_quantile=0.5), 2), (dict(off_policy_mask_threshold=0.1), 2),
    (dict(loss_type="sapo", importance_sampling_level="sequence"), 2),
])
def test_token_local_options_take_one_pass_the_others_two(monkeypatch, options, passes):
    g, hidden, weight, bias, targets, logps = make_problem(3, 2, 5, 8, 37, 1.0)
    mask = torch.ones(2, 5, dtype=torch.bool)
    options = dict(options)
    weights = torch.rand(2, 5, generator=g, dtype=torch.float64) if options.pop("token_weights", False) else None
    spy = _CountPasses(monkeypatch)
    loss, _ = fused_linear_grpo_loss(hidden, weight, targets, mask, torch.tensor([1.0, -1.0], dtype=torch.float64),
                                     ref_logps=logps, token_weights=weights, bias=bias, backend="torch", **options)
    loss.backward()
    assert spy.rows == 10 * passes


def test_bad_extra_inputs_name_the_argument():
    g, hidden, weight, bias, targets, logps = make_problem(0, 2, 3, 5, 37, 1.0)
    args = (hidden, weight, targets, torch.ones(2, 3), torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="token_weights: expected shape"):
        fused_linear_grpo_loss(*args, token_weights=torch.ones(2, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="sampling_logps: expected a floating dtype"):
        reference.grpo_loss(*args, sampling_logps=torch.ones(2, 3, dtype=torch.long))
