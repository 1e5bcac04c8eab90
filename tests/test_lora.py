"""fastgrpo.ops.lora and patch_model's fused_lora against PEFT 0.21's LoRA Linear (real PEFT, tiny shapes, CPU).

The claims: lora_dtype="input" (lora_add, the default) is within a derived rounding bound of fp64, for the op and for
every LoRA layer of a patched model, as PEFT's forward under autocast is; lora_dtype="adapter" (lora_delta) is
bitwise PEFT's forward and one-chunk gradients, chunked gradients within fp32 rounding of fp64; every case PEFT's
vanilla branch does not cover runs PEFT's forward; the backward keeps the layer's input instead of a copy in the
adapter's dtype.
"""
from __future__ import annotations

import contextlib
import copy
import types

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from peft.helpers import disable_input_dtype_casting
import torch.nn.functional as F
from torch import nn

from fastgrpo.ops.lora import lora_add, lora_delta, lora_linear
from fastgrpo.patching import patch_model, unpatch_model
from fastgrpo.patching.forwards import lora_linear_forward
from tests.test_patching import batch, tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (base dtype, adapter dtype): PEFT upcasts adapters of a bf16 base to fp32 by default; bf16 adapters on request.
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
]
# Relative to the largest fp64 value: fp32 sums of <= 100 products; bf16 rounds h and the output (eps 7.8e-3).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ONLY_LORA = dict(rms_norm=False, rope=False, swiglu=False, fused_loss=False)  # the rest stays PEFT's / HF's
PEFT_BITWISE = dict(ONLY_LORA, lora_dtype="adapter")


class Proj(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def lora_layer(in_features, out_features, r, alpha, base_dtype, adapter_dtype, seed=0, **config):
    """A PEFT LoRA Linear around a frozen nn.Linear; init_lora_weights=False: B is not zero."""
    torch.manual_seed(seed)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], init_lora_weights=False, **config)
    model = get_peft_model(Proj(in_features, out_features).to(base_dtype), lora, autocast_adapter_dtype=False)
    layer = model.base_model.model.proj
    for name, p in layer.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)
    return layer


def fused(layer, lora_dtype="adapter"):
    """The forward patch_model binds, on one layer (lora_dtype "adapter": the bitwise-PEFT one)."""
    return types.MethodType(lora_linear_forward(layer.forward, lora_dtype=lora_dtype), layer)


def out_and_grads(layer, forward, x, grad_out):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = forward(x)
    out.backward(grad_out.to(out.dtype))
    return [out.detach(), x.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad]


shapes = dict(
    n=st.integers(1, 33).map(lambda k: 2 * k - 1),  # odd token counts
    in_features=st.integers(1, 40),
    out_features=st.integers(1, 40),
    r=st.integers(1, 8),
    alpha=st.sampled_from([1, 8, 16, 32]),
    rslora=st.booleans(),
    dtypes=st.sampled_from(DTYPES),
)


@given(**shapes)
def test_patched_layer_is_bitwise_peft(n, in_features, out_features, r, alpha, rslora, dtypes):
    layer = lora_layer(in_features, out_features, r, alpha, *dtypes, use_rslora=rslora)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, n, in_features, generator=g).to(dtypes[0])
    grad_out = torch.randn(1, n, out_features, generator=g)
    want = out_and_grads(layer, layer.forward, x, grad_out)
    got = out_and_grads(layer, fused(layer), x, grad_out)
    for name, a, b in zip(["out", "dx", "dA", "dB"], got, want):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name


@given(**shapes, chunk_tokens=st.integers(1, 70))
def test_chunked_grads_within_rounding_of_fp64(n, in_features, out_features, r, alpha, rslora, dtypes, chunk_tokens):
    base_dtype, adapter_dtype = dtypes
    layer = lora_layer(in_features, out_features, r, alpha, base_dtype, adapter_dtype, use_rslora=rslora)
    weight_a, weight_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    scaling = layer.scaling["default"]
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, n, in_features, generator=g).to(base_dtype)
    grad_out = torch.randn(2, n, out_features, generator=g).to(adapter_dtype)

    def run(x, a, b, delta):
        x, a, b = (t.detach().requires_grad_() for t in (x, a, b))
        out = delta(x, a, b)
        return [out, *torch.autograd.grad(out, (x, a, b), grad_out.to(out.dtype))]

    peft_ops = lambda x, a, b: F.linear(F.linear(x, a), b) * scaling  # noqa: E731 (eager, fp64)
    want = run(x.double(), weight_a.double(), weight_b.double(), peft_ops)
    got = run(x, weight_a, weight_b, lambda x, a, b: lora_delta(x, a, b, scaling, chunk_tokens=chunk_tokens))
    low = TOL[torch.bfloat16 if torch.bfloat16 in dtypes else torch.float32]
    tols = [TOL[adapter_dtype], low, TOL[adapter_dtype], TOL[adapter_dtype]]  # dx is rounded to x's dtype
    for name, a, b, tol in zip(["out", "dx", "dA", "dB"], got, want, tols):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * b.abs().max().item(), msg=name)
    assert [t.dtype for t in got[1:]] == [base_dtype, adapter_dtype, adapter_dtype]


def test_chunked_bf16_dA_sums_its_chunks_in_fp32():
    """lora_delta's dA over many chunks of bf16 adapters: each chunk's part is a bf16 GEMM (rounded once), the parts
    are summed in fp32 and the total rounded once. Bound per element, from the fp64 value of the same bf16 inputs,
    with S = sum_t |s g_t B| |x_t|: g s rounded (2^-8 |term|), dh = (g s) B rounded (2^-8 + r 2^-24), each part
    rounded (2^-8 of its |part|, summing to <= S), the total rounded (2^-8 |ref|): 2^-8 (3.1 S + |ref|). All terms
    positive here, so a bf16 running sum over the 512 chunks stalls far below (at 256 x a term, whose spacing
    is 2 terms)."""
    g = torch.Generator().manual_seed(0)
    n, in_features, out_features, r, scaling = 512, 6, 5, 4, 2.0
    x = torch.rand(1, n, in_features, generator=g).bfloat16()
    weight_a = torch.rand(r, in_features, generator=g).bfloat16()
    weight_b = torch.rand(out_features, r, generator=g).bfloat16()
    grad_out = (0.5 + torch.rand(1, n, out_features, generator=g)).bfloat16()
    a = weight_a.detach().requires_grad_()
    out = lora_delta(x, a, weight_b, scaling, chunk_tokens=1)
    (got,) = torch.autograd.grad(out, a, grad_out)
    dh = (grad_out.double() * scaling) @ weight_b.double()  # [1, n, r]
    ref = dh[0].T @ x[0].double()  # [r, in]
    terms = (grad_out.double().abs() * scaling) @ weight_b.double().abs()
    S = terms[0].T @ x[0].double().abs()
    assert_within("dA over 512 chunks", got, ref, 3.1 * S + ref.abs(), 2.0**-8)


