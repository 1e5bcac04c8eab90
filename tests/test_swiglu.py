"""SwiGLU / GeGLU kernels (fastgrpo.ops.swiglu) against the fp64 oracle, forward and backward."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.loss import reference
from fastgrpo.ops.swiglu import geglu, glu, glu_torch, swiglu

REFERENCES = {"silu": reference.swiglu, "gelu_tanh": reference.geglu}


def _fwd_bwd(fn, gate, up, dc):
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    c = fn(gate, up)
    return [t.double() for t in (c, *torch.autograd.grad(c, (gate, up), dc))]


def _max_err(got, want):
    return max((g - w).abs().max().item() for g, w in zip(got, want))


@given(
    rows=st.integers(1, 30),
    cols=st.integers(1, 1100),
    activation=st.sampled_from(["silu", "gelu_tanh"]),
    fused_gate_up=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_fp64_reference(rows, cols, activation, fused_gate_up, seed):
    g = torch.Generator().manual_seed(seed)
    if fused_gate_up:  # Phi-3: gate and up are the two halves of one projection (strided rows)
        gate, up = (torch.randn(rows, 2 * cols, generator=g) * 4).chunk(2, dim=-1)
    else:
        gate, up = torch.randn(rows, cols, generator=g) * 4, torch.randn(rows, cols, generator=g)
    dc = torch.randn(rows, cols, generator=g)
    want = _fwd_bwd(REFERENCES[activation], gate.double(), up.double(), dc.double())
    eager = _fwd_bwd(lambda a, b: glu_torch(a, b, activation), gate, up, dc)
    got = _fwd_bwd(lambda a, b: glu(a, b, activation), gate, up, dc)
    assert _max_err(got, want) <= 2 * _max_err(eager, want) + 1e-5


@given(
    rows=st.integers(1, 9),
    cols=st.one_of(st.integers(1, 70), st.integers(1025, 1100)),  # past 1024: two column blocks, a ragged second
    gate_pad=st.integers(0, 5),
    up_pad=st.integers(0, 5),
    dc_pad=st.integers(0, 5),
    activation=st.sampled_from(["silu", "gelu_tanh"]),
    seed=st.integers(0, 2**16),
)
def test_gate_up_and_grad_of_different_row_strides(rows, cols, gate_pad, up_pad, dc_pad, activation, seed):
    # gate, up and the output gradient each a column slice of its own buffer: three different row strides reach the
    # kernels (a fused gate_up gives gate and up the same one, separate projections the same contiguous one).
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(rows, cols + gate_pad, generator=g) * 4)[:, :cols]
    up = torch.randn(rows, cols + up_pad, generator=g)[:, up_pad:]
    dc = torch.randn(rows, cols + dc_pad, generator=g)[:, :cols]
    want = _fwd_bwd(REFERENCES[activation], gate.double(), up.double(), dc.double())
    eager = _fwd_bwd(lambda a, b: glu_torch(a, b, activation), gate, up, dc)
    got = _fwd_bwd(lambda a, b: glu(a, b, activation), gate, up, dc)
    bound = 2 * _max_err(eager, want) + 1e-5  # test_matches_fp64_reference's
    for name, g_, w_ in zip(("out", "d_gate", "d_up"), got, want):
        err = (g_ - w_).abs().max().item()
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"


# Triton 3.9's interpreter truncates fp32 -> bf16 instead of rounding to nearest: bf16 accuracy is a GPU test.
@pytest.mark.gpu
@pytest.mark.parametrize("fn, ref", [(swiglu, reference.swiglu), (geglu, reference.geglu)])
def test_bf16_error_no_larger_than_eager(fn, ref):
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(2, 99, 2000, generator=g) * 3).bfloat16().cuda()
    up = torch.randn(2, 99, 2000, generator=g).bfloat16().cuda()
    want = ref(gate.double(), up.double())
    err_kernel = (fn(gate, up).double() - want).abs().max()
    err_eager = (ref(gate, up).double() - want).abs().max()
    assert err_kernel <= err_eager * 1.01 + 1e-6


def test_extreme_values_stay_finite():
    gate = torch.tensor([[-200.0, -30.0, 0.0, 30.0, 200.0]])
    up = torch.ones_like(gate)
    for activation in ("silu", "gelu_tanh"):
        a = gate.clone().requires_grad_()
        c = glu(a, up, activation)
        c.sum().backward()
        torch.testing.assert_close(c, glu_torch(gate, up, activation))
        assert torch.isfinite(a.grad).all()


def test_bad_input():
    with pytest.raises(ValueError, match="activation"):
        glu(torch.randn(2, 3), torch.randn(2, 3), "relu")
    with pytest.raises(ValueError, match="up"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))


def test_fp64_keeps_fp64_precision():
    # The kernels compute in fp32: fp64 inputs take the torch path.
    g = torch.Generator().manual_seed(6)
    gate, up = (torch.randn(5, 37, generator=g, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(swiglu(gate, up), reference.swiglu(gate, up), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(geglu(gate, up), reference.geglu(gate, up), rtol=1e-12, atol=1e-12)
