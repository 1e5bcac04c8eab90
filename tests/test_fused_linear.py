"""fused_linear_logprobs / fused_linear_grpo_loss against fastgrpo.reference in fp64, both backends, on the CPU.

The triton backend runs its kernels under TRITON_INTERPRET=1 (set by conftest): small shapes only. Chunks of a few
rows make every case cross several chunks; the kernels' CPU block of 64 makes V = 300 cross five V blocks.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.loss import reference
from fastgrpo.loss import fused as fused_loss
from fastgrpo.ops import fused_linear
from fastgrpo.loss.fused import fused_linear_grpo_loss
from fastgrpo.ops.fused_linear import chunk_rows, fused_linear_logprobs

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="CPU tensors reach Triton only under TRITON_INTERPRET=1; tests/test_fused_linear_gpu.py covers CUDA",
    )),
]
# ||out - ref|| / ||ref|| bounds: fp64 math lands near 1e-15; fp32 GEMMs + fp32 logsumexp near 1e-7.
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
# Logit soft-caps: off, or from 0.5 (logits here reach +-4, so tanh saturates: tanh(8) = 1 - 2e-7) to 50 (~linear).
SOFTCAPS = st.one_of(st.none(), st.sampled_from([0.5, 50.0]), st.floats(0.5, 50.0))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    out, ref = out.detach(), ref.detach()
    assert torch.isfinite(out).all()
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm().clamp(min=1e-30))


def make_inputs(seed, B, T, H, V, dtype, *, bias=True, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(B, T, H, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=torch.float64) * 0.5).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (B, T), generator=g)
    return g, hidden, weight, b, targets


def grpo_extras(g, hidden, weight, bias, targets, temperature, all_masked_row=True, softcap=None):
    """Mask with an all-masked sequence, mixed-sign advantages, old/ref log-probs near the policy's (<= 0, as the
    loss checks)."""
    B, T = targets.shape
    mask = torch.rand(B, T, generator=g) < 0.75
    if all_masked_row and B > 1:
        mask[-1] = False
    with torch.no_grad():
        logps = reference.linear_logprobs(
            hidden, weight, targets, temperature, bias, upcast=torch.float64, softcap=softcap
        )
    old = (logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4).clamp(max=0.0)  # ratios e^{+-0.4}:
    ref = (logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4).clamp(max=0.0)  # both clips fire
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    return mask, advantages, old.float(), ref.float()


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=30)  # ~1 s per 10 examples under the interpreter: the widest net is worth it here
@given(
    seed=st.integers(0, 2**16),
    B=st.integers(1, 3),
    T=st.integers(1, 7),
    H=st.sampled_from([1, 5, 48]),
    V=st.sampled_from([2, 37, 300]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    temperature=st.sampled_from([1.0, 0.7]),
    with_bias=st.booleans(),
    rows=st.sampled_from([1, 4, None]),
    softcap=SOFTCAPS,
)
def test_logprobs_entropy_and_grads(backend, seed, B, T, H, V, dtype, temperature, with_bias, rows, softcap):
    _, hidden, weight, bias, targets = make_inputs(seed, B, T, H, V, dtype, bias=with_bias)
    ref_lp, ref_ent = reference.linear_logprobs(
        hidden, weight, targets, temperature, bias, return_entropy=True, upcast=torch.float64, softcap=softcap
    )
    with chunk_rows(rows):
        lp, ent = fused_linear_logprobs(
            hidden, weight, targets, temperature=temperature, bias=bias, softcap=softcap, return_entropy=True,
            backend=backend,
        )
    assert lp.dtype == torch.promote_types(dtype, torch.float32) and lp.shape == targets.shape
    assert rel_err(lp, ref_lp) < TOL[dtype] and rel_err(ent, ref_ent) < TOL[dtype]
    # A loss through both outputs exercises the log-prob and the entropy gradients.
    coef = torch.randn(2, B, T, dtype=torch.float64)
    params = [t for t in (hidden, weight, bias) if t is not None]
    ref_grads = torch.autograd.grad((coef[0] * ref_lp + coef[1] * ref_ent).sum(), params)
    grads = torch.autograd.grad((coef[0] * lp + coef[1] * ent).sum(), params)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert got.dtype == dtype
        assert rel_err(got, want) < TOL[dtype] * 10, name


LOSS_CASES = st.fixed_dictionaries(
    {
        "loss_type": st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo"]),
        "importance_sampling_level": st.sampled_from(["token", "sequence"]),
        "beta": st.sampled_from([0.0, 0.04]),
        "delta": st.sampled_from([None, 1.2]),
        "epsilon_high": st.sampled_from([None, 0.28]),
        "temperature": st.sampled_from([1.0, 0.7]),
        "on_policy": st.booleans(),
        "num_items_in_batch": st.sampled_from([None, 11.0]),
        "softcap": SOFTCAPS,
    }
)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**16),
    B=st.integers(1, 3),
    T=st.integers(1, 6),
    H=st.sampled_from([5, 48]),
    V=st.sampled_from([37, 300]),
    case=LOSS_CASES,
    frozen=st.booleans(),
    rows=st.sampled_from([1, 3, None]),
)
def test_grpo_loss_matches_reference(backend, seed, B, T, H, V, case, frozen, rows):
    g, hidden, weight, bias, targets = make_inputs(seed, B, T, H, V, torch.float64)
    weight.requires_grad_(not frozen)
    temperature = case.pop("temperature")
    mask, advantages, old, ref = grpo_extras(
        g, hidden, weight, bias, targets, temperature, softcap=case["softcap"]
    )
    old = None if case.pop("on_policy") else old
    kwargs = dict(
        case, old_logps=old, ref_logps=ref, temperature=temperature, bias=bias, max_completion_length=T + 2,
        return_entropy=True,
    )
    want_loss, want_metrics = reference.grpo_loss(
        hidden, weight, targets, mask, advantages, upcast=torch.float64, **kwargs
    )
    with chunk_rows(rows):
        loss, metrics = fused_linear_grpo_loss(hidden, weight, targets, mask, advantages, backend=backend, **kwargs)
    loss_value, want_value = float(loss.detach()), float(want_loss.detach())
    assert abs(loss_value - want_value) <= 1e-10 * max(1.0, abs(want_value))
    assert sorted(metrics) == sorted(want_metrics)
    for key, value in want_metrics.items():
        assert abs(float(metrics[key]) - float(value)) < 1e-10, key
    params = [t for t in (hidden, weight, bias) if t.requires_grad]
    want_grads = torch.autograd.grad(want_loss, params)
    grads = torch.autograd.grad(loss * 1.5, params)  # grad_output != 1 reaches the stored gradients
    for got, want in zip(grads, want_grads):
        assert torch.allclose(got, 1.5 * want, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grpo_loss_both_clips_active_and_fp32(backend, dtype):
    g, hidden, weight, bias, targets = make_inputs(7, 4, 16, 48, 300, dtype)
    mask, advantages, old, ref = grpo_extras(g, hidden, weight, bias, targets, 1.0)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=dtype)
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.1, bias=bias, loss_type="grpo")
    want_loss, want_metrics = reference.grpo_loss(
        hidden, weight, targets, mask, advantages, upcast=torch.float64, **kwargs
    )
    assert want_metrics["clip_ratio_low"] > 0 and want_metrics["clip_ratio_high"] > 0
    with chunk_rows(5):
        loss, metrics = fused_linear_grpo_loss(hidden, weight, targets, mask, advantages, backend=backend, **kwargs)
    assert rel_err(loss, want_loss) < TOL[dtype]
    for key in want_metrics:
        assert abs(float(metrics[key]) - float(want_metrics[key])) < TOL[dtype] * 10, key
    params = (hidden, weight, bias)
    for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(want_loss, params)):
        assert got.dtype == dtype and rel_err(got, want) < TOL[dtype] * 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_token_and_all_masked(backend):
    g, hidden, weight, bias, targets = make_inputs(3, 1, 1, 48, 37, torch.float64)
    for mask in (torch.ones(1, 1), torch.zeros(1, 1)):
        args = (hidden, weight, targets, mask, torch.ones(1))
        want, _ = reference.grpo_loss(*args, bias=bias, loss_type="grpo")
        loss, _ = fused_linear_grpo_loss(*args, bias=bias, loss_type="grpo", backend=backend)
        grads = torch.autograd.grad(loss, (hidden, weight, bias))
        want_grads = torch.autograd.grad(want, (hidden, weight, bias))
        assert torch.allclose(loss, want, atol=1e-12)
        assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads, want_grads))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_padding_values_at_masked_positions_do_not_leak(backend, level):
    """-inf / huge old and ref log-probs at padding (as rollout engines leave them) change nothing: no inf * 0."""
    g, hidden, weight, bias, targets = make_inputs(9, 3, 6, 5, 37, torch.float64)
    mask, advantages, old, ref = grpo_extras(g, hidden, weight, bias, targets, 1.0)
    mask[0, 4:] = False
    kwargs = dict(beta=0.1, bias=bias, importance_sampling_level=level)
    want, want_metrics = reference.grpo_loss(
        hidden, weight, targets, mask, advantages, old_logps=old, ref_logps=ref, upcast=torch.float64, **kwargs
    )
    old, ref = old.masked_fill(~mask, float("-inf")), ref.masked_fill(~mask, 1e4)
    loss, metrics = fused_linear_grpo_loss(
        hidden, weight, targets, mask, advantages, old_logps=old, ref_logps=ref, backend=backend, **kwargs
    )
    assert torch.allclose(loss, want, rtol=1e-10)
    assert all(torch.allclose(metrics[k], want_metrics[k], rtol=1e-10) for k in want_metrics)
    for got, exp in zip(torch.autograd.grad(loss, (hidden, weight)), torch.autograd.grad(want, (hidden, weight))):
        assert torch.allclose(got, exp, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_softcap_saturated_and_banned_tokens(backend, dtype):
    """Cap 0.5 on logits up to ~30 (tanh is +-1 to the last bit) and banned tokens (bias -inf), which the cap turns
    into a finite -cap as in HF. V = 300 pads the last block: padding must get no probability, not -cap's."""
    g, hidden, weight, bias, targets = make_inputs(13, 2, 8, 48, 300, dtype, scale=8.0)
    with torch.no_grad():
        bias[::7] = float("-inf")
    targets[0, 0] = 7  # one target is a banned token
    params = (hidden, weight, bias)
    want = reference.linear_logprobs(hidden, weight, targets, 0.7, bias, True, torch.float64, softcap=0.5)
    with chunk_rows(5):
        got = fused_linear_logprobs(
            hidden, weight, targets, temperature=0.7, bias=bias, softcap=0.5, return_entropy=True, backend=backend
        )
    for out, ref in zip(got, want):
        assert rel_err(out, ref) < TOL[dtype]
    coef = torch.randn(2, 2, 8, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad((coef[0] * want[0] + coef[1] * want[1]).sum(), params)
    grads = torch.autograd.grad((coef[0] * got[0] + coef[1] * got[1]).sum(), params)
    for name, out, ref in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert rel_err(out, ref) < TOL[dtype] * 10, name
    assert torch.all(grads[2][::7] == 0)  # saturated: 1 - tanh^2 = 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_banned_whole_blocks_of_the_vocabulary(backend, softcap):
    """Banned tokens (bias -inf) filling the first V blocks of the row passes (64 lanes under the interpreter, 4096 on
    a GPU) and more: the running max stays -inf over those blocks, which must add nothing (no -inf - -inf). Without
    the cap the banned tokens stay at -inf: the torch backend's entropy and its gradient were NaN (0 x -inf), and so
    was the fp64 reference's."""
    g, hidden, weight, bias, targets = make_inputs(17, 2, 5, 48, 300, torch.float32)
    with torch.no_grad():
        bias[:150] = float("-inf")
    targets = targets.clamp(min=150)  # the targets are allowed tokens
    params = (hidden, weight, bias)
    want = reference.linear_logprobs(hidden, weight, targets, 0.7, bias, True, torch.float64, softcap=softcap)
    with chunk_rows(4):
        got = fused_linear_logprobs(hidden, weight, targets, temperature=0.7, bias=bias, softcap=softcap,
                                    return_entropy=True, backend=backend)
    assert all(torch.isfinite(w).all() for w in want), want
    for name, out, ref in zip(("logp", "entropy"), got, want):
        err = rel_err(out, ref)
        assert err < TOL[torch.float32], f"{name}: relative error {err:.3g} >= {TOL[torch.float32]}"
    coef = torch.randn(len(got), 2, 5, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad(sum((c * w).sum() for c, w in zip(coef, want)), params)
    grads = torch.autograd.grad(sum((c * o).sum() for c, o in zip(coef, got)), params)
    for name, out, ref in zip(("hidden", "weight", "bias"), grads, want_grads):
        err = rel_err(out, ref)
        assert err < TOL[torch.float32] * 10, f"d{name}: relative error {err:.3g} >= {TOL[torch.float32] * 10}"


class _Spy:
    """Records the chunk shapes the row passes see and the dW GEMMs the chunk loop issues."""

    def __init__(self, monkeypatch, backend):
        self.stats_rows, self.grad_rows, self.dweight_calls = [], [], 0
        inner = fused_linear.row_kernels(backend)

        def stats(logits, *args):
            self.stats_rows.append(logits.shape[0])
            return inner.stats(logits, *args)

        def grad(logits, *args):
            self.grad_rows.append(logits.shape[0])
            return inner.grad(logits, *args)

        real_addmm = fused_linear._addmm_acc

        def addmm(*args):
            self.dweight_calls += 1
            return real_addmm(*args)

        spied = lambda _: fused_linear.RowKernels(stats, grad)  # noqa: E731
        monkeypatch.setattr(fused_linear, "row_kernels", spied)
        monkeypatch.setattr(fused_loss, "row_kernels", spied)
        monkeypatch.setattr(fused_linear, "_addmm_acc", addmm)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("frozen", [False, True])
def test_chunking_skips_masked_rows_and_frozen_dweight(monkeypatch, backend, level, frozen):
    g, hidden, weight, bias, targets = make_inputs(5, 3, 8, 5, 37, torch.float64)
    weight.requires_grad_(not frozen)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, :5] = True
    mask[2, 3:] = True  # 10 valid rows of 24
    spy = _Spy(monkeypatch, backend)
    with chunk_rows(4):
        loss, _ = fused_linear_grpo_loss(
            hidden, weight, targets, mask, torch.randn(3, dtype=torch.float64), bias=bias,
            importance_sampling_level=level,
        )
    loss.backward()
    passes = 1 if level == "token" else 2  # sequence-level ratios need all log-probs before any gradient
    assert max(spy.stats_rows) <= 4 and sum(spy.stats_rows) == 10 * passes
    assert spy.grad_rows == [4, 4, 2]
    assert spy.dweight_calls == (0 if frozen else 3)
    assert weight.grad is None if frozen else weight.grad.shape == weight.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])  # the gradient formed in the forward / in a second pass
