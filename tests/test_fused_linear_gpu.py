"""GPU checks of the fused linear log-probs / GRPO loss: bf16 and fp32 against fp64, no worse than eager PyTorch on
the same inputs; 262144 rows and one 65536-token sequence, with chunks whose [chunk, V] passes 2^31 elements;
Gemma-2's soft-capped logits at its vocabulary and hidden size.

    python -m pytest tests/test_fused_linear_gpu.py -q -m gpu
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastgrpo.loss import reference
from fastgrpo.loss.grpo import aggregation_weights, grpo_per_token_loss
from fastgrpo.loss.fused import fused_linear_grpo_loss
from fastgrpo.ops.fused_linear import chunk_rows, fused_linear_logprobs

pytestmark = pytest.mark.gpu
V = 151936
SLACK = 1e-3  # relative-error slack over the eager path's own error


def rel_err(out, ref):
    assert torch.isfinite(out).all()
    ref = ref.double()
    return float((out.detach().double() - ref).norm() / ref.norm().clamp(min=1e-30))


def inputs(B, T, H, dtype, seed=0, scale=1.0, vocab=V):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(B, T, H, device="cuda", generator=g) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, H, device="cuda", generator=g) / H**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (B, T), device="cuda", generator=g)
    mask = torch.rand(B, T, device="cuda", generator=g) < 0.9
    advantages = torch.randn(B, device="cuda", generator=g)
    return g, hidden, weight, targets, mask, advantages


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loss_and_grads_no_worse_than_eager(dtype, level):
    g, hidden, weight, targets, mask, advantages = inputs(4, 512, 512, dtype, scale=4.0)
    with torch.no_grad():
        logps = reference.linear_logprobs(hidden, weight, targets, upcast=torch.float64)
    old = (logps + 0.3 * torch.randn(logps.shape, device="cuda", generator=g, dtype=torch.float64)).float()
    ref = (logps + 0.3 * torch.randn(logps.shape, device="cuda", generator=g, dtype=torch.float64)).float()
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.04, importance_sampling_level=level, temperature=0.9,
                  return_entropy=True)
    params = (hidden, weight)
    exact, exact_m = reference.grpo_loss(hidden, weight, targets, mask, advantages, upcast=torch.float64, **kwargs)
    eager, _ = reference.grpo_loss(hidden, weight, targets, mask, advantages, **kwargs)
    ours, ours_m = fused_linear_grpo_loss(hidden, weight, targets, mask, advantages, backend="triton", **kwargs)
    exact_g, eager_g, ours_g = (torch.autograd.grad(x, params) for x in (exact, eager, ours))
    assert rel_err(ours, exact) <= rel_err(eager, exact) + SLACK
    for key in exact_m:
        assert abs(float(ours_m[key]) - float(exact_m[key])) <= 2e-3 * max(1.0, abs(float(exact_m[key]))), key
    for name, o, e, x in zip(("hidden", "weight"), ours_g, eager_g, exact_g):
        assert o.dtype == dtype
        assert rel_err(o, x) <= rel_err(e, x) * 1.1 + SLACK, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logprobs_no_worse_than_eager_fp32_softmax(dtype):
    """Eager here is the strong one: logits in the input dtype, log_softmax in fp32 (what TRL does)."""
    _, hidden, weight, targets, _, _ = inputs(2, 1024, 1536, dtype, scale=4.0)
    bias = torch.randn(V, device="cuda", dtype=dtype, requires_grad=True)
    params = (hidden, weight, bias)
    exact = reference.linear_logprobs(hidden, weight, targets, 0.7, bias, True, torch.float64)
    log_probs = torch.log_softmax(F.linear(hidden, weight, bias).float() / 0.7, -1)
    eager = (log_probs.gather(-1, targets[..., None]).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1))
    ours = fused_linear_logprobs(hidden, weight, targets, temperature=0.7, bias=bias, return_entropy=True)
    assert ours[0].dtype == ours[1].dtype == torch.float32
    for o, e, x in zip(ours, eager, exact):
        assert rel_err(o, x) <= rel_err(e, x) * 1.1 + SLACK
    coef = torch.randn(2, *targets.shape, device="cuda", dtype=torch.float64)
    exact_g, eager_g, ours_g = (
        torch.autograd.grad((coef[0].to(lp.dtype) * lp + coef[1].to(ent.dtype) * ent).sum(), params)
        for lp, ent in (exact, eager, ours)
    )
    for o, e, x in zip(ours_g, eager_g, exact_g):
        assert o.dtype == dtype and rel_err(o, x) <= rel_err(e, x) * 1.1 + SLACK


def test_262144_rows_and_a_65536_token_sequence():
    """4 x 65536 rows (one sequence alone is 65536 tokens), chunks of 16384 rows: 16384 x 151936 > 2^31."""
    B, T, H = 4, 65536, 64
    g, hidden, weight, targets, mask, advantages = inputs(B, T, H, torch.bfloat16, seed=1, scale=4.0)
    mask[1] = False
    old = torch.full((B, T), -12.0, device="cuda") + torch.randn(B, T, device="cuda", generator=g)
    kwargs = dict(old_logps=old, loss_type="grpo")
    with torch.no_grad():  # fp64 log-probs, 8192 rows at a time
        exact_lp = torch.cat([
            reference.linear_logprobs(h, weight, t, upcast=torch.float64)
            for h, t in zip(hidden.view(-1, H).split(8192), targets.view(-1).split(8192))
        ]).view(B, T)
    with chunk_rows(16384):
        lp = fused_linear_logprobs(hidden.detach(), weight.detach(), targets)
        loss, _ = fused_linear_grpo_loss(hidden, weight, targets, mask, advantages, backend="triton", **kwargs)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert rel_err(lp, exact_lp) < 1e-2
    per_token, *_ = grpo_per_token_loss(exact_lp, mask.double(), advantages.double(), old.double())
    exact_loss = (per_token * aggregation_weights(mask, "grpo").double()).sum()
    assert rel_err(loss, exact_loss) < 1e-2
    assert grads[0][1].abs().max() == 0  # the masked sequence gets no gradient
    # The torch backend shares the GEMMs but not the row passes: same gradients at this size.
    with chunk_rows(4096):
        loss_t, _ = fused_linear_grpo_loss(hidden, weight, targets, mask, advantages, backend="torch", **kwargs)
    grads_t = torch.autograd.grad(loss_t, (hidden, weight))
    assert rel_err(loss, loss_t) < 1e-5
    for o, t in zip(grads, grads_t):
        assert rel_err(o, t) < 1e-2


def hf_softcapped_logps(hidden, weight, targets, temperature, softcap):
    """What HF Gemma-2 + TRL compute: logits soft-capped in the model's dtype (its forward), log_softmax in fp32."""
    logits = torch.tanh(F.linear(hidden, weight) / softcap) * softcap
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_softcap_at_gemma2_size_no_worse_than_eager(level):
    """Gemma-2-2B's V = 256000, H = 2304 and final_logit_softcapping = 30, bf16, 2048 rows; raw logits of std 8
    (max ~40) reach the cap's bend. Each loss and its gradients are formed and freed in turn: the fp64 oracle holds
    a few 4.2 GB [2048, 256000] buffers."""
    B, T, H, vocab, cap, tau = 2, 1024, 2304, 256000, 30.0, 0.9
    g, hidden, weight, targets, mask, advantages = inputs(B, T, H, torch.bfloat16, scale=8.0, vocab=vocab)
    params = (hidden, weight)
    with torch.no_grad():
        exact_lp = reference.linear_logprobs(hidden, weight, targets, tau, None, False, torch.float64, softcap=cap)
        eager_lp = hf_softcapped_logps(hidden, weight, targets, tau, cap)
        ours_lp = fused_linear_logprobs(hidden, weight, targets, temperature=tau, softcap=cap, backend="triton")
    assert rel_err(ours_lp, exact_lp) <= rel_err(eager_lp, exact_lp) * 1.1 + SLACK
    old = (exact_lp + 0.3 * torch.randn(B, T, device="cuda", generator=g, dtype=torch.float64)).float()
    ref = (exact_lp + 0.3 * torch.randn(B, T, device="cuda", generator=g, dtype=torch.float64)).float()
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.04, importance_sampling_level=level, temperature=tau,
                  softcap=cap)

    def eager_loss():  # GRPO (bnpo) on the HF + TRL log-probs
        logps = hf_softcapped_logps(hidden, weight, targets, tau, cap)
        m = mask.float()
        per_token, *_ = grpo_per_token_loss(
            logps, m, advantages, old, ref, beta=0.04, epsilon_low=0.2, importance_sampling_level=level
        )
        return (per_token * aggregation_weights(m, "bnpo")).sum()

    results = {}
    for name, make_loss in (
        ("exact", lambda: reference.grpo_loss(
            hidden, weight, targets, mask, advantages, upcast=torch.float64, **kwargs)[0]),
        ("eager", eager_loss),
        ("ours", lambda: fused_linear_grpo_loss(
            hidden, weight, targets, mask, advantages, backend="triton", **kwargs)[0]),
    ):
        loss = make_loss()
        results[name] = (loss.detach(), torch.autograd.grad(loss, params))
        del loss
    (exact, exact_g), (eager, eager_g), (ours, ours_g) = (results[k] for k in ("exact", "eager", "ours"))
    assert rel_err(ours, exact) <= rel_err(eager, exact) + SLACK
    for name, o, e, x in zip(("hidden", "weight"), ours_g, eager_g, exact_g):
        assert o.dtype == torch.bfloat16
        assert rel_err(o, x) <= rel_err(e, x) * 1.1 + SLACK, name
