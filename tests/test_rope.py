"""RoPE kernel (fastgrpo.ops.rope.apply_rotary) against the fp64 oracle, forward and backward."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.loss import reference
from fastgrpo.ops.rope import apply_rotary


def _cos_sin(batch, seq, rotary, generator, dtype=torch.float32):
    angles = torch.randn(batch, seq, rotary // 2, generator=generator, dtype=torch.float64) * 3
    angles = torch.cat((angles, angles), dim=-1)  # HF: cat(freqs, freqs)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _reference_partial(q, k, cos, sin):
    r = cos.shape[-1]
    q_rot, k_rot = reference.apply_rotary(q[..., :r], k[..., :r], cos, sin)
    return torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)


def _fwd_bwd(fn, q, k, cos, sin, dq, dk):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    q_out, k_out = fn(q, k, cos, sin)
    gq, gk = torch.autograd.grad((q_out, k_out), (q, k), (dq, dk))
    return [t.double() for t in (q_out, k_out, gq, gk)]


@given(
    batch=st.integers(1, 3),
    q_heads=st.integers(1, 5),
    kv_groups=st.sampled_from([1, 2]),
    seq=st.integers(1, 13),
    half=st.integers(1, 9),
    partial=st.booleans(),
    cos_batch=st.booleans(),
    hf_layout=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_fp64_reference(batch, q_heads, kv_groups, seq, half, partial, cos_batch, hf_layout, seed):
    g = torch.Generator().manual_seed(seed)
    head_dim = 2 * half
    rotary = 2 * max(1, half // 2) if partial else head_dim
    k_heads = max(1, q_heads // kv_groups)
    if hf_layout:  # HF's q is a transposed view of [B, T, H, D]
        q = torch.randn(batch, seq, q_heads, head_dim, generator=g).transpose(1, 2)
        k = torch.randn(batch, seq, k_heads, head_dim, generator=g).transpose(1, 2)
    else:
        q = torch.randn(batch, q_heads, seq, head_dim, generator=g)
        k = torch.randn(batch, k_heads, seq, head_dim, generator=g)
    cos, sin = _cos_sin(batch if cos_batch else 1, seq, rotary, g)
    dq, dk = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)
    want = _fwd_bwd(_reference_partial, q.double(), k.double(), cos.double(), sin.double(), dq.double(), dk.double())
    got = _fwd_bwd(apply_rotary, q, k, cos, sin, dq, dk)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=0, atol=2e-6)  # fp32 math, |values| < 10


def _heads(layout, batch, heads, seq, head_dim, generator):
    """[B, H, T, D] in one of the layouts q and k reach the op in: contiguous, HF's transposed [B, T, H, D], or
    heads of a fused projection [B, T, 3 H D] (a row stride along T past H D)."""
    if layout == "bhtd":
        return torch.randn(batch, heads, seq, head_dim, generator=generator)
    if layout == "bthd":
        return torch.randn(batch, seq, heads, head_dim, generator=generator).transpose(1, 2)
    fused = torch.randn(batch, seq, 3 * heads * head_dim, generator=generator)
    return fused[..., heads * head_dim : 2 * heads * head_dim].view(batch, seq, heads, head_dim).transpose(1, 2)


LAYOUTS = st.sampled_from(["bhtd", "bthd", "fused"])


@given(
    batch=st.integers(1, 3),
    q_heads=st.integers(1, 5),
    k_heads=st.integers(1, 3),
    seq=st.integers(1, 9),
    half=st.integers(1, 6),
    q_layout=LAYOUTS,
    k_layout=LAYOUTS,
    cos_batch=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_q_and_k_in_other_layouts_and_any_cos_sin(batch, q_heads, k_heads, seq, half, q_layout, k_layout, cos_batch,
                                                  seed):
    # q and k each in its own layout (their head, position and batch strides differ), and cos / sin whose two halves
    # differ (HF's are cat(freqs, freqs)): the backward must be the transpose of the forward for any cos and sin,
    # which reads sin's second half where the forward reads its first.
    g = torch.Generator().manual_seed(seed)
    q = _heads(q_layout, batch, q_heads, seq, 2 * half, g)
    k = _heads(k_layout, batch, k_heads, seq, 2 * half, g)
    angles = torch.randn(batch if cos_batch else 1, seq, 2 * half, generator=g, dtype=torch.float64) * 3
    cos, sin = angles.cos().float(), (angles * 0.7).sin().float()
    dq, dk = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)
    want = _fwd_bwd(reference.apply_rotary, q.double(), k.double(), cos.double(), sin.double(), dq.double(),
                    dk.double())
    got = _fwd_bwd(apply_rotary, q, k, cos, sin, dq, dk)
    for name, g_, w_ in zip(("q_out", "k_out", "dq", "dk"), got, want):
        err = (g_ - w_).abs().max().item()
        assert err <= 2e-6, f"{name}: max error {err:.3e} > 2e-6 (fp32 math, |values| < 10)"


def test_unsqueeze_dim_2_layout():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 5, 4, 6, generator=g), torch.randn(2, 5, 2, 6, generator=g)  # [B, T, H, D]
    cos, sin = _cos_sin(2, 5, 6, g)
    q_out, k_out = apply_rotary(q, k, cos, sin, unsqueeze_dim=2)
    q_ref, k_ref = reference.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    torch.testing.assert_close(q_out, q_ref.transpose(1, 2))
    torch.testing.assert_close(k_out, k_ref.transpose(1, 2))


def test_output_keeps_the_input_layout():
    q = torch.randn(2, 7, 3, 8).transpose(1, 2)
    k = torch.randn(2, 3, 7, 8)
    cos, sin = _cos_sin(1, 7, 8, torch.Generator().manual_seed(2))
    q_out, k_out = apply_rotary(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()


def test_bad_input():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    cos, sin = _cos_sin(1, 3, 8, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="k"):
        apply_rotary(q, torch.randn(1, 2, 4, 8), cos, sin)
    with pytest.raises(ValueError, match="cos"):
        apply_rotary(q, k, torch.randn(1, 3, 10), torch.randn(1, 3, 10))
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        apply_rotary(q, k, cos, sin, unsqueeze_dim=0)


def test_cos_of_one_position_broadcasts_over_the_sequence():
    # cos/sin [1, 1, D] against q [B, H, T, D]: HF's q * cos broadcasts; the kernel reads T rows of cos, so the
    # torch path must run.
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 1, 5, 8, generator=g)
    cos, sin = _cos_sin(1, 1, 8, g)
    got = apply_rotary(q, k, cos, sin)
    want = reference.apply_rotary(q, k, cos, sin)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_)


def test_fp64_keeps_fp64_precision():
    # The kernel computes in fp32: fp64 inputs take the torch path.
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cos, sin = _cos_sin(1, 5, 8, g, dtype=torch.float64)
    for got, want in zip(apply_rotary(q, k, cos, sin), reference.apply_rotary(q, k, cos, sin)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
