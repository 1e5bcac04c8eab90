"""StochasticRoundingAdamW (fastgrpo.train.stochastic_adamw) and its Triton kernel (fastgrpo.kernels.adamw).

References: an fp64 evaluation of torch.optim.AdamW's formulas on the same inputs, and torch.optim.AdamW itself.
Tolerances are derived, not picked: each fp32 operation adds at most one unit roundoff (U32 = 2^-24) relative to
its result, so counting the operations of the update gives a first-order bound on |fp32 - fp64| per element, which
_step_reference carries along a trajectory (the moments' and the parameter's errors shrink by beta1, beta2 and the
decay factor each step; the gradients do not depend on the parameters here, so errors do not feed back).
A bf16 result must be one of the two bf16 neighbours of the fp32 value, hence of [fp64 - bound, fp64 + bound].

bf16 parameters on the CPU keep an fp32 master by default; the stochastic-rounding tests make them round
stochastically instead (_path patches keeps_master), with the kernel ("triton", under TRITON_INTERPRET=1, set by
conftest without CUDA) or its eager twin ("torch", TRITON_INTERPRET unset). The GPU tests run the kernel on CUDA.
The optimizer steps many tensors per launch (adamw_multi_tensor_launch_, through plans reused across steps); the
per-tensor kernel (adamw_step_) is the reference it must equal bit for bit.
"""
import contextlib
import copy
import functools
import io
import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.kernels import adamw as kernels_adamw
from fastgrpo.kernels.adamw import adamw_multi_tensor_step_, adamw_step_
from fastgrpo.train import stochastic_adamw
from fastgrpo.train.stochastic_adamw import StochasticRoundingAdamW, adamw_step_master_, adamw_step_torch_, step_seed

U32 = 2.0**-24  # fp32 unit roundoff
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = [
    pytest.param("triton", marks=pytest.mark.skipif(
        not INTERPRETED, reason="CPU tensors reach Triton only under TRITON_INTERPRET=1; test_cuda_* covers CUDA")),
    "torch",
]


@contextlib.contextmanager
def _path(name: str):
    """The optimizer's path for CPU tensors: "master" is its own choice (an fp32 master for bf16); any other name
    makes bf16 round stochastically, "torch" with the eager twin (TRITON_INTERPRET unset), else with the path
    fastgrpo.ops._backend.use_triton picks (the kernel under TRITON_INTERPRET=1). Other dtypes follow use_triton."""
    with mock.patch.dict(os.environ):
        if name == "torch":
            os.environ.pop("TRITON_INTERPRET", None)
        if name == "master":
            yield
            return
        with mock.patch.object(stochastic_adamw, "keeps_master", lambda param: False):
            yield


def _step_reference(p, m, v, g, step, hp, err=(0.0, 0.0, 0.0)):
    """torch.optim.AdamW's step in fp64 on fp64 inputs: (p, m, v) after it, and the bound (dp, dm, dv) on how far
    an fp32 evaluation of it may land, given that its inputs were within `err` of these fp64 inputs."""
    lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    dp, dm, dv = err
    decay, step_size, bias2_sqrt = 1 - lr * wd, lr / (1 - beta1**step), (1 - beta2**step) ** 0.5
    m1 = m + (1 - beta1) * (g - m)
    v1 = v * beta2 + (1 - beta2) * g * g
    denom = v1.sqrt() / bias2_sqrt + eps
    update = step_size * m1 / denom
    p1 = p * decay - update
    # m1: one rounding of the result, three of the (g - m) term (difference, weight, product); torch's lerp with a
    # weight >= 0.5 (g - (g - m) beta1) has as many. Doubled for headroom.
    dm = beta1 * dm + 2 * U32 * m1.abs() + 6 * U32 * (g - m).abs()
    dv = beta2 * dv + 6 * U32 * v1  # five roundings of non-negative terms (beta2, two products, weight, sum)
    # denom: half v1's relative error through the sqrt, then sqrt, division, bias2_sqrt, eps and the sum
    rel_denom = torch.where(v1 > 0, dv / (2 * v1.clamp_min(1e-300)), 0) + 5 * U32
    d_update = step_size * dm / denom + update.abs() * (rel_denom + 4 * U32)  # quotient, step_size, product
    dp = decay * dp + 2 * U32 * p.abs() + U32 * p1.abs() + d_update
    return (p1, m1, v1), (dp, dm, dv)


def _hp(draw_lr, beta1, beta2, eps, wd):
    return dict(lr=10.0**draw_lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)


HP = dict(
    draw_lr=st.floats(-6, -1), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]), wd=st.floats(0.0, 0.1),
)


def _worst(name, got, want, tol, extra=None):
    """Message naming the worst element of a failed comparison, all numbers printed."""
    i = int(((got - want).abs() / tol.clamp_min(1e-300)).argmax())
    out = f"{name}[{i}]: got {got[i].item():.10g}, want {want[i].item():.10g} +- {tol[i].item():.3g}"
    return out + (f", {extra[0]} {extra[1][i].item():.10g}" if extra else "")


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(1, 300), steps=st.integers(1, 4), seed=st.integers(0, 2**16), **HP)
def test_fp32_equals_torch_adamw(backend, n, steps, seed, draw_lr, beta1, beta2, eps, wd):
    hp = _hp(draw_lr, beta1, beta2, eps, wd)
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 10.0 ** (torch.rand((), generator=gen).item() * 4 - 3)
             for _ in range(steps)]
    ours, theirs = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt_ours = StochasticRoundingAdamW([ours], **hp, seed=seed)
    opt_theirs = torch.optim.AdamW([theirs], **hp, foreach=False)
    ref, err = (p0.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)), (0, 0, 0)
    with _path(backend):
        for step, g in enumerate(grads, 1):
            ours.grad, theirs.grad = g.clone(), g.clone()
            opt_ours.step()
            opt_theirs.step()
            ref, err = _step_reference(*ref, g.double(), step, hp, err)
    got = (ours.detach(), opt_ours.state[ours]["exp_avg"], opt_ours.state[ours]["exp_avg_sq"])
    torch_ = (theirs.detach(), opt_theirs.state[theirs]["exp_avg"], opt_theirs.state[theirs]["exp_avg_sq"])
    for name, a, b, want, tol in zip(("param", "exp_avg", "exp_avg_sq"), got, torch_, ref, err):
        a, b = a.double(), b.double()
        assert ((b - want).abs() <= tol).all(), "the bound misses torch: " + _worst(name, b, want, tol)
        assert ((a - want).abs() <= tol).all(), _worst(name, a, want, tol, ("torch", b))
        assert ((a - b).abs() <= 2 * tol).all(), _worst(name, a, b, 2 * tol, ("fp64", want))


def _bf16_floor(x):
    """Largest bf16 <= x (fp64 in, fp64 out): fp64 -> bf16 gives one of x's two neighbours, then step down."""
    z = x.to(torch.bfloat16)
    z = torch.where(z.double() > x, torch.nextafter(z, torch.full_like(z, -float("inf"))), z)
    return z.double()


def _bf16_ceil(x):
    return -_bf16_floor(-x)