@pytest.mark.parametrize("lora_dtype", ["input", "adapter"])
def test_frozen_input_gets_no_gradient(lora_dtype):
    layer = lora_layer(8, 6, 2, 4, torch.bfloat16, torch.float32)
    x = torch.randn(5, 8, dtype=torch.bfloat16)  # e.g. the first layer's input without enable_input_require_grads
    fused(layer, lora_dtype)(x).sum().backward()
    assert x.grad is None and layer.lora_A["default"].weight.grad is not None


def test_bad_input():
    a, b = torch.randn(4, 8), torch.randn(6, 4)
    with pytest.raises(ValueError, match="^x: "):
        lora_delta(torch.ones(3, 8, dtype=torch.long), a, b, 2.0)
    with pytest.raises(ValueError, match="^weight_a: expected shape \\[\\*, 7\\]"):
        lora_delta(torch.randn(3, 7), a, b, 2.0)
    with pytest.raises(ValueError, match="^weight_b: expected shape \\[\\*, 4\\]"):
        lora_delta(torch.randn(3, 8), a, b.t(), 2.0)
    with pytest.raises(ValueError, match="^weight_b: expected the dtype of weight_a"):
        lora_delta(torch.randn(3, 8), a, b.bfloat16(), 2.0)
    with pytest.raises(ValueError, match="^scaling: "):
        lora_delta(torch.randn(3, 8), a, b, torch.tensor(2.0))
    with pytest.raises(ValueError, match="^chunk_tokens: "):
        lora_delta(torch.randn(3, 8), a, b, 2.0, chunk_tokens=0)


# --- lora_add (lora_dtype="input") against fp64 -------------------------------------------------------------------
# The bound, derived. x's dtype rounds with unit u (bf16 2^-8, fp16 2^-11, fp32 2^-24); each GEMM accumulates in
# fp32 (unit 2^-24) and rounds its output once (the CPU's addmm too: result is added before that rounding, checked
# against fp64). Every output element is a sum of products of exact inputs, and on its way each product picks up at
# most 4 rounding factors (1 + d), |d| <= u: out: the casts of A and B, h, the addmm output; dx: the cast of
# B * scaling, dh, the cast of A, dx; dA: B * scaling, dh, dA; dB: the cast of A, h, dB (scaled in fp32 after); and
# at most K = N + in + out + r + 2 fp32 accumulation factors (the GEMMs' inner sizes, the add, the fp32 scale). So
#   |computed - exact| <= ((1 + u)^4 (1 + 2^-24)^K - 1) * (the same formula evaluated on |inputs|).
# No underflow term: drawn magnitudes are in [2^-4, 4] and scaling >= 2^-2, so the abs-product of every intermediate
# is >= 2^-10, above fp16's smallest normal 2^-14, and a subnormal's rounding error (<= u 2^-14) stays inside.
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
FP32_UNIT = 2.0**-24
LORA_ADD_ROUNDINGS = 4


def rounding_bound(dtype: torch.dtype, roundings: int, terms: int) -> float:
    """Relative to the abs-product: `roundings` roundings in `dtype` and `terms` fp32 accumulation steps."""
    return (1 + UNIT[dtype]) ** roundings * (1 + FP32_UNIT) ** terms - 1


def branch_exact(result, x, a, b, scaling, grad_out):
    """[out, d_result, dx, dA, dB] of out = result + scaling * x A^T B^T, by the chain rule in the inputs' dtype
    (fp64 here); on |inputs| the same formula gives each element's abs-product."""
    x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])  # x2: [N, in], g2: [N, out]
    h = x2 @ a.T  # h: [N, r]
    gb = g2 @ b  # gb: [N, r]
    out = result + scaling * (h @ b.T).view(result.shape)
    return [out, grad_out, scaling * (gb @ a).view(x.shape), scaling * gb.T @ x2, scaling * g2.T @ h]


def error_ratio(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, rel: float) -> tuple[float, str]:
    """The largest |got - exact| / (rel * magnitude), and a line saying where and how large."""
    if not got.numel():
        return 0.0, "empty"
    err = (got.double() - exact).abs()
    bound = rel * magnitude
    ratio = err / bound
    i = int(ratio.argmax())
    worst = f"max error {err.max().item():.3g}; at the worst element error {err.flatten()[i].item():.3g}"
    return ratio.max().item(), f"{worst} vs bound {bound.flatten()[i].item():.3g} (rel {rel:.3g})"


def assert_within(name: str, got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, rel: float) -> None:
    ratio, where = error_ratio(got, exact, magnitude, rel)
    assert ratio <= 1, f"{name}: {where}"


def draw(shape, dtype, g):
    """Random values of magnitude in [2^-4, 4], either sign (see the bound above: no subnormal products)."""
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    return (torch.where(t < 0, -1.0, 1.0) * t.abs().clamp(2.0**-4, 4.0)).to(dtype)


