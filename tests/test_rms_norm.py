"""RMSNorm kernel (fastgrpo.ops.rms_norm) against the fp64 oracle, forward and backward, both HF variants."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.loss import reference
from fastgrpo.ops.rms_norm import rms_norm, rms_norm_torch

VARIANTS = [(0.0, True), (1.0, False)]  # (offset, cast_before_weight): Llama, Gemma


def _fwd_bwd(fn, x, w, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y.double(), dx.double(), dw.double()


def _max_err(got, want):
    return max((g - w).abs().max().item() for g, w in zip(got, want))


@given(
    rows=st.integers(1, 40),
    hidden=st.integers(1, 70),
    variant=st.sampled_from(VARIANTS),
    eps=st.sampled_from([1e-6, 1e-5]),
    seed=st.integers(0, 2**16),
)
def test_matches_fp64_reference(rows, hidden, variant, eps, seed):
    offset, cast = variant
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * 3
    w = torch.randn(hidden, generator=g)
    dy = torch.randn(rows, hidden, generator=g)
    want = _fwd_bwd(lambda a, b: reference.rms_norm(a, b, eps, offset), x.double(), w.double(), dy.double())
    eager = _fwd_bwd(lambda a, b: rms_norm_torch(a, b, eps, offset, cast), x, w, dy)
    got = _fwd_bwd(lambda a, b: rms_norm(a, b, eps, offset, cast), x, w, dy)
    # fp32 kernel error no larger than eager fp32 (HF's formula) plus a few ulps of the largest value.
    assert _max_err(got, want) <= 2 * _max_err(eager, want) + 1e-5


@given(
    rows=st.integers(2, 20),
    hidden=st.integers(1, 40),
    x_pad=st.integers(1, 9),
    dy_pad=st.integers(0, 9),
    variant=st.sampled_from(VARIANTS),
    seed=st.integers(0, 2**16),
)
def test_rows_with_a_row_stride_past_hidden(rows, hidden, x_pad, dy_pad, variant, seed):
    # x a column slice of a wider buffer (a fused projection's part): its rows reach the kernel as a view whose row
    # stride is hidden + x_pad, while y and dx are new contiguous tensors and dy has a third row stride, so each of
    # the four row strides the kernels take is checked against the fp64 reference.
    offset, cast = variant
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden + x_pad, generator=g) * 3)[:, :hidden]
    w = torch.randn(hidden, generator=g)
    dy = torch.randn(rows, hidden + dy_pad, generator=g)[:, :hidden]
    want = _fwd_bwd(lambda a, b: reference.rms_norm(a, b, 1e-6, offset), x.double(), w.double(), dy.double())
    eager = _fwd_bwd(lambda a, b: rms_norm_torch(a, b, 1e-6, offset, cast), x, w, dy)
    got = _fwd_bwd(lambda a, b: rms_norm(a, b, 1e-6, offset, cast), x, w, dy)
    bound = 2 * _max_err(eager, want) + 1e-5  # test_matches_fp64_reference's
    for name, g_, w_ in zip(("y", "dx", "dw"), got, want):
        err = (g_ - w_).abs().max().item()
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"


@pytest.mark.parametrize("offset, cast", VARIANTS)
def test_leading_dims_and_strided_rows(offset, cast):
    # q/k norms see [B, H, T, D] views that are not contiguous (Gemma 3 normalizes after the transpose).
    x = torch.randn(2, 5, 3, 8).transpose(1, 2)
    w = torch.randn(8)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, offset, cast), rms_norm_torch(x, w, 1e-6, offset, cast))


# Triton 3.9's interpreter truncates fp32 -> bf16 instead of rounding to nearest: bf16 accuracy is a GPU test.
@pytest.mark.gpu
@pytest.mark.parametrize("offset, cast", VARIANTS)
def test_bf16_error_no_larger_than_eager(offset, cast):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(333, 1536, generator=g).bfloat16().cuda()
    w = torch.randn(1536, generator=g).bfloat16().cuda()
    want = reference.rms_norm(x.double(), w.double(), 1e-6, offset)
    err_kernel = (rms_norm(x, w, 1e-6, offset, cast).double() - want).abs().max()
    err_eager = (rms_norm_torch(x, w, 1e-6, offset, cast).double() - want).abs().max()
    assert err_kernel <= err_eager * 1.01 + 1e-6


def test_output_dtype_follows_hf():
    x = torch.randn(4, 8).bfloat16()
    w = torch.randn(8)  # fp32 weight with bf16 activations: Llama promotes, Gemma keeps x's dtype
    assert rms_norm(x, w, 1e-6, 0.0, True).dtype == torch.float32
    assert rms_norm(x, w, 1e-6, 1.0, False).dtype == torch.bfloat16


def test_torch_path_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(3, 16), torch.randn(16)
    torch.testing.assert_close(rms_norm(x, w), rms_norm_torch(x, w, 1e-6))


def test_bad_input():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 8), torch.randn(7))
    with pytest.raises(ValueError, match="x"):
        rms_norm(torch.ones(2, 8, dtype=torch.int64), torch.randn(8))