@pytest.mark.parametrize("grad", [True, False])
def test_return_logps_gives_the_loss_logprobs(backend, level, grad):
    g, hidden, weight, bias, targets = make_inputs(12, 3, 7, 48, 300, torch.float64)
    mask, advantages, old, ref = grpo_extras(g, hidden, weight, bias, targets, 0.7, softcap=5.0)
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.04, bias=bias, temperature=0.7, softcap=5.0,
                  importance_sampling_level=level, return_logps=True)
    _, want = reference.grpo_loss(hidden, weight, targets, mask, advantages, **kwargs)
    expected = reference.linear_logprobs(hidden, weight, targets, 0.7, bias, softcap=5.0).detach() * mask
    assert torch.equal(want["logps"], expected) and not want["logps"].requires_grad  # the oracle's own
    with chunk_rows(4), torch.set_grad_enabled(grad):
        loss, metrics = fused_linear_grpo_loss(hidden, weight, targets, mask, advantages, backend=backend, **kwargs)
    logps = metrics["logps"]
    assert logps.dtype == torch.float64 and not logps.requires_grad and loss.requires_grad == grad
    assert torch.all(logps[~mask] == 0) and rel_err(logps, expected) < TOL[torch.float64]
    assert all(float(metrics[k]) == pytest.approx(float(want[k]), abs=1e-10) for k in want if k != "logps")