def _assert_bf16_neighbour(name, got, want, tol):
    """got (bf16) is a bf16 neighbour of some value within tol of want (fp64)."""
    lo, hi = _bf16_floor(want - tol), _bf16_ceil(want + tol)
    got = got.double()
    bad = (got < lo) | (got > hi)
    assert not bad.any(), _worst(name, torch.where(bad, got, want), want, hi - lo, ("neighbours from", lo))


def _check_bf16_steps(n, steps, seed, hp, device):
    """Several steps on bf16 tensors: after each, the parameter and both moments are bf16 neighbours of the fp64
    step from the same (bf16) inputs."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter((torch.randn(n, generator=gen) * 0.05).bfloat16().to(device))
    opt = StochasticRoundingAdamW([p], **hp, seed=seed)
    zeros = torch.zeros(n, dtype=torch.float64, device=device)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen).bfloat16().to(device)
        state = opt.state[p]
        inputs = [p.detach().double()] + [state[k].double() if state else zeros for k in ("exp_avg", "exp_avg_sq")]
        p.grad = g
        opt.step()
        want, tol = _step_reference(*inputs, g.double(), step, hp)
        for name, got, w, t in zip(("param", "exp_avg", "exp_avg_sq"), (p.detach(), state["exp_avg"],
                                                                       state["exp_avg_sq"]), want, tol):
            assert got.dtype == torch.bfloat16
            _assert_bf16_neighbour(f"step {step} {name}", got, w, t)


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(1, 300), steps=st.integers(1, 4), seed=st.integers(0, 2**16), **HP)
def test_bf16_results_are_neighbours_of_fp64(backend, n, steps, seed, draw_lr, beta1, beta2, eps, wd):
    with _path(backend):
        _check_bf16_steps(n, steps, seed, _hp(draw_lr, beta1, beta2, eps, wd), "cpu")


def _rounding_bias(results, exact):
    """(mean of results - exact, its standard error if results are unbiased stochastic roundings of exact):
    results [draws, n] bf16, exact [n] fp64. A draw lands on the upper neighbour with probability q, the fraction
    of the spacing s that exact lies above the lower one, so its variance is s^2 q (1 - q)."""
    lo, hi = _bf16_floor(exact), _bf16_ceil(exact)
    spacing = hi - lo
    q = torch.where(spacing > 0, (exact - lo) / spacing.clamp_min(1e-300), 0)
    draws = results.shape[0]
    mean = (results.double() - exact).mean().item()
    se = ((spacing**2 * q * (1 - q)).sum() * draws).sqrt().item() / results.numel()
    return mean, se


def _check_unbiased(device, n=4096, draws=16):
    """One step at lr 1e-6 on weights of magnitude ~0.02 (bf16 spacing 2^-13 = 1.2e-4, so each update is ~1% of
    it), gradients all positive so every update has one sign: the mean rounded result, over n elements x `draws`
    seeds, is the exact one within 5 standard errors plus the fp32 math's bound. Round to nearest (torch's bf16
    AdamW) keeps every weight, off by the whole update (~1e-6 vs 5 SE ~2e-7): it must fail the same check.
    Checked over the positive and the negative weights apart: a rounding biased toward zero (or away from it) errs
    by opposite amounts on the two, which cancel in the mean over all (e.g. 15 random bits instead of 16: the
    update is ~1% of the spacing, so a carry takes ~98% of draws instead of ~99% above zero and none instead of
    ~1% below it, an error of ~-1% and ~+1% of the spacing, each as large as the update itself)."""
    gen = torch.Generator().manual_seed(0)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    p0 = (sign * (0.016 + 0.014 * torch.rand(n, generator=gen))).bfloat16().to(device)
    g = (0.5 + torch.rand(n, generator=gen)).bfloat16().to(device)
    hp = dict(lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    results = []
    for seed in range(draws):
        p = torch.nn.Parameter(p0.clone())
        p.grad = g
        StochasticRoundingAdamW([p], **hp, seed=seed).step()
        results.append(p.detach())
    zeros = torch.zeros(n, dtype=torch.float64, device=device)
    (exact, _, _), (tol, _, _) = _step_reference(p0.double(), zeros, zeros, g.double(), 1, hp)
    nearest = torch.nn.Parameter(p0.clone())
    nearest.grad = g
    torch.optim.AdamW([nearest], **hp, foreach=False).step()
    for name, part in (("positive", sign > 0), ("negative", sign < 0)):
        part = part.to(device)
        mean, se = _rounding_bias(torch.stack(results)[:, part], exact[part])
        allowed = 5 * se + tol[part].mean().item()
        assert abs(mean) <= allowed, (
            f"stochastic rounding of the {name} weights: mean error {mean:.3g}, allowed {allowed:.3g} (SE {se:.3g})")
        mean_nearest, _ = _rounding_bias(nearest.detach()[None, part], exact[part])
        assert abs(mean_nearest) > allowed, (
            f"round to nearest passes the check of the {name} weights too: mean error {mean_nearest:.3g}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_rounding_is_unbiased(backend):
    with _path(backend):
        _check_unbiased("cpu")


@pytest.mark.parametrize("path", ["stochastic", "master"])
def test_bf16_trains_at_lr_1e_6_where_round_to_nearest_does_not(path):
    """200 steps at lr 1e-6 on n weights ~0.02 with mostly positive gradients: torch's bf16 AdamW leaves every
    weight where it was; this optimizer moves them as fp64 AdamW does. With an fp32 master, each weight is the
    nearest bf16 of the master, which is within the fp32 bound of fp64 AdamW. Rounding stochastically, on average:
    allowed difference of the mean displacement: the parameter's rounding errors are zero-mean and independent
    across elements and steps, each of variance <= spacing^2 / 4, so the mean's standard deviation is
    <= spacing sqrt(T / (4 n)) (5 of them); plus T lr 2^-6 for the bf16 moments, which change each update by under
    2^-6 of it (and average out besides)."""
    n, steps, lr = 16384, 200, 1e-6
    gen = torch.Generator().manual_seed(0)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    p0 = (sign * (0.016 + 0.014 * torch.rand(n, generator=gen))).bfloat16()
    grads = [(1 + 0.5 * torch.randn(n, generator=gen)).bfloat16() for _ in range(steps)]
    hp = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ours, nearest = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    optimizers = StochasticRoundingAdamW([ours], **hp), torch.optim.AdamW([nearest], **hp, foreach=False)
    zeros = torch.zeros(n, dtype=torch.float64)
    exact, err = (p0.double(), zeros, zeros), (0.0, 0.0, 0.0)
    with _path(path):
        for step, g in enumerate(grads, 1):
            for p, opt in zip((ours, nearest), optimizers):
                p.grad = g
                opt.step()
            exact, err = _step_reference(*exact, g.double(), step, hp, err)
    assert torch.equal(nearest.detach(), p0), "round to nearest moved the weights: the toy no longer shows the bug"
    if path == "master":
        master = optimizers[0].state[ours]["master"]
        assert torch.equal(ours.detach(), master.bfloat16()), "the weights are not their master rounded to nearest"
        got = master.double()
        assert ((got - exact[0]).abs() <= err[0]).all(), _worst("master", got, exact[0], err[0])
        return
    moved, want = (ours.detach().double() - p0.double()).mean().item(), (exact[0] - p0.double()).mean().item()
    spacing = 2.0 ** (torch.floor(torch.log2(torch.cat([p0, ours.detach()]).double().abs().max())).item() - 7)
    allowed = 5 * spacing * (steps / (4 * n)) ** 0.5 + steps * lr * 2**-6
    assert abs(moved - want) <= allowed, f"mean displacement {moved:.4g}, fp64 AdamW {want:.4g}, allowed {allowed:.3g}"


@given(n=st.integers(1, 300), steps=st.integers(1, 4), seed=st.integers(0, 2**16), **HP)
def test_cpu_bf16_master_follows_fp64_adamw(n, steps, seed, draw_lr, beta1, beta2, eps, wd):
    """bf16 on the CPU: after every step the parameter is its fp32 master rounded to nearest; the master and the
    fp32 moments stay within the fp32 bound of fp64 AdamW from the same bf16 start and equal torch's fused AdamW on
    an fp32 copy bit for bit (the same kernel)."""
    hp = _hp(draw_lr, beta1, beta2, eps, wd)
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen).bfloat16()
    ours, fused = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.float())
    opt, opt_fused = StochasticRoundingAdamW([ours], **hp, seed=seed), torch.optim.AdamW([fused], **hp, fused=True)
    zeros = torch.zeros(n, dtype=torch.float64)
    ref, err = (p0.double(), zeros, zeros), (0, 0, 0)
    for step in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * 10.0 ** (torch.rand((), generator=gen).item() * 4 - 3)).bfloat16()
        ours.grad, fused.grad = g, g.float()
        opt.step()
        opt_fused.step()
        ref, err = _step_reference(*ref, g.double(), step, hp, err)
        assert torch.equal(ours.detach(), opt.state[ours]["master"].bfloat16()), f"step {step}"
    theirs = (fused.detach(), opt_fused.state[fused]["exp_avg"], opt_fused.state[fused]["exp_avg_sq"])
    for name, b, want, tol in zip(("master", "exp_avg", "exp_avg_sq"), theirs, ref, err):
        a = opt.state[ours][name]
        assert a.dtype == torch.float32 and torch.equal(a, b), _worst(name, a.double(), b.double(), tol)
        assert ((a.double() - want).abs() <= tol).all(), _worst(name, a.double(), want, tol)


def test_master_step_in_chunks_of_any_layout():
    """adamw_step_master_ in chunks (a multiple of the SIMD width: each element takes the kernel's vector or scalar
    path as in one call) equals torch's fused AdamW on the whole fp32 tensor bit for bit, also for a transposed
    parameter and a grad of another layout (torch's fused CPU kernel itself needs one layout for all)."""
    gen = torch.Generator().manual_seed(0)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8)
    param = torch.randn(41, 37, generator=gen).bfloat16().t()  # [37, 41], not contiguous
    master, m, v = param.float().contiguous(), torch.zeros(37, 41), torch.zeros(37, 41)
    fused = torch.nn.Parameter(param.float().contiguous())
    opt = torch.optim.AdamW([fused], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], fused=True)
    step = torch.tensor(0.0)
    for _ in range(3):
        grad = torch.randn(37, 41, generator=gen).bfloat16()
        step += 1
        adamw_step_master_(param, grad, master, m, v, step, **hp, chunk=64)
        fused.grad = grad.float()
        opt.step()
        assert torch.equal(master, fused.detach()), _worst("master", master.double().flatten(),
                                                          fused.detach().double().flatten(), torch.zeros(37 * 41))
        assert torch.equal(param, master.bfloat16())