def lora_add_case(lead, in_features, out_features, r, x_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    result, x = draw((*lead, out_features), x_dtype, g), draw((*lead, in_features), x_dtype, g)
    a, b = draw((r, in_features), torch.float32, g), draw((out_features, r), torch.float32, g)
    return result, x, a, b, draw((*lead, out_features), x_dtype, g)


def lora_add_out_and_grads(result, x, a, b, scaling, grad_out):
    result, x, a, b = (t.detach().requires_grad_() for t in (result, x, a, b))
    out = lora_add(result, x, a, b, scaling)
    return [out.detach(), *torch.autograd.grad(out, (result, x, a, b), grad_out)]


def lora_add_ratios(got, inputs, scaling, x_dtype):
    """Max error / bound of [out, dx, dA, dB] (d_result must equal grad_out: it is passed through)."""
    exact = branch_exact(*(t.double() for t in inputs[:4]), scaling, inputs[4].double())
    magnitude = branch_exact(*(t.double().abs() for t in inputs[:4]), scaling, inputs[4].double().abs())
    x, a, b = inputs[1:4]
    terms = x[..., 0].numel() + x.shape[-1] + b.shape[0] + a.shape[0] + 2
    rel = rounding_bound(x_dtype, LORA_ADD_ROUNDINGS, terms)
    return {name: error_ratio(got[i], exact[i], magnitude[i], rel) for i, name in [(0, "out"), (2, "dx"),
                                                                                    (3, "dA"), (4, "dB")]}


@given(
    lead=st.sampled_from([(), (1,), (2,)]), n=st.integers(1, 33), in_features=st.integers(1, 40),
    out_features=st.integers(1, 40), r=st.integers(1, 8), scaling=st.floats(0.25, 4.0),
    x_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_lora_add_within_the_rounding_bound_of_fp64(lead, n, in_features, out_features, r, scaling, x_dtype):
    inputs = lora_add_case((*lead, n), in_features, out_features, r, x_dtype, seed=n * 41 + r)
    got = lora_add_out_and_grads(*inputs[:4], scaling, inputs[4])
    assert [t.dtype for t in got] == [x_dtype] * 3 + [torch.float32] * 2  # fp32 adapters get fp32 gradients
    assert torch.equal(got[1], inputs[4])  # d_result is grad_out
    for name, (ratio, where) in lora_add_ratios(got, inputs, scaling, x_dtype).items():
        assert ratio <= 1, f"{name}: {where}"


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_lora_add_bound_catches_a_missing_scaling(x_dtype):
    """The bound is tight enough to fail: the same inputs with scaling 1 instead of 4 break it for every output."""
    inputs = lora_add_case((2, 5), 6, 7, 3, x_dtype, seed=0)
    right = lora_add_ratios(lora_add_out_and_grads(*inputs[:4], 4.0, inputs[4]), inputs, 4.0, x_dtype)
    wrong = lora_add_ratios(lora_add_out_and_grads(*inputs[:4], 1.0, inputs[4]), inputs, 4.0, x_dtype)
    assert all(ratio <= 1 for ratio, _ in right.values()), right
    assert all(ratio > 1 for ratio, _ in wrong.values()), wrong


def test_lora_add_skips_what_needs_no_gradient():
    """Frozen adapters: neither x nor h is saved and no weight gradient is formed, only the adapters' casts to x's
    dtype (for grad x); no grad: nothing is saved."""
    result, x, a, b, grad_out = lora_add_case((3,), 8, 6, 2, torch.bfloat16, seed=1)
    x.requires_grad_()
    saved = saved_tensors(lambda: lora_add(result, x, a, b, 2.0).backward(grad_out))
    assert sorted((tuple(t.shape), t.dtype) for t in saved) == [((2, 8), x.dtype), ((6, 2), x.dtype)]
    assert x.grad is not None
    a.requires_grad_(), b.requires_grad_()
    with torch.no_grad():
        assert saved_tensors(lambda: lora_add(result, x, a, b, 2.0)) == []
    saved = saved_tensors(lambda: lora_add(result, x.detach(), a, b, 2.0))
    assert sorted(tuple(t.shape) for t in saved) == [(2, 8), (3, 2), (3, 8), (6, 2)]  # casts, h, x


def test_lora_add_output_takes_in_place_ops():
    """As PEFT's output does: a custom Function's output that is a view would refuse them (and so would the model)."""
    result, x, a, b, grad_out = lora_add_case((2, 3), 8, 6, 2, torch.bfloat16, seed=2)
    twice = [lora_add_out_and_grads(result, x, a, b, 2.0, grad_out * 2)]
    result, x, a, b = (t.detach().requires_grad_() for t in (result, x, a, b))
    out = lora_add(result, x, a, b, 2.0)
    out.mul_(2)
    twice.append([out.detach(), *torch.autograd.grad(out, (result, x, a, b), grad_out)])
    assert torch.equal(twice[1][0], twice[0][0] * 2)
    for got, want in zip(twice[1][1:], twice[0][1:]):
        assert torch.equal(got, want)


def test_lora_add_bad_input():
    result, x, a, b = torch.randn(3, 6), torch.randn(3, 8), torch.randn(4, 8), torch.randn(6, 4)
    with pytest.raises(ValueError, match="^x: expected a floating tensor"):
        lora_add(result, x.long(), a, b, 2.0)
    with pytest.raises(ValueError, match="^weight_a: expected shape \\[\\*, 8\\], got \\[4, 7\\]$"):
        lora_add(result, x, a[:, :7], b, 2.0)
    with pytest.raises(ValueError, match="^weight_b: expected shape \\[\\*, 4\\]"):
        lora_add(result, x, a, b.t(), 2.0)
    with pytest.raises(ValueError, match="^weight_b: expected a floating dtype, got int64$"):
        lora_add(result, x, a, b.long(), 2.0)
    with pytest.raises(ValueError, match="^result: expected shape \\[3, 6\\], got \\[3, 5\\]$"):
        lora_add(result[:, :5], x, a, b, 2.0)
    with pytest.raises(ValueError, match="^result: expected the dtype of x torch.float32, got torch.bfloat16$"):
        lora_add(result.bfloat16(), x, a, b, 2.0)
    with pytest.raises(ValueError, match="^scaling: expected a real number, got Tensor$"):
        lora_add(result, x, a, b, torch.tensor(2.0))
    with pytest.raises(ValueError, match="^result: inplace=True needs a tensor that is not a leaf requiring grad$"):
        lora_add(result.requires_grad_(), x, a, b, 2.0, inplace=True)


@pytest.mark.parametrize("grad", [True, False])
def test_lora_add_in_place_equals_out_of_place(grad):
    """inplace=True adds into result itself (what the patched layers do with the base output): the same bits as a new
    tensor, forward and gradients, with and without grad."""
    result, x, a, b, grad_out = lora_add_case((2, 5), 8, 6, 3, torch.bfloat16, seed=3)
    want = lora_add_out_and_grads(result, x, a, b, 4.0, grad_out)
    leaves = [t.detach().requires_grad_(grad) for t in (result, x, a, b)]
    base = leaves[0] * 1  # not a leaf: it may be added into
    with torch.set_grad_enabled(grad):
        out = lora_add(base, *leaves[1:], 4.0, inplace=True)
    assert out is base and torch.equal(out, want[0])
    if grad:
        for got, expected in zip(torch.autograd.grad(out, leaves, grad_out), want[1:]):
            assert torch.equal(got, expected)


def test_lora_add_in_place_on_a_non_contiguous_result_adds_into_a_copy():
    result, x, a, b, grad_out = lora_add_case((4, 3), 8, 6, 2, torch.bfloat16, seed=4)
    want = lora_add_out_and_grads(result, x, a, b, 2.0, grad_out)
    strided = result.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, another layout
    before = strided.clone()
    out = lora_add(strided, x, a, b, 2.0, inplace=True)
    assert out is not strided and torch.equal(strided, before) and torch.equal(out, want[0])


# --- lora_linear: a frozen nn.Linear base and its adapters in one op ------------------------------------------------
# The bound, derived as lora_add's. The output is rounded after the base GEMM and after each of the k adapters'
# addmm's, so a product of the base picks up 1 + k roundings in x's dtype and one of adapter i its 4 (the casts of A
# and B, h, its addmm) plus one per later addmm; the input gradient likewise: g W rounded, then each adapter's GEMM
# adds (s g B) A (the cast of B, dh, the cast of A) and rounds. So at most LORA_ADD_ROUNDINGS + k - 1 for every
# output (dA_i, dB_i: lora_add's 4), and K = N + in + out + sum r_i + k + 2 fp32 accumulation steps (the GEMMs' inner
# sizes, the bias, the adds and scales). The two-op path (F.linear, then lora_add per adapter) rounds each adapter's
# input-gradient term once more before autograd adds it to the base's: one rounding more for its dx.
def lora_linear_case(lead, in_features, out_features, adapters, bias, x_dtype, seed, device="cpu"):
    """x, weight, bias, [(A, B, scaling)] (fp32 adapters, PEFT's default), grad_out; adapters: [(r, scaling)]."""
    g = torch.Generator().manual_seed(seed)

    def new(shape, dtype=x_dtype):
        return draw(shape, dtype, g).to(device)

    x, weight = new((*lead, in_features)), new((out_features, in_features))
    bias = new((out_features,)) if bias else None
    adapters = [(new((r, in_features), torch.float32), new((out_features, r), torch.float32), scaling)
                for r, scaling in adapters]
    return x, weight, bias, adapters, new((*lead, out_features))


def linear_exact(x, weight, bias, adapters, grad_out):
    """[out, dx, dA_1, dB_1, ...] of F.linear(x, weight, bias) + sum_i s_i x A_i^T B_i^T by the chain rule in the
    inputs' dtype (fp64 here); on |inputs| (scalings > 0) the same formula gives each element's abs-product."""
    x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])  # x2: [N, in], g2: [N, out]
    out, dx, grads = x2 @ weight.T + (0 if bias is None else bias), g2 @ weight, []
    for a, b, scaling in adapters:
        h, gb = x2 @ a.T, g2 @ b  # h, gb: [N, r]
        out, dx = out + scaling * h @ b.T, dx + scaling * gb @ a
        grads += [scaling * gb.T @ x2, scaling * g2.T @ h]
    return [out.view(grad_out.shape), dx.view(x.shape), *grads]