def test_second_backward_says_why():
    _, hidden, weight, bias, targets = make_inputs(2, 2, 3, 5, 37, torch.float64)
    loss, _ = fused_linear_grpo_loss(hidden, weight, targets, torch.ones(2, 3), torch.ones(2), bias=bias)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_no_grad_forms_no_gradient(monkeypatch):
    _, hidden, weight, bias, targets = make_inputs(1, 2, 3, 5, 37, torch.float64)
    spy = _Spy(monkeypatch, "torch")
    with torch.no_grad():
        fused_linear_grpo_loss(hidden, weight, targets, torch.ones(2, 3), torch.ones(2), bias=bias)
        fused_linear_logprobs(hidden, weight, targets, bias=bias)
    assert spy.grad_rows == [] and spy.dweight_calls == 0


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_bf16_error_no_larger_than_eager_bf16(softcap):
    g, hidden, weight, bias, targets = make_inputs(11, 2, 32, 48, 300, torch.bfloat16, scale=2.0)
    mask, advantages, old, ref = grpo_extras(g, hidden, weight, bias, targets, 1.0, softcap=softcap)
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.04, bias=bias, softcap=softcap)
    exact, _ = reference.grpo_loss(hidden, weight, targets, mask, advantages, upcast=torch.float64, **kwargs)
    eager, _ = reference.grpo_loss(hidden, weight, targets, mask, advantages, **kwargs)
    ours, _ = fused_linear_grpo_loss(hidden, weight, targets, mask, advantages, backend="torch", **kwargs)
    params = (hidden, weight, bias)
    exact_g = torch.autograd.grad(exact, params)
    eager_g = torch.autograd.grad(eager, params)
    ours_g = torch.autograd.grad(ours, params)
    assert rel_err(ours, exact) <= rel_err(eager, exact) + 1e-3
    for o, e, x in zip(ours_g, eager_g, exact_g):
        assert o.dtype == torch.bfloat16 and rel_err(o, x) <= rel_err(e, x) * 1.1 + 1e-3


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(targets_delta=37), "target_ids"),
        (dict(targets_delta=-100), "target_ids"),
        (dict(weight=torch.randn(37, 4)), "weight"),
        (dict(weight=torch.randn(37, 5, dtype=torch.float32)), "weight"),
        (dict(beta=0.1), "ref_logps"),
        (dict(loss_type="ppo"), "loss_type"),
        (dict(importance_sampling_level="segment"), "importance_sampling_level"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
        (dict(backend="jax"), "backend"),
        (dict(softcap=0.0), "softcap"),
        (dict(softcap=-30.0), "softcap"),
        (dict(softcap=float("inf")), "softcap"),
        (dict(softcap=float("nan")), "softcap"),
        (dict(softcap=True), "softcap"),
        (dict(softcap="30"), "softcap"),
    ],
)
def test_bad_input_names_the_argument(change, name):
    _, hidden, weight, _, targets = make_inputs(0, 2, 3, 5, 37, torch.float64, bias=False)
    change = dict(change)
    targets = targets + change.pop("targets_delta", 0)
    weight = change.pop("weight", weight)
    with pytest.raises(ValueError, match=name):
        fused_linear_grpo_loss(hidden, weight, targets, torch.ones(2, 3), torch.ones(2), **change)
    if not set(change) - {"backend", "softcap"}:
        with pytest.raises(ValueError, match=name):
            fused_linear_logprobs(hidden, weight, targets, **change)


def test_triton_backend_on_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _, hidden, weight, _, targets = make_inputs(0, 1, 2, 5, 37, torch.float64, bias=False)
    with pytest.raises(ValueError, match="backend: 'triton' needs CUDA"):
        fused_linear_logprobs(hidden, weight, targets, backend="triton")


def test_chunk_rows_rejects_nonsense():
    with pytest.raises(ValueError, match="rows"):
        with chunk_rows(0):
            pass