def test_loads_the_state_of_the_other_path():
    """A state without masters, with bf16 moments (this optimizer on the GPU), loads for bf16 parameters on the CPU:
    the master is the parameter, the moments are converted exactly, and further steps equal torch's fused AdamW
    continuing from the same fp32 values. A master state loaded where bf16 rounds stochastically drops the master
    and rounds the moments to nearest."""
    gen = torch.Generator().manual_seed(0)
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    grads = [[torch.randn(57, generator=gen).bfloat16()] for _ in range(4)]
    gpu_like = torch.nn.Parameter(torch.randn(57, generator=gen).bfloat16())
    gpu_opt = StochasticRoundingAdamW([gpu_like], **hp)
    with _path("torch"):
        _run([gpu_like], gpu_opt, grads[:2])
    saved = gpu_opt.state_dict()
    assert "master" not in saved["state"][0] and saved["state"][0]["exp_avg"].dtype == torch.bfloat16
    ours = torch.nn.Parameter(gpu_like.detach().clone())
    opt = StochasticRoundingAdamW([ours], lr=1.0)
    opt.load_state_dict(copy.deepcopy(saved))
    state = opt.state[ours]
    assert torch.equal(state["master"], ours.detach().float())
    for key in ("exp_avg", "exp_avg_sq"):
        assert state[key].dtype == torch.float32 and torch.equal(state[key], saved["state"][0][key].float()), key
    fused = torch.nn.Parameter(gpu_like.detach().float())
    fused_opt = torch.optim.AdamW([fused], **hp, fused=True)
    fused_opt.load_state_dict(copy.deepcopy(saved))  # torch casts the bf16 moments to fp32, exactly
    # the loaded groups carry no "fused" (ours has none): torch would fall back to its foreach AdamW, whose fp32
    # ops round differently from the fused kernel on some CPUs (an AMD EPYC with AVX-512)
    fused_opt.param_groups[0]["fused"] = True
    _run([ours], opt, grads[2:])
    _run([fused], fused_opt, grads[2:])
    assert torch.equal(state["master"], fused.detach()) and torch.equal(ours.detach(), fused.detach().bfloat16())
    back = torch.nn.Parameter(ours.detach().clone())
    back_opt = StochasticRoundingAdamW([back], lr=1.0)
    with _path("torch"):
        back_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    loaded = back_opt.state[back]
    assert sorted(loaded) == ["exp_avg", "exp_avg_sq", "step"] and loaded["step"].item() == 4
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(loaded[key], state[key].bfloat16()), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_and_special_values_pass_through(backend):
    """A zero update leaves bf16 values as they are (their low 16 bits are 0, so no carry), NaN and inf included."""
    values = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -3.0e38, 2.0**-126]
    if backend == "torch":  # Triton 3.9's interpreter loads bf16 subnormals wrong (2^-133 -> 0, 1e-39 -> 4.4e-39)
        values.append(2.0**-133)
    p = torch.tensor(values * 64).bfloat16()
    zeros = torch.zeros_like(p)
    out = p.clone()
    opt_step = adamw_step_ if backend == "triton" else adamw_step_torch_
    opt_step(out, zeros, zeros.clone(), zeros.clone(), decay=1.0, beta1=0.9, beta2=0.999, step_size=0.0,
             bias2_sqrt=1.0, eps=1e-8, seed=step_seed(0, 0, 1))
    assert torch.equal(out.view(torch.int16)[~p.isnan()], p.view(torch.int16)[~p.isnan()]), out[:8]
    assert out[p.isnan()].isnan().all()


def _rounded_up(result, fp32):
    """(result [n] bf16 is fp32's upper neighbour in magnitude, its probability q: fp32's low 16 bits / 2^16)."""
    bits = fp32.view(torch.int32)
    lower = (bits & -65536).view(torch.float32)
    return result.float() != lower, (bits & 0xFFFF).double() / 65536