def linear_out_and_grads(x, weight, bias, adapters, grad_out, two_op=False):
    """[out, dx, dA_1, dB_1, ...] of lora_linear, or (two_op) of F.linear and then lora_add per adapter."""
    x = x.detach().requires_grad_()
    adapters = [(a.detach().requires_grad_(), b.detach().requires_grad_(), s) for a, b, s in adapters]
    if two_op:
        out = F.linear(x, weight, bias)
        for i, (a, b, scaling) in enumerate(adapters):
            out = lora_add(out, x, a, b, scaling, inplace=i > 0)
    else:
        out = lora_linear(x, weight, bias, adapters)
    leaves = [x, *(w for a, b, _ in adapters for w in (a, b))]
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def lora_linear_ratios(got, inputs, x_dtype, extra_dx_roundings=0):
    """Max error / bound of [out, dx, dA_1, dB_1, ...], by name."""
    x, weight, bias, adapters, grad_out = inputs
    exact = linear_exact(*_double(inputs, abs=False))
    magnitude = linear_exact(*_double(inputs, abs=True))
    k = len(adapters)
    terms = x[..., 0].numel() + x.shape[-1] + weight.shape[0] + sum(a.shape[0] for a, _, _ in adapters) + k + 2
    rel = rounding_bound(x_dtype, LORA_ADD_ROUNDINGS + k - 1, terms)
    names = ["out", "dx", *(f"{w}_{i}" for i in range(k) for w in ("dA", "dB"))]
    ratios = {name: error_ratio(got[i], exact[i], magnitude[i], rel) for i, name in enumerate(names)}
    if extra_dx_roundings:
        rel_dx = rounding_bound(x_dtype, LORA_ADD_ROUNDINGS + k - 1 + extra_dx_roundings, terms)
        ratios["dx"] = error_ratio(got[1], exact[1], magnitude[1], rel_dx)
    return ratios


def _double(inputs, abs):
    x, weight, bias, adapters, grad_out = inputs
    f = (lambda t: t.double().abs()) if abs else (lambda t: t.double())
    return (f(x), f(weight), None if bias is None else f(bias), [(f(a), f(b), s) for a, b, s in adapters],
            f(grad_out))


@given(
    lead=st.sampled_from([(), (1,), (2,)]), n=st.integers(1, 33), in_features=st.integers(1, 40),
    out_features=st.integers(1, 40),
    adapters=st.lists(st.tuples(st.integers(1, 8), st.floats(0.25, 4.0)), min_size=1, max_size=2),
    bias=st.booleans(), x_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_lora_linear_within_the_rounding_bound_of_fp64_as_the_two_op_path(
    lead, n, in_features, out_features, adapters, bias, x_dtype
):
    """lora_linear and the two-op path on the same inputs: both within their bounds of fp64; the forward and the
    adapters' gradients bit for bit the same (the same GEMMs), only dx's rounding differs."""
    inputs = lora_linear_case((*lead, n), in_features, out_features, adapters, bias, x_dtype, seed=n * 41 + in_features)
    got = linear_out_and_grads(*inputs)
    two_op = linear_out_and_grads(*inputs, two_op=True)
    assert [t.dtype for t in got] == [x_dtype] * 2 + [torch.float32] * 2 * len(adapters)
    for name, (ratio, where) in lora_linear_ratios(got, inputs, x_dtype).items():
        assert ratio <= 1, f"{name}: {where}"
    for name, (ratio, where) in lora_linear_ratios(two_op, inputs, x_dtype, extra_dx_roundings=1).items():
        assert ratio <= 1, f"two-op {name}: {where}"
    for i, (a, b) in enumerate(zip(got, two_op)):
        assert i == 1 or torch.equal(a, b), i


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_lora_linear_bound_catches_a_dropped_adapter_input_gradient(x_dtype):
    """The dx bound is tight enough to fail: the base layer's input gradient alone (the adapter's term dropped, or
    the base's: the adapter's alone) breaks it."""
    inputs = lora_linear_case((2, 5), 6, 7, [(3, 2.0)], True, x_dtype, seed=0)
    x, weight, bias, adapters, grad_out = inputs
    got = linear_out_and_grads(*inputs)
    assert lora_linear_ratios(got, inputs, x_dtype)["dx"][0] <= 1
    base_only = linear_out_and_grads(x, weight, bias, [], grad_out)
    adapter_only = linear_out_and_grads(x, torch.zeros_like(weight), bias, adapters, grad_out)
    for dx in (base_only[1], adapter_only[1]):
        assert lora_linear_ratios([got[0], dx, *got[2:]], inputs, x_dtype)["dx"][0] > 1


def test_lora_linear_saves_what_lora_add_does_and_the_base_weight():
    """x, the [N, r] lora_A outputs and the adapters' casts as lora_add saves them, and the base weight (a parameter,
    no memory) only where x wants a gradient; without grad nothing."""
    x, weight, bias, adapters, grad_out = lora_linear_case((3,), 8, 6, [(2, 2.0)], True, torch.bfloat16, seed=1)
    x.requires_grad_()
    saved = saved_tensors(lambda: lora_linear(x, weight, bias, adapters).backward(grad_out))
    assert sorted((tuple(t.shape), t.dtype) for t in saved) == [((2, 8), x.dtype), ((6, 2), x.dtype), ((6, 8), x.dtype)]
    assert weight.data_ptr() in {t.data_ptr() for t in saved} and x.grad is not None
    for a, b, _ in adapters:
        a.requires_grad_(), b.requires_grad_()
    with torch.no_grad():
        assert saved_tensors(lambda: lora_linear(x, weight, bias, adapters)) == []
    saved = saved_tensors(lambda: lora_linear(x.detach(), weight, bias, adapters))
    assert sorted(tuple(t.shape) for t in saved) == [(2, 8), (3, 2), (3, 8), (6, 2)]  # casts, h, x; no weight


def test_lora_linear_without_grad_equals_with_grad():
    inputs = lora_linear_case((2, 5), 8, 6, [(3, 4.0), (2, 0.5)], True, torch.bfloat16, seed=2)
    x, weight, bias, adapters, _ = inputs
    with torch.no_grad():
        out = lora_linear(x, weight, bias, adapters)
    assert torch.equal(out, linear_out_and_grads(*inputs)[0])


def test_lora_linear_bad_input():
    x, weight, bias, a, b = torch.randn(3, 8), torch.randn(6, 8), torch.randn(6), torch.randn(4, 8), torch.randn(6, 4)
    with pytest.raises(ValueError, match="^x: expected a floating tensor"):
        lora_linear(x.long(), weight, bias, [(a, b, 2.0)])
    with pytest.raises(ValueError, match="^weight: expected shape \\[\\*, 8\\], got \\[6, 7\\]$"):
        lora_linear(x, weight[:, :7], bias, [(a, b, 2.0)])
    with pytest.raises(ValueError, match="^bias: expected shape \\[6\\], got \\[5\\]$"):
        lora_linear(x, weight, bias[:5], [(a, b, 2.0)])
    with pytest.raises(ValueError, match="^bias: expected the dtype of x torch.float32, got torch.bfloat16$"):
        lora_linear(x, weight, bias.bfloat16(), [(a, b, 2.0)])
    with pytest.raises(ValueError, match="^weight: expected a frozen base \\(requires_grad=False\\)"):
        lora_linear(x, weight.requires_grad_(), bias, [(a, b, 2.0)])
    weight.requires_grad_(False)
    with pytest.raises(ValueError, match="^adapters\\[1\\].weight_b: expected shape \\[6, 4\\], got \\[5, 4\\]$"):
        lora_linear(x, weight, bias, [(a, b, 2.0), (a, b[:5], 2.0)])
    with pytest.raises(ValueError, match="^adapters\\[0\\].scaling: expected a real number, got Tensor$"):
        lora_linear(x, weight, bias, [(a, b, torch.tensor(2.0))])


# --- patched PEFT models -------------------------------------------------------------------------------------------


def lora_model(dtype=torch.float32, seed=0, **config):
    """A tiny Qwen2 with LoRA on all linears; adapters in fp32 (PEFT's default for a bf16 base)."""
    model = tiny_model("qwen2", seed=seed).to(dtype)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **config))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at 0: give A a gradient too
            nn.init.normal_(p, 0.0, 0.1)
    return model.train()