@pytest.mark.parametrize("backend", BACKENDS)
def test_param_and_moment_roundings_are_independent(backend):
    """The three bf16 roundings of an element draw independent bits: with a zero step (the param times decay alone)
    and beta1 = beta2 = 0 (exp_avg = g, exp_avg_sq = g^2, each one exact or one fp32 rounding of known value), two
    results both round up with probability q_a q_b; the count over n elements is within 5 standard deviations of
    its expectation. Shared bits would make it min(q_a, q_b): ~0.30 n against ~0.18 n for param and exp_avg here."""
    n = 4096
    gen = torch.Generator().manual_seed(0)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    p0 = (sign * (1 + torch.rand(n, generator=gen))).bfloat16()
    g = sign * (1 + torch.rand(n, generator=gen))  # fp32: random low 16 bits
    decay = 1 + 2.0**-9  # p0 (8 bits) times it: exact in fp32, between 1/4 and 1/2 of a bf16 spacing above p0
    p, m, v = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    opt_step = adamw_step_ if backend == "triton" else adamw_step_torch_
    with _path(backend):
        opt_step(p, g, m, v, decay=decay, beta1=0.0, beta2=0.0, step_size=0.0, bias2_sqrt=1.0, eps=1e-8,
                 seed=step_seed(0, 0, 1))
    ups = {name: _rounded_up(result, exact) for name, result, exact in
           (("param", p, p0.float() * decay), ("exp_avg", m, g), ("exp_avg_sq", v, g * g))}
    for a, b in (("param", "exp_avg"), ("param", "exp_avg_sq"), ("exp_avg", "exp_avg_sq")):
        (up_a, q_a), (up_b, q_b) = ups[a], ups[b]
        both = (up_a & up_b).sum().item()
        expect = (q_a * q_b).sum().item()
        sd = (q_a * q_b * (1 - q_a * q_b)).sum().sqrt().item()
        assert abs(both - expect) <= 5 * sd, (
            f"{a} and {b} both rounded up {both} times of {n}, independent bits {expect:.0f} +- {sd:.0f}, "
            f"shared bits {torch.minimum(q_a, q_b).sum().item():.0f}")


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors reach Triton only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_and_eager_do_the_same_math(dtype):
    """The same fp32 operations in the same order (the interpreter does not contract to FMA): the moments are
    bit-identical; the parameter too where torch's CPU sqrt and division round correctly, and on CPUs where they do
    not (an AMD EPYC with AVX-512: 1 ulp off for ~20% of elements, numpy's are correctly rounded) within that
    rounding: <= 1.5 ulp apart at each of sqrt, / bias2_sqrt and m / denom (4.5 x 2^-23 of the step term
    step_size * m / denom), plus one rounding of the result (an fp16 one for fp16). bf16 results draw different
    bits, but both are bf16 neighbours of the fp32 result of the same math (the eager path on fp32 copies)."""
    gen = torch.Generator().manual_seed(0)
    n = 1000
    p, m = (torch.randn(n, generator=gen) * 0.1).to(dtype), (torch.randn(n, generator=gen) * 1e-2).to(dtype)
    v, g = (torch.rand(n, generator=gen) * 1e-3).to(dtype), torch.randn(n, generator=gen)
    scalars = dict(decay=1 - 1e-4, beta1=0.9, beta2=0.999, step_size=1e-3 / (1 - 0.9**3),
                   bias2_sqrt=(1 - 0.999**3) ** 0.5, eps=1e-8, seed=step_seed(0, 0, 3))
    kernel, eager, fp32 = ([t.clone() for t in (p, m, v)] for _ in range(3))
    adamw_step_(kernel[0], g, kernel[1], kernel[2], **scalars)
    adamw_step_torch_(eager[0], g, eager[1], eager[2], **scalars)
    fp32 = [t.float() for t in fp32]
    adamw_step_torch_(fp32[0], g, fp32[1], fp32[2], **scalars)
    m1 = m.double() + (1 - scalars["beta1"]) * (g.double() - m.double())
    v1 = v.double() * scalars["beta2"] + (1 - scalars["beta2"]) * g.double() ** 2
    step_term = (scalars["step_size"] * m1 / (v1.sqrt() / scalars["bias2_sqrt"] + scalars["eps"])).abs()
    out_eps = torch.finfo(dtype).eps if dtype != torch.bfloat16 else 0.0
    param_tol = 4.5 * 2.0**-23 * step_term + out_eps * fp32[0].double().abs()
    for name, a, b, x in zip(("param", "exp_avg", "exp_avg_sq"), kernel, eager, fp32):
        if dtype != torch.bfloat16:
            tol = param_tol if name == "param" else torch.zeros(n, dtype=torch.float64)
            assert ((a.double() - b.double()).abs() <= tol).all(), _worst(name, a.double(), b.double(), tol)
        else:
            for got in (a, b):
                _assert_bf16_neighbour(name, got, x.double(), torch.zeros(n, dtype=torch.float64))


class _CountLaunches:
    """Stands in for a Triton kernel and counts its launches (kernel[grid](...))."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@contextlib.contextmanager
def _multi_tensor(block: int | None = None):
    """The optimizer's multi-tensor launcher with `block` elements per program (small ones spread tensors of a few
    hundred elements over several programs), its kernel's launches counted."""
    counter = _CountLaunches(kernels_adamw._adamw_multi_tensor_kernel)
    launcher = functools.partial(kernels_adamw.adamw_multi_tensor_launch_, block=block)
    with mock.patch.object(kernels_adamw, "_adamw_multi_tensor_kernel", counter), \
            mock.patch.object(kernels_adamw, "adamw_multi_tensor_launch_", launcher):
        yield counter


def _kernel_scalars(hp: dict, step: int) -> dict:
    """adamw_step_'s scalars for torch's AdamW hyper-parameters at `step`, the seed aside."""
    (beta1, beta2), lr = hp["betas"], hp["lr"]
    return dict(decay=1 - lr * hp["weight_decay"], beta1=beta1, beta2=beta2, step_size=lr / (1 - beta1**step),
                bias2_sqrt=(1 - beta2**step) ** 0.5, eps=hp["eps"])


# sizes around the small blocks the CPU tests use (16 to 64), and 1
SIZES = st.one_of(st.sampled_from([1, 15, 16, 17, 64, 65, 129]), st.integers(1, 300))
BLOCKS = st.sampled_from([16, 32, 64])
KERNEL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors reach Triton only under TRITON_INTERPRET=1")
@given(tensors=st.lists(st.tuples(SIZES, st.sampled_from(KERNEL_DTYPES), st.sampled_from(KERNEL_DTYPES),
                                  st.booleans()), min_size=1, max_size=6),
       block=BLOCKS, seed=st.integers(0, 2**16))
def test_multi_tensor_kernel_equals_per_tensor_kernel(tensors, block, seed):
    """adamw_multi_tensor_step_ on a list of tensors (param and grad dtypes mixed, odd sizes, some not 16-byte
    aligned: launches of their own) equals adamw_step_ on each with its own seed, bit for bit: stochastic rounding
    draws the same Philox bits for bf16, fp16 and fp32 round to nearest alike."""

    def make():
        gen = torch.Generator().manual_seed(seed)
        out = []
        for n, dtype, grad_dtype, shifted in tensors:
            # shifted: a view one element into its buffer, contiguous at an address that is not 16-byte aligned
            p, m, v = ((torch.randn(n + shifted, generator=gen) * scale).abs_().to(dtype)[shifted:]
                       for scale in (1.0, 1e-2, 1e-3))
            out.append((p, torch.randn(n, generator=gen).to(grad_dtype), m, v))
        return out

    ours, theirs = make(), make()
    seeds = [step_seed(seed, i, 3) for i in range(len(tensors))]
    scalars = _kernel_scalars(dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1), 3)
    adamw_multi_tensor_step_(*(list(column) for column in zip(*ours)), seeds, **scalars, block=block)
    for (p, g, m, v), seed_i in zip(theirs, seeds):
        adamw_step_(p, g, m, v, **scalars, seed=seed_i)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for name, j in (("param", 0), ("exp_avg", 2), ("exp_avg_sq", 3)):
            assert torch.equal(a[j], b[j]), f"tensor {i} {tensors[i]} {name}: {(a[j] != b[j]).sum()} elements differ"


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors reach Triton only under TRITON_INTERPRET=1")
@given(tensors=st.lists(st.tuples(SIZES, st.sampled_from(KERNEL_DTYPES)), min_size=1, max_size=5),
       steps=st.integers(1, 3), block=BLOCKS, seed=st.integers(0, 2**16), data=st.data())
def test_optimizer_launches_once_per_group_step_and_dtype(tensors, steps, block, seed, data):
    """Over several steps, two param groups, some grads None (skipped: no state, no step counted, so step counts
    part ways): each parameter ends each step equal bit for bit to the per-tensor kernel called as the optimizer did
    before (its own step count, key step_seed(seed, its index, that count)), and the kernel ran once per (group,
    step count, dtype) with a grad."""
    gen = torch.Generator().manual_seed(seed)
    hps = [dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
           dict(lr=3e-3, betas=(0.8, 0.999), eps=1e-6, weight_decay=0.0)]
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n, dtype in tensors]
    split = data.draw(st.integers(1, len(params)), label="params in the first group")
    groups = [params[:split], params[split:]]
    opt = StochasticRoundingAdamW([{"params": ps, **hp} for ps, hp in zip(groups, hps) if ps], seed=seed)
    group_of = [0] * split + [1] * (len(params) - split)
    ref = [(p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    counts = [0] * len(params)
    with _path("triton"), _multi_tensor(block) as kernel:
        for step in range(1, steps + 1):
            has_grad = data.draw(st.lists(st.booleans(), min_size=len(params), max_size=len(params)),
                                 label=f"grads at step {step}")
            launches = kernel.launches
            for p, has in zip(params, has_grad):
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype) if has else None
            opt.step()
            for i, (p, has) in enumerate(zip(params, has_grad)):
                if has:
                    counts[i] += 1
                    adamw_step_(ref[i][0], p.grad, *ref[i][1:], **_kernel_scalars(hps[group_of[i]], counts[i]),
                                seed=step_seed(seed, i, counts[i]))
            want = {(group_of[i], counts[i], p.dtype) for i, p in enumerate(params) if has_grad[i]}
            assert kernel.launches - launches == len(want), f"step {step}: launches for {sorted(map(str, want))}"
            for i, p in enumerate(params):
                state = opt.state[p]
                assert bool(state) == (counts[i] > 0), f"step {step} param {i}: state {sorted(state)}"
                got = (p.detach(), state["exp_avg"], state["exp_avg_sq"]) if state else (p.detach(),)
                for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, ref[i]):
                    assert torch.equal(a, b), f"step {step} param {i} {tensors[i]} {name}"
                assert not state or state["step"].item() == counts[i]


@pytest.mark.parametrize("backend", BACKENDS)
@given(sizes=st.lists(SIZES, min_size=2, max_size=5), steps=st.integers(1, 3), seed=st.integers(0, 2**16), **HP)
def test_many_tensors_follow_fp64_adamw(backend, sizes, steps, seed, draw_lr, beta1, beta2, eps, wd):
    """Tensors of odd sizes stepped together (several programs each), fp32 and bf16 alternately: after each step
    the fp32 ones lie within the derived bound of fp64 AdamW (errors carried along the trajectory), the bf16 ones
    are bf16 neighbours of the fp64 step from their bf16 inputs."""
    hp = _hp(draw_lr, beta1, beta2, eps, wd)
    gen = torch.Generator().manual_seed(seed)
    dtypes = [(torch.float32, torch.bfloat16)[i % 2] for i in range(len(sizes))]
    params = [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.05).to(dtype)) for n, dtype in zip(sizes, dtypes)]
    opt = StochasticRoundingAdamW(params, **hp, seed=seed)
    zeros = [torch.zeros(n, dtype=torch.float64) for n in sizes]
    fp32_ref = [((p.detach().double(), z, z), (0.0, 0.0, 0.0)) for p, z in zip(params, zeros)]
    with _path(backend), _multi_tensor(block=16):
        for step in range(1, steps + 1):
            inputs = [[p.detach().double()] + [opt.state[p][k].double() if opt.state[p] else z
                                                for k in ("exp_avg", "exp_avg_sq")] for p, z in zip(params, zeros)]
            grads = [torch.randn(n, generator=gen) * 10.0 ** (torch.rand((), generator=gen).item() * 4 - 3)
                     for n in sizes]
            for p, g in zip(params, grads):
                p.grad = g.to(p.dtype)
            opt.step()
            for i, (p, g) in enumerate(zip(params, grads)):
                state = opt.state[p]
                got = (p.detach(), state["exp_avg"], state["exp_avg_sq"])
                if p.dtype == torch.bfloat16:
                    want, tol = _step_reference(*inputs[i], p.grad.double(), step, hp)
                    for name, a, w, t in zip(("param", "exp_avg", "exp_avg_sq"), got, want, tol):
                        _assert_bf16_neighbour(f"step {step} param {i} {name}", a, w, t)
                    continue
                fp32_ref[i] = want, tol = _step_reference(*fp32_ref[i][0], g.double(), step, hp, fp32_ref[i][1])
                for name, a, w, t in zip(("param", "exp_avg", "exp_avg_sq"), got, want, tol):
                    a = a.double()
                    assert ((a - w).abs() <= t).all(), _worst(f"step {step} param {i} {name}", a, w, t)