def loss_and_grads(model, ids, mask, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, **kwargs)
    loss = torch.log_softmax(out.logits.float(), -1)[..., 3].mean()
    if torch.is_grad_enabled() and loss.requires_grad:
        loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def test_patched_fp32_model_matches_unpatched(delta_calls):
    model = lora_model()
    patched = patch_model(copy.deepcopy(model), **PEFT_BITWISE)
    ids, mask = batch(1)
    logits, grads = loss_and_grads(model, ids, mask)
    logits_p, grads_p = loss_and_grads(patched, ids, mask)
    assert delta_calls == ["lora_delta"] * len(TARGETS) * 2
    assert torch.equal(logits_p, logits)
    assert grads.keys() == grads_p.keys() and sum("lora_A" in n for n in grads) == len(TARGETS) * 2
    for name in grads:  # dx of q, k, v adds up in another order: fp32 rounding, no more
        torch.testing.assert_close(grads_p[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_patched_bf16_base_is_as_close_to_fp64_as_peft():
    model = lora_model(torch.bfloat16)
    patched = patch_model(copy.deepcopy(model), **PEFT_BITWISE)
    ids, mask = batch(2)
    mask = torch.ones_like(mask)  # fp64 eager attention gives NaN on fully masked (left-padded) rows
    logits, grads = loss_and_grads(model, ids, mask)
    logits_p, grads_p = loss_and_grads(patched, ids, mask)
    _, want = loss_and_grads(copy.deepcopy(model).double(), ids, mask)
    assert torch.equal(logits_p, logits)
    assert grads.keys() == grads_p.keys() == want.keys()
    for name in want:
        err, err_p = ((g[name] - want[name]).norm() / want[name].norm() for g in (grads, grads_p))
        assert err_p <= 1.5 * err + 1e-3, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_patched_model_runs_lora_linear_on_plain_bases_as_close_to_fp64_as_the_two_op_path(
    dtype, delta_calls, monkeypatch
):
    """patch_model on a tiny Qwen2 (biased q, k, v): each LoRA layer over a frozen nn.Linear runs lora_linear; a hooked
    base and a trained one run base_layer(x) then lora_add. Against the two-op path (every layer through base_layer
    and lora_add) on the same model: the logits bit for bit; the gradients together as close to fp64 (PEFT unpatched)
    as its, within 10% of its error (the house rule); each parameter's gradient differs from its by rounding noise,
    no more than twice its own distance from fp64 (a dropped input-gradient term is far larger)."""
    from fastgrpo.patching import forwards

    model = lora_model(dtype)
    layers = model.base_model.model.model.layers
    layers[0].self_attn.q_proj.base_layer.register_forward_hook(lambda module, args, out: None)
    layers[1].mlp.down_proj.base_layer.weight.requires_grad_(True)
    ids, mask = batch(2)
    mask = torch.ones_like(mask)  # fp64 eager attention gives NaN on fully masked (left-padded) rows
    _, want = loss_and_grads(copy.deepcopy(model).double(), ids, mask)
    patched = patch_model(model, **ONLY_LORA)
    logits, got = loss_and_grads(patched, ids, mask)
    n = len(TARGETS) * 2
    assert sorted(delta_calls) == ["lora_add"] * 2 + ["lora_linear"] * (n - 2)
    delta_calls.clear()
    monkeypatch.setattr(forwards, "_frozen_plain_linear", lambda layer, x: False)
    logits_two_op, two_op = loss_and_grads(patched, ids, mask)
    assert delta_calls == ["lora_add"] * n
    assert torch.equal(logits, logits_two_op)
    assert got.keys() == two_op.keys() == want.keys() and len(want) == 2 * n + 1  # + the trained base weight

    def flat(grads):
        return torch.cat([grads[name].flatten() for name in sorted(grads)])

    err, err_two_op = ((flat(g) - flat(want)).norm() / flat(want).norm() for g in (got, two_op))
    assert err <= 1.1 * err_two_op, (err, err_two_op)
    for name in want:
        assert (got[name] - two_op[name]).norm() <= 2 * (two_op[name] - want[name]).norm(), name


BASE_FALLBACKS = ["forward_hook", "forward_pre_hook", "backward_hook", "global_forward_hook", "own_forward",
                  "trained_weight", "trained_bias", "non_contiguous_x", "one_dim_x"]


@pytest.mark.parametrize("case", BASE_FALLBACKS)
def test_bases_lora_linear_cannot_stand_in_for_run_base_layer_then_lora_add(case, delta_calls):
    """The base layer itself runs (its hooks fire, its trained weight gets a gradient, F.linear rounds as it does for
    an x whose bias it does not add in the GEMM); the result is lora_linear's up to fp32 rounding."""
    layer = lora_layer(12, 10, 3, 6, torch.float32, torch.float32)
    base = layer.base_layer

    def run(x):
        x = x.detach().requires_grad_()
        out = fused(layer, "input")(x)
        out.backward(torch.ones_like(out))
        return out.detach(), x.grad

    x = torch.randn(2, 7, 12)
    want = run(x)
    assert delta_calls == ["lora_linear"]
    delta_calls.clear()
    fired = []
    with contextlib.ExitStack() as stack:
        if case.endswith("hook"):
            register = {"forward_hook": base.register_forward_hook, "forward_pre_hook": base.register_forward_pre_hook,
                        "backward_hook": base.register_full_backward_hook,
                        "global_forward_hook": nn.modules.module.register_module_forward_hook}[case]
            stack.callback(register(lambda *args: fired.append(case)).remove)
        if case == "own_forward":
            base.forward = lambda x: fired.append(case) or F.linear(x, base.weight, base.bias)
            stack.callback(base.__dict__.pop, "forward")
        if case.startswith("trained"):
            param = getattr(base, case.removeprefix("trained_"))
            stack.callback(param.requires_grad_, False)
            param.requires_grad_(True)
        if case == "non_contiguous_x":
            x = x.transpose(0, 1).contiguous().transpose(0, 1)
        if case == "one_dim_x":
            x, want = x[0, 0], [t[0, 0] for t in want]
        got = run(x)
    assert delta_calls == ["lora_add"]
    assert bool(fired) == (case.endswith("hook") or case == "own_forward")
    assert [p.grad is not None for p in (base.weight, base.bias)] == [case == "trained_weight", case == "trained_bias"]
    for name, a, b in zip(["out", "dx"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


FALLBACKS = ["dropout_in_training", "dora", "lora_bias", "merged", "disabled", "adapter_names", "autocast",
             "no_input_cast"]


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")  # Qwen2's o_proj and MLP have no bias
@pytest.mark.parametrize("case", FALLBACKS)
def test_cases_outside_the_vanilla_branch_run_peft(case, delta_calls):
    config = {"dropout_in_training": dict(lora_dropout=0.5), "dora": dict(use_dora=True),
              "lora_bias": dict(lora_bias=True)}.get(case, {})
    model = lora_model(**config)
    patched = patch_model(copy.deepcopy(model), **ONLY_LORA)
    assert patched.fastgrpo_patch_summary["patched"]["fused_lora"] == len(TARGETS) * 2
    ids, mask = batch(3)
    kwargs = {}
    if case == "merged":
        model.merge_adapter(), patched.merge_adapter()
    if case == "adapter_names":  # a mixed batch: PEFT allows it in eval mode only
        model.eval(), patched.eval()
        kwargs = dict(adapter_names=["default", "__base__"])
    contexts = {
        "disabled": lambda m: m.disable_adapter(),
        "autocast": lambda m: torch.autocast("cpu", dtype=torch.bfloat16),
        "no_input_cast": lambda m: disable_input_dtype_casting(m),
    }
    results = []
    for m in (model, patched):
        torch.manual_seed(5)  # the same dropout masks
        with contexts.get(case, lambda m: torch.enable_grad())(m):
            results.append(loss_and_grads(m, ids, mask, **kwargs))
    (logits, grads), (logits_p, grads_p) = results
    assert delta_calls == []
    assert torch.equal(logits_p, logits)
    assert grads.keys() == grads_p.keys()
    for name in grads:
        torch.testing.assert_close(grads_p[name], grads[name], rtol=0, atol=0, msg=name)


def test_dropout_in_eval_mode_takes_the_fused_path(delta_calls):
    model = lora_model(lora_dropout=0.5).eval()
    patched = patch_model(copy.deepcopy(model), **PEFT_BITWISE)
    ids, mask = batch(3)
    assert torch.equal(loss_and_grads(patched, ids, mask)[0], loss_and_grads(model, ids, mask)[0])
    assert len(delta_calls) == len(TARGETS) * 2


@pytest.mark.parametrize("second_dtype", [torch.float32, torch.bfloat16])
def test_two_active_adapters(second_dtype, delta_calls):
    """Both adapters' deltas are added; lora_dtype "adapter": adapters of different dtypes run PEFT, which casts x to
    each in turn (fp32 -> bf16 -> fp32 rounds x for the second one); "input": both run in x's dtype, chained
    addmm's within the bound of fp64 (one more rounding for the second add, of the first sum)."""
    layer = lora_layer(12, 10, 3, 6, torch.float32, torch.float32)
    torch.manual_seed(1)
    layer.update_layer("second", 2, 4, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False))
    layer.to(torch.float32)
    for p in list(layer.lora_A["second"].parameters()) + list(layer.lora_B["second"].parameters()):
        p.data = p.data.to(second_dtype)
    order = ["second", "default"] if second_dtype == torch.bfloat16 else ["default", "second"]
    layer.set_adapter(order)
    x = torch.randn(7, 12)
    want, got = layer.forward(x), fused(layer)(x)
    assert torch.equal(got, want) and not torch.equal(want, layer.base_layer(x))
    assert len(delta_calls) == (2 if second_dtype == torch.float32 else 0)
    delta_calls.clear()
    got = fused(layer, "input")(x)
    assert delta_calls == ["lora_linear"]  # both adapters in the base layer's op
    with torch.no_grad():
        exact, magnitude = layer.base_layer(x).double(), layer.base_layer(x).double().abs()
    for name in order:
        a, b, scaling = layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]
        exact += scaling * x.double() @ a.double().T @ b.double().T
        magnitude += scaling * x.double().abs() @ a.double().abs().T @ b.double().abs().T
    assert_within("out", got, exact, magnitude, rounding_bound(torch.float32, LORA_ADD_ROUNDINGS + 1, 12 + 3 + 2 + 2))


def saved_tensors(run):
    """The tensors autograd saves while `run()` builds its graph."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return saved


@pytest.mark.parametrize("lora_dtype", ["input", "adapter"])
def test_saved_tensors_hold_the_input_not_an_fp32_copy(lora_dtype):
    """q, k and v of a bf16 Qwen2 with fp32 adapters on one input: PEFT saves three fp32 copies of it (4 B per
    element each); the patched layers save the input itself (2 B per element, once), and the [N, r] lora_A output
    (fp32 in "adapter", bf16 in "input", which also keeps the adapters' bf16 casts)."""
    model = lora_model(torch.bfloat16)
    attn = model.base_model.model.model.layers[0].self_attn
    layers = [attn.q_proj, attn.k_proj, attn.v_proj]
    params = {p.data_ptr() for p in model.parameters()}
    x = torch.randn(2, 9, 32, dtype=torch.bfloat16, requires_grad=True)  # x: [B, T, hidden]

    def activations(forwards):
        saved = saved_tensors(lambda: [f(x) for f in forwards])
        unique = {t.untyped_storage().data_ptr(): t for t in saved if t.data_ptr() not in params}
        return list(unique.values())

    peft_saved = activations([m.forward for m in layers])
    fused_saved = activations([fused(m, lora_dtype) for m in layers])

    def inputs(saved):  # tensors of x's size (linear saves x as [N, in] rows)
        return [t for t in saved if t.numel() == x.numel() and t.shape[-1] == x.shape[-1]]

    assert [t.dtype for t in inputs(peft_saved)] == [torch.float32] * 3
    assert [t.data_ptr() for t in inputs(fused_saved)] == [x.data_ptr()]
    nbytes = [sum(t.nbytes for t in s) for s in (peft_saved, fused_saved)]
    r_outputs = 3 * 2 * 9 * 4 * 4  # the [N, r] fp32 lora_A outputs PEFT keeps
    fused_r_outputs = r_outputs // (2 if lora_dtype == "input" else 1)
    # "input" also keeps the adapters' casts to bf16 for the backward: r x (in + out) each, not per token
    casts = sum(2 * (m.lora_A["default"].weight.numel() + m.lora_B["default"].weight.numel()) for m in layers)
    fused_casts = casts if lora_dtype == "input" else 0
    assert nbytes == [3 * x.numel() * 4 + r_outputs, x.numel() * 2 + fused_r_outputs + fused_casts]


def test_summary_option_and_unpatch():
    model = lora_model()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    patch_model(model, fused_lora=False)
    assert "fused_lora" not in model.fastgrpo_patch_summary["patched"] and "forward" not in layer.__dict__
    patch_model(model)
    summary = model.fastgrpo_patch_summary
    assert summary["options"]["fused_lora"] and summary["patched"]["fused_lora"] == len(TARGETS) * 2
    assert summary["options"]["lora_dtype"] == "input"
    assert "forward" in layer.__dict__
    unpatch_model(model)
    assert "forward" not in layer.__dict__ and not hasattr(model.get_base_model(), "fastgrpo_patch_summary")


def test_deepcopy_falls_back_to_its_own_peft_forward():
    """The copy's PEFT forward (run under disable_adapter) must read the copy's base weights, not the original's."""
    patched = patch_model(lora_model(), **ONLY_LORA)
    twin = copy.deepcopy(patched)
    with torch.no_grad():
        for p in twin.get_base_model().model.layers[0].self_attn.q_proj.base_layer.parameters():
            p.mul_(2.0)
    ids, mask = batch(4)
    plain = unpatch_model(copy.deepcopy(twin))
    with twin.disable_adapter(), plain.disable_adapter(), torch.no_grad():
        assert torch.equal(twin(input_ids=ids).logits, plain(input_ids=ids).logits)
    with torch.no_grad():
        assert torch.equal(twin(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_offload_checkpointing_and_tiled_mlp_recompute_the_fused_forward(delta_calls):
    """patch_model's product path (offload checkpointing, which is plain checkpointing on the CPU, and the tiled
    MLP) with and without fused_lora: the same gradients; the recompute runs the fused forward."""
    model = lora_model()
    options = dict(offload_activations=True, mlp_chunk_tokens=4)
    patched, reference = patch_model(copy.deepcopy(model), **options), patch_model(model, **options, fused_lora=False)
    ids, mask = batch(5)
    _, want = loss_and_grads(reference, ids, mask)
    assert delta_calls == []
    _, got = loss_and_grads(patched, ids, mask)
    # forward (4 MLP chunks under no_grad) + checkpoint recompute of attention + MLP chunk recompute, per layer
    assert len(delta_calls) > 2 * len(TARGETS) * 2
    assert got.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


LORA_LINEAR = "peft.tuners.lora.layer.Linear"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_patched_model_lora_layers_within_the_bound_as_peft_under_autocast(dtype, delta_calls):
    """The default lora_dtype="input" on a tiny Qwen2 with fp32 adapters: every LoRA layer's output (on the input it
    got) and its adapters' gradients (from the output gradient it got) are within lora_add's bound of fp64. On the
    bf16 model, PEFT's forward under CPU autocast, on the same inputs, is within the bound of its own roundings:
    out 6 (the casts of A and B, h, lora_B's output, * scaling, the add), dA and dB 4 (g * scaling, a cast, dh or
    h, the GEMM)."""
    model = patch_model(lora_model(dtype), **ONLY_LORA)
    assert model.fastgrpo_patch_summary["options"]["lora_dtype"] == "input"
    layers = {n: m for n, m in model.named_modules() if f"{type(m).__module__}.{type(m).__name__}" == LORA_LINEAR}
    assert len(layers) == len(TARGETS) * 2
    seen = {}

    def record(name):
        def hook(module, args, output):
            seen[name] = {"x": args[0].detach(), "out": output.detach()}
            output.register_hook(lambda g: seen[name].update(g=g))

        return hook

    handles = [layer.register_forward_hook(record(name)) for name, layer in layers.items()]
    ids, mask = batch(2)
    loss_and_grads(model, ids, torch.ones_like(mask))
    for handle in handles:
        handle.remove()
    assert delta_calls == ["lora_linear"] * len(layers)
    for name, layer in layers.items():
        x, g = seen[name]["x"], seen[name]["g"]
        a, b, scaling = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
        with torch.no_grad():
            result = layer.base_layer(x)
        inputs = (result, x, a, b)
        exact = branch_exact(*(t.double() for t in inputs), scaling, g.double())
        magnitude = branch_exact(*(t.double().abs() for t in inputs), scaling, g.double().abs())
        terms = x[..., 0].numel() + a.shape[1] + b.shape[0] + a.shape[0] + 2
        rel = {k: rounding_bound(dtype, k, terms) for k in (4, 6)}
        for i, what, got in [(0, "out", seen[name]["out"]), (3, "dA", a.grad), (4, "dB", b.grad)]:
            assert got.dtype == (dtype if what == "out" else torch.float32)
            assert_within(f"{name} {what}", got, exact[i], magnitude[i], rel[LORA_ADD_ROUNDINGS])
        if dtype == torch.bfloat16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = type(layer).forward(layer, x)  # PEFT's own forward
            autocast = [out.detach(), *torch.autograd.grad(out, (a, b), g)]  # .grad is left alone
            for i, what, got, k in [(0, "out", autocast[0], 6), (3, "dA", autocast[1], 4), (4, "dB", autocast[2], 4)]:
                assert_within(f"{name} {what} (PEFT under autocast)", got, exact[i], magnitude[i], rel[k])


def test_patching_again_with_another_lora_dtype_repatches(delta_calls):
    model = lora_model()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    ids, _ = batch(6)
    patch_model(model, **ONLY_LORA)
    forward = layer.__dict__["forward"]
    assert patch_model(model, **ONLY_LORA) is model and layer.__dict__["forward"] is forward  # same options
    with torch.no_grad():
        model(input_ids=ids)
    assert set(delta_calls) == {"lora_linear"}
    delta_calls.clear()
    patch_model(model, **PEFT_BITWISE)
    assert layer.__dict__["forward"] is not forward
    assert model.fastgrpo_patch_summary["options"]["lora_dtype"] == "adapter"
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        assert set(delta_calls) == {"lora_delta"}
        assert torch.equal(logits, unpatch_model(model)(input_ids=ids).logits)


def test_bad_lora_dtype():
    with pytest.raises(ValueError, match=r"^lora_dtype: expected one of \['input', 'adapter'\], got 'bf16'$"):
        patch_model(lora_model(), lora_dtype="bf16")


# --- GPU -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_qwen2_lora_step_peaks_lower_with_matching_grads():
    """Two Qwen2.5-1.5B-shaped layers (bf16 base, fp32 LoRA r=16 on all linears) at 2 x 4096 tokens, patched with
    every other option the same: PEFT's saved fp32 input copies are (6 x 1536 + 8960) x 4 B = 72.6 KiB per token
    and layer; the fused branch keeps the bf16 inputs (at most 24 KiB where nothing else holds them), in both
    lora_dtypes ("input" also keeps its [N, r] lora_A outputs in bf16, not fp32)."""
    config = transformers.Qwen2Config(
        vocab_size=4096, hidden_size=1536, intermediate_size=8960, num_hidden_layers=2, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)).cuda().train()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, 0.0, 0.02)
    assert model.base_model.model.model.layers[0].mlp.down_proj.lora_A["default"].weight.dtype == torch.float32
    ids = torch.randint(0, config.vocab_size, (2, 4096), generator=torch.Generator().manual_seed(1)).cuda()
    losses, grads, peaks = {}, {}, {}
    cases = {"peft": dict(fused_lora=False), "adapter": dict(lora_dtype="adapter"), "input": dict(lora_dtype="input")}
    for case, options in cases.items():
        patch_model(model, **options)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        peaks[case] = torch.cuda.max_memory_allocated() - start
        losses[case] = loss.detach()
        grads[case] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        del loss
        if case != "peft":
            assert model.fastgrpo_patch_summary["patched"]["fused_lora"] == len(TARGETS) * config.num_hidden_layers
    unpatch_model(model)
    # "adapter": the same ops in the forward (bitwise on the CPU, see above); the backward sums dx of q, k, v in
    # another order, so LoRA grads of earlier layers differ by bf16 rounding of the activation gradients.
    torch.testing.assert_close(losses["adapter"], losses["peft"], rtol=1e-5, atol=1e-6)
    assert grads["adapter"].keys() == grads["peft"].keys() and len(grads["peft"]) == 2 * len(TARGETS) * 2
    for name, want in grads["peft"].items():
        assert (grads["adapter"][name] - want).norm() <= 2e-2 * want.norm(), name
    # "input": bf16 LoRA math (its per-layer bound is checked on the CPU); here the step agrees to bf16 noise.
    torch.testing.assert_close(losses["input"], losses["peft"], rtol=2e-3, atol=0)
    flat = [torch.cat([g[n].flatten() for n in sorted(g)]) for g in (grads["peft"], grads["input"])]
    assert torch.nn.functional.cosine_similarity(*flat, dim=0) > 0.99
    copies = config.num_hidden_layers * ids.numel() * (6 * 1536 + 8960) * 4
    assert peaks["peft"] - peaks["adapter"] >= 0.4 * copies, (peaks, copies)
    assert peaks["input"] <= peaks["adapter"] + (1 << 20), peaks  # bf16 [N, r] outputs, no fp32 transients


@pytest.mark.gpu
@pytest.mark.parametrize("out_features, bias", [(1536, True), (8960, False)])  # q_proj-, up_proj-like
def test_gpu_lora_linear_is_the_two_op_path_with_one_rounding_less(out_features, bias):
    """bf16 on CUDA, Qwen2.5-1.5B's hidden size, 8192 tokens, two fp32 r16 adapters: the forward (cuBLAS's addmm with
    the bias in its epilogue, as F.linear's) and the adapters' gradients bit for bit the two-op path's; the input
    gradient no further from fp64 than its (relative error of the whole tensor, 1% slack)."""
    adapters = [(16, 2.0), (16, 0.5)]
    inputs = lora_linear_case((2, 4096), 1536, out_features, adapters, bias, torch.bfloat16, seed=0, device="cuda")
    got = linear_out_and_grads(*inputs)
    two_op = linear_out_and_grads(*inputs, two_op=True)
    exact = linear_exact(*_double(inputs, abs=False))
    for i, (a, b) in enumerate(zip(got, two_op)):
        assert i == 1 or torch.equal(a, b), i
    err, err_two_op = ((dx.double() - exact[1]).norm() / exact[1].norm() for dx in (got[1], two_op[1]))
    assert err <= 1.01 * err_two_op, (err, err_two_op)


def test_patched_layer_adds_into_its_own_base_output_only(monkeypatch):
    """Where the base layer runs on its own (base_layer(x) then lora_add: here a hooked or a trained base, which
    lora_linear does not stand in for), its output is added into when nothing else can hold it: a copy when it is a
    view (nn.Linear's 3-D output with a bias) or when a forward hook on the base layer saw it; the hook's tensor then
    stays the base output."""
    from fastgrpo.patching import forwards

    inplace = []
    add = forwards.lora_add
    monkeypatch.setattr(forwards, "lora_add", lambda *a, **k: inplace.append(k["inplace"]) or add(*a, **k))
    model = lora_model(torch.float32)
    attn = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(2, 5, 32)
    ptrs = {}

    def record(module, args, out):
        ptrs.setdefault(id(module), []).append((out.data_ptr(), out.clone()))

    for layer, viewed in ((attn.o_proj, False), (attn.q_proj, True)):  # o_proj: no bias; q_proj: bias
        base = layer.base_layer(x)
        inplace.clear()
        handle = layer.base_layer.register_forward_hook(record)
        try:
            out = fused(layer, "input")(x)
        finally:
            handle.remove()
        (ptr, seen), = ptrs[id(layer.base_layer)]
        assert out.data_ptr() != ptr and torch.equal(seen, base)  # hooked: a copy, the hook's tensor intact
        assert inplace == [False]
        inplace.clear()
        layer.base_layer.weight.requires_grad_(True)
        try:
            out = fused(layer, "input")(x)
        finally:
            layer.base_layer.weight.requires_grad_(False)
        assert (base._base is not None) == viewed and inplace == [not viewed]
        assert torch.allclose(out, layer(x), atol=1e-5)


@pytest.mark.parametrize("name", ["o_proj", "q_proj"])  # without and with a bias
def test_patched_lora_compiles_in_one_frame_with_and_without_grad(name):
    """torch.compile(fullgraph=True) of a patched LoRA layer (lora_linear): the no-grad path's in-place ops and the
    autograd Function both trace; the compiled output and gradients equal eager's."""
    model = lora_model(torch.float32)
    layer = getattr(model.base_model.model.model.layers[0].self_attn, name)
    forward = fused(layer, "input")
    x = torch.randn(2, 5, 32)
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            want, got = forward(x), compiled(x)
        assert got.requires_grad == grad and torch.allclose(got, want, atol=1e-6)
    grad_out = torch.randn_like(want)
    want_grads, got_grads = [out_and_grads(layer, f, x, grad_out)[1:] for f in (forward, compiled)]
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, atol=1e-6)