def test_backend_choice(monkeypatch):
    """bf16 on the CPU steps its fp32 master, with or without the interpreter; other dtypes the kernel under the
    interpreter (or on CUDA), the eager path without it, and the eager path for fp64."""
    calls = []
    monkeypatch.setattr("fastgrpo.kernels.adamw.adamw_multi_tensor_launch_", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(stochastic_adamw, "adamw_step_torch_", lambda *a, **k: calls.append("torch"))
    monkeypatch.setattr(stochastic_adamw, "adamw_step_master_", lambda *a, **k: calls.append("master"))
    cases = [("1", torch.bfloat16, "master"), (None, torch.bfloat16, "master"), ("1", torch.float32, "triton"),
             (None, torch.float32, "torch"), ("1", torch.float16, "triton"), ("1", torch.float64, "torch")]
    for interpret, dtype, _ in cases:
        if interpret:
            monkeypatch.setenv("TRITON_INTERPRET", interpret)
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        p = torch.nn.Parameter(torch.ones(3, dtype=dtype))
        p.grad = torch.ones_like(p)
        StochasticRoundingAdamW([p]).step()
    assert calls == [want for _, _, want in cases]


def _mixed_model(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
            for shape, dtype in (((33, 7), torch.bfloat16), ((5,), torch.float32), ((129,), torch.bfloat16))]


def _run(params, opt, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        opt.step()


def _groups(params, seed):
    return StochasticRoundingAdamW([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}], lr=1e-3,
                                   weight_decay=0.1, seed=seed)


@pytest.mark.parametrize("path", [*BACKENDS, "master"])
def test_resume_from_state_dict_is_bit_identical(path):
    """3 + 3 steps through torch.save / torch.load equal 6 straight steps bit for bit, fp32 masters included (the
    seed is restored from the state_dict: the resumed optimizer is built with another one); a different seed draws
    different bits, or, with masters (no random bits), gives the same weights."""
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=gen) for p in _mixed_model(0)] for _ in range(6)]
    with _path(path):
        straight = _mixed_model(0)
        straight_opt = _groups(straight, seed=7)
        _run(straight, straight_opt, grads)
        first = _mixed_model(0)
        first_opt = _groups(first, seed=7)
        _run(first, first_opt, grads[:3])
        buffer = io.BytesIO()
        torch.save({"params": [p.detach() for p in first], "optimizer": first_opt.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
        resumed = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
        resumed_opt = _groups(resumed, seed=12345)
        resumed_opt.load_state_dict(saved["optimizer"])
        _run(resumed, resumed_opt, grads[3:])
        other = _mixed_model(0)
        _run(other, _groups(other, seed=8), grads)
    for i, (a, b) in enumerate(zip(straight, resumed)):
        assert torch.equal(a, b), f"param {i}"
        master = path == "master" and a.dtype == torch.bfloat16
        keys = ("exp_avg", "exp_avg_sq", "step") + (("master",) if master else ())
        assert sorted(resumed_opt.state[b]) == sorted(keys), f"param {i}: {sorted(resumed_opt.state[b])}"
        for key in keys:
            assert torch.equal(straight_opt.state[a][key], resumed_opt.state[b][key]), f"param {i} {key}"
    assert torch.equal(straight[0], other[0]) == (path == "master"), "seed 7 and seed 8: bits differ only if drawn"


def test_loads_a_torch_adamw_checkpoint():
    """torch.optim.AdamW's fp32 state_dict loads (its groups lack `seed`: the default is used), and 2 further steps
    stay within the fp32 bound of torch continuing itself; amsgrad is refused (the update would differ)."""
    gen = torch.Generator().manual_seed(0)
    hp = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.05)
    p_torch = torch.nn.Parameter(torch.randn(40, generator=gen))
    grads = [torch.randn(40, generator=gen) for _ in range(5)]
    opt_torch = torch.optim.AdamW([p_torch], **hp, foreach=False)
    _run([p_torch], opt_torch, [[g] for g in grads[:3]])
    p_ours = torch.nn.Parameter(p_torch.detach().clone())
    opt_ours = StochasticRoundingAdamW([p_ours], lr=1.0)
    opt_ours.load_state_dict(copy.deepcopy(opt_torch.state_dict()))  # as from a file: torch's load aliases tensors
    assert opt_ours.param_groups[0]["seed"] == 0 and opt_ours.param_groups[0]["lr"] == hp["lr"]
    state = opt_torch.state[p_torch]
    ref = (p_torch.detach().double(), state["exp_avg"].double(), state["exp_avg_sq"].double())
    err = (0, 0, 0)
    for step, g in enumerate(grads[3:], 4):
        ref, err = _step_reference(*ref, g.double(), step, hp, err)
    _run([p_torch], opt_torch, [[g] for g in grads[3:]])
    _run([p_ours], opt_ours, [[g] for g in grads[3:]])
    ours, theirs = p_ours.detach().double(), p_torch.detach().double()
    assert ((ours - theirs).abs() <= 2 * err[0]).all(), _worst("param", ours, theirs, 2 * err[0])
    amsgrad = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        StochasticRoundingAdamW([torch.nn.Parameter(torch.zeros(2))]).load_state_dict(amsgrad.state_dict())


def test_lambda_lr_sets_the_step_size():
    """LambdaLR writes param_groups' lr: a factor of 0 leaves bf16 weights exactly where they are, 1 moves them."""
    p = torch.nn.Parameter(torch.randn(64).bfloat16())
    opt = StochasticRoundingAdamW([p], lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda update: float(update > 0))
    before = p.detach().clone()
    p.grad = torch.randn(64).bfloat16()
    opt.step()
    assert torch.equal(p.detach(), before)
    schedule.step()
    opt.step()
    assert (p.detach() != before).float().mean() > 0.9


def test_step_seed():
    """Keys differ by seed, parameter, step and shard coordinates; all-zero coordinates are rank 0's unsharded key;
    every key is an int64 above 2^62."""
    keys = {step_seed(s, i, t, c) for s in (0, 1) for i in (0, 1) for t in (1, 2) for c in ((), (1, 0), (0, 1))}
    assert len(keys) == 24 and all(2**62 <= k < 2**63 for k in keys)
    assert step_seed(0, 3, 5, (0, 0)) == step_seed(0, 3, 5)


@given(params=st.lists(st.tuples(st.integers(-2**63, 2**64 - 1), st.integers(0, 10**6),
                                 st.lists(st.integers(0, 7), max_size=3)), min_size=1, max_size=8),
       step=st.integers(1, 2**40))
def test_step_seeds_equal_step_seed(params, step):
    """The optimizer's vectorized keys (int64 tensor ops that wrap as uint64 does) equal step_seed's Python ints, for
    any seed, index, step and shard coordinates (all-zero ones dropped, as step_seed drops them)."""
    shards = [tuple(c) if any(c) else () for _, _, c in params]
    width = max(map(len, shards))
    got = stochastic_adamw.step_seeds(
        torch.tensor([stochastic_adamw.step_key_prefix(seed, index) for seed, index, _ in params]), step,
        torch.tensor([list(c) + [-1] * (width - len(c)) for c in shards], dtype=torch.int64).reshape(len(params), width))
    assert got.tolist() == [step_seed(seed, index, step, tuple(c)) for seed, index, c in params]


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors reach Triton only under TRITON_INTERPRET=1")
def test_plan_is_reused_and_rebuilt_when_what_it_read_changes():
    """The optimizer plans a group's step once and reuses the plan while the same parameters have grads and their
    storage, dtypes and states stay: new grad tensors each step (one not 16-byte aligned: a launch of its own, one
    transposed: copied) keep it. A parameter moved to new storage, a moment replaced, a grad of another dtype, a
    parameter without a grad (and its return), a changed seed, load_state_dict, a step counter written in place (as
    dcp.load writes into state_dict()'s tensors) and a cleared state each make a new plan. After every step each
    parameter equals the per-tensor kernel bit for bit (its own step count and key)."""
    gen = torch.Generator().manual_seed(0)
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
              for shape, dtype in (((37,), torch.float32), ((5, 9), torch.bfloat16), ((70,), torch.bfloat16))]
    opt = StochasticRoundingAdamW(params, **hp, seed=3)
    ref = [[p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)] for p in params]
    counts = [0] * len(params)
    plans = []
    real_plan = opt._plan
    opt._plan = lambda *args: plans.append(real_plan(*args)) or plans[-1]

    def grad(i, dtype=None):
        p = params[i]
        g = torch.randn(p.shape, generator=gen).to(dtype or p.dtype)
        if i == 1:  # transposed storage: not contiguous
            g = torch.randn(tuple(reversed(p.shape)), generator=gen).to(g.dtype).t()
        if i == 2:  # one element into its buffer: not 16-byte aligned
            g = torch.randn(p.numel() + 1, generator=gen).to(g.dtype)[1:]
        return g

    events = ["first", "same", "same", "param storage", "same", "moment", "grad dtype", "grad dtype back", "same",
              "no grad", "all grads", "seed", "load_state_dict", "same", "step in place", "same", "state cleared",
              "same"]
    replans = {"first", "param storage", "moment", "grad dtype", "grad dtype back", "no grad", "all grads", "seed",
               "load_state_dict", "step in place", "state cleared"}
    if hasattr(params[2], "grad_dtype"):
        params[2].grad_dtype = None  # torch >= 2.10 refuses a grad of another dtype unless told to take one
    else:
        events = [event for event in events if not event.startswith("grad dtype")]
    with _path("triton"), _multi_tensor(block=16) as kernel:
        for step, event in enumerate(events):
            has_grad = [not (event == "no grad" and i == 0) for i in range(len(params))]
            for i, p in enumerate(params):
                p.grad = grad(i, torch.float32 if event == "grad dtype" and i == 2 else None) if has_grad[i] else None
            if event == "param storage":
                params[1].data = params[1].data.clone()
            if event == "moment":
                opt.state[params[2]]["exp_avg"] = opt.state[params[2]]["exp_avg"].clone()
            if event == "seed":
                opt.param_groups[0]["seed"] = 4
            if event == "load_state_dict":
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            if event == "step in place":
                opt.state[params[0]]["step"].fill_(1.0)
                counts[0] = 1
            if event == "state cleared":  # every parameter starts again from zero moments and step 0
                opt.state.clear()
                counts = [0] * len(params)
                for r in ref:
                    r[1].zero_(), r[2].zero_()
            before, launches = len(plans), kernel.launches
            opt.step()
            assert len(plans) - before == (event in replans), f"step {step} ({event}): plans made"
            for i, p in enumerate(params):
                if has_grad[i]:
                    counts[i] += 1
                    adamw_step_(ref[i][0], p.grad, *ref[i][1:], **_kernel_scalars(hp, counts[i]),
                                seed=step_seed(opt.param_groups[0]["seed"], i, counts[i]))
                state = opt.state[p]
                for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"),
                                      (p.detach(), state["exp_avg"], state["exp_avg_sq"]), ref[i]):
                    assert torch.equal(a, b), f"step {step} ({event}) param {i} {name}"
                assert state["step"].item() == counts[i] and state["step"].dtype == torch.float32
            # fp32 with its aligned grad, bf16 aligned (the transposed grad's copy), bf16 with its unaligned grad
            assert kernel.launches - launches == (2 if event == "no grad" else 3), f"step {step} ({event}): launches"


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.fixture
def one_rank_mesh():
    """A 1-rank gloo device mesh on the CPU, where FSDP2's CPU offload keeps the shards."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not built in")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path", ["stochastic", "master"])
def test_dtensor_parameters_update_their_local_shard(one_rank_mesh, path):
    """An FSDP2-style DTensor parameter (Shard(0) on a 1-rank gloo mesh) gets the same update as the plain tensor
    (rounding stochastically, coordinate 0 draws the unsharded bits) and DTensor states, as torch's AdamW keeps
    them; with masters, the master is a DTensor too."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    full = torch.randn(37, 5).bfloat16()
    plain = torch.nn.Parameter(full.clone())
    sharded = torch.nn.Parameter(distribute_tensor(full, one_rank_mesh, [Shard(0)]))
    opts = StochasticRoundingAdamW([plain], lr=1e-2), StochasticRoundingAdamW([sharded], lr=1e-2)
    with _path(path):
        for _ in range(3):
            g = torch.randn(37, 5).bfloat16()
            plain.grad, sharded.grad = g, distribute_tensor(g, one_rank_mesh, [Shard(0)])
            for opt in opts:
                opt.step()
    assert torch.equal(sharded.full_tensor(), plain.detach())
    keys = ("exp_avg", "exp_avg_sq") + (("master",) if path == "master" else ())
    for key in keys:
        state = opts[1].state[sharded][key]
        assert isinstance(state, DTensor) and state.placements == sharded.placements, key
        assert torch.equal(state.full_tensor(), opts[0].state[plain][key]), key


def test_distributed_checkpoint_keeps_the_masters(one_rank_mesh, tmp_path):
    """FSDP2 (fully_shard) on a 1-rank CPU mesh, bf16: as fastgrpo.train.distributed saves and restores, with
    Distributed Checkpoint, the masters and fp32 moments go through as DTensors; 2 + 2 steps through a checkpoint,
    restored into a model and optimizer built afresh from other weights, equal 4 straight steps bit for bit (with
    masters re-derived from the bf16 weights they would not: the guard checks that the masters hold more)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3)).bfloat16()
        for layer in model:
            fully_shard(layer, mesh=one_rank_mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        return model, StochasticRoundingAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=gen).bfloat16() for p in build(0)[0].parameters()] for _ in range(4)]

    def run(model, opt, step_grads):
        for gs in step_grads:
            for p, g in zip(model.parameters(), gs):
                p.grad = distribute_tensor(g, one_rank_mesh, p.placements)
            opt.step()

    straight = build(0)
    run(*straight, grads)
    first = build(0)
    run(*first, grads[:2])
    masters = [first[1].state[p]["master"].full_tensor() for p in first[0].parameters()]
    assert any(not torch.equal(m, p.full_tensor().float()) for m, p in zip(masters, first[0].parameters()))
    model_state, optim_state = get_state_dict(*first)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp_path)
    resumed = build(1)
    model_state, optim_state = get_state_dict(*resumed)
    saved = {"model": model_state, "optimizer": optim_state}
    dcp.load(saved, checkpoint_id=tmp_path)
    set_state_dict(*resumed, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])
    run(*resumed, grads[2:])
    for (name, a), b in zip(straight[0].named_parameters(), resumed[0].parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
        for key in ("master", "exp_avg", "exp_avg_sq", "step"):
            want, got = (_full(opt.state[p][key]) for opt, p in ((straight[1], a), (resumed[1], b)))
            assert got.dtype == want.dtype and torch.equal(got, want), f"{name} {key}"


def test_sharded_checkpoint_without_masters_restores_with_masters(one_rank_mesh, tmp_path):
    """A Distributed Checkpoint written by a run whose bf16 weights rounded stochastically (on the GPU: no
    masters) resumes into a CPU-offloaded FSDP2 run through fastgrpo.train.distributed.load_sharded_state: the
    weights and moments are the checkpoint's, the masters are the loaded weights in fp32 (not the fresh model's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor

    from fastgrpo.train.distributed import load_sharded_state

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3)).bfloat16()
        for layer in model:
            fully_shard(layer, mesh=one_rank_mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        return model, StochasticRoundingAdamW(model.parameters(), lr=1e-3)

    written = build(0)
    with _path("torch"):
        for _ in range(2):
            for p in written[0].parameters():
                p.grad = distribute_tensor(torch.randn(p.shape).bfloat16(), one_rank_mesh, p.placements)
            written[1].step()
    assert all("master" not in written[1].state[p] for p in written[0].parameters())
    model_state, optim_state = get_state_dict(*written)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp_path)
    resumed = build(1)
    load_sharded_state(tmp_path, *resumed)
    for (name, a), b in zip(written[0].named_parameters(), resumed[0].parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
        state = resumed[1].state[b]
        assert torch.equal(_full(state["master"]), b.full_tensor().float()), name
        for key in ("exp_avg", "exp_avg_sq"):
            want = _full(written[1].state[a][key]).float()
            assert _full(state[key]).dtype == torch.float32 and torch.equal(_full(state[key]), want), f"{name} {key}"


@pytest.mark.gpu
def test_cuda_kernel_against_fp64():
    """The kernel on CUDA: bf16 results are neighbours of fp64 over several steps (odd size, many programs) and
    unbiased at lr 1e-6; fp32 within the derived bound of fp64, as torch's fused AdamW is."""
    _check_bf16_steps((1 << 16) + 3, 4, 0, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), "cuda")
    _check_unbiased("cuda", n=1 << 16, draws=8)
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    p0 = torch.randn(100_003, device="cuda")
    ours, fused = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    optimizers = StochasticRoundingAdamW([ours], **hp), torch.optim.AdamW([fused], **hp, fused=True)
    zeros = torch.zeros_like(p0, dtype=torch.float64)
    ref, err = (p0.double(), zeros, zeros), (0, 0, 0)
    for step in range(1, 4):
        g = torch.randn_like(p0)
        ours.grad, fused.grad = g, g.clone()
        for opt in optimizers:
            opt.step()
        ref, err = _step_reference(*ref, g.double(), step, hp, err)
    for name, p in (("fused torch", fused), ("ours", ours)):
        got = p.detach().double()
        assert ((got - ref[0]).abs() <= err[0]).all(), _worst(name, got, ref[0], err[0])


@pytest.mark.gpu
def test_cuda_multi_tensor_step_equals_per_tensor_kernel():
    """On CUDA, where the kernels are compiled (fused multiply-adds; 128-bit accesses on whole blocks, scalar ones on
    a tensor's last partial block and at unaligned addresses), 3 optimizer steps equal the per-tensor kernel bit for
    bit: whole and partial blocks, many blocks, odd sizes, 1 element, bf16 / fp16 / fp32, and a parameter 2 bytes
    past a 16-byte boundary; one launch per dtype and alignment per step."""
    chunk = 1 << 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen, device="cuda").to(dtype))
              for dtype in (torch.bfloat16, torch.float16, torch.float32)
              for n in (3 * chunk, 2 * chunk + 1027, 1, 1536, 257 * 129)]
    params.append(torch.nn.Parameter(torch.randn(1001, generator=gen, device="cuda").bfloat16()[1:]))
    assert params[-1].data_ptr() % 16 != 0
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opt = StochasticRoundingAdamW(params, **hp, seed=5)
    ref = [(p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    with _multi_tensor() as kernel:
        for step in range(1, 4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, device="cuda").to(p.dtype)
            opt.step()
            for i, (p, (rp, rm, rv)) in enumerate(zip(params, ref)):
                adamw_step_(rp, p.grad, rm, rv, **_kernel_scalars(hp, step), seed=step_seed(5, i, step))
                state = opt.state[p]
                for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"),
                                      (p.detach(), state["exp_avg"], state["exp_avg_sq"]), (rp, rm, rv)):
                    assert torch.equal(a, b), f"step {step} param {i} ({p.dtype}, {p.numel()}) {name}"
    assert kernel.launches == 3 * 4


def _vector_accesses(cases: list[tuple[str, str, bool]]) -> list[tuple[int, int]] | str:
    """(ld.global.v4.b32, st.global.v4.b32) counts in the sm_90 PTX of the multi-tensor kernel (BLOCK 1024, 4 warps)
    for each (param dtype, grad dtype, aligned), compiled by Triton's own stages without a GPU (ptxas is not run).
    Run it where TRITON_INTERPRET is unset: it compiles the real kernels. A string: why this Triton cannot."""
    import triton
    import triton.language as tl

    try:  # Triton's internals, as of 3.9
        from triton._C import libtriton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        target = GPUTarget("cuda", 90, 32)
        backend = triton.compiler.make_backend(target)
        options = backend.parse_options({"num_warps": 4})
    except (ImportError, AttributeError, TypeError) as error:
        return f"this Triton does not compile to PTX this way: {error!r}"
    types = {"bf16": tl.bfloat16, "fp32": tl.float32}
    scalars = ("decay", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size", "bias2_sqrt", "eps")
    counts = []
    for p_dtype, g_dtype, aligned in cases:
        constexprs = dict(P_TYPE=types[p_dtype], G_TYPE=types[g_dtype], ALIGNED=aligned, BLOCK=1024,
                          STOCHASTIC=p_dtype == "bf16")
        signature = {"TABLE": "*i64", "tensors": "i32", **{name: "fp32" for name in scalars},
                     **{name: "constexpr" for name in constexprs}}
        source = ASTSource(fn=kernels_adamw._adamw_multi_tensor_kernel, signature=signature, constexprs=constexprs)
        context = libtriton.ir.context()
        libtriton.ir.load_dialects(context)
        backend.load_dialects(context)
        module = source.make_ir(target, options, backend.get_codegen_implementation(options),
                                backend.get_module_map(), context)
        stages = {}
        backend.add_stages(stages, options, source.language)
        for name in ("ttir", "ttgir", "llir", "ptx"):
            module = stages[name](module, {})
        counts.append((module.count("ld.global.v4.b32"), module.count("st.global.v4.b32")))
    return counts


def test_multi_tensor_kernel_keeps_128_bit_accesses():
    """In sm_90 PTX, a whole block of 16-byte-aligned tensors reads param, grad and both moments and writes param and
    both moments with 128-bit accesses (one per 8 bf16 or 4 fp32 values of a thread; a tensor's last partial block
    takes scalar ones); unaligned tensors get none. Compiled in a fresh process without TRITON_INTERPRET."""
    cases = [("bf16", "bf16", True), ("bf16", "fp32", True), ("fp32", "fp32", True), ("bf16", "bf16", False)]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    tests = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(tests), tests, env.get("PYTHONPATH", "")])
    code = f"import json, test_adamw; print(json.dumps(test_adamw._vector_accesses({cases!r})))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tests, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    if isinstance(counts, str):
        pytest.skip(counts)
    per_thread = 1024 // (4 * 32)  # BLOCK over 4 warps of 32 threads: 8 values, 16 bytes of bf16, 32 of fp32
    vectors = {"bf16": per_thread * 2 // 16, "fp32": per_thread * 4 // 16}
    want = [(3 * vectors[p] + vectors[g], 3 * vectors[p]) if aligned else (0, 0) for p, g, aligned in cases]
    assert [tuple(c) for c in counts] == want
