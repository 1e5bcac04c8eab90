"""W8A8 FP8 linear (fastgrpo.ops.fp8_scaled_linear) against its fp64 reference, through both GEMMs (torch._scaled_mm
and the Triton kernel): hypothesis shapes (odd ones fall back to fp8_linear), bias or none, bf16 / fp16 / fp32
activations, zero rows, the traced op; on a GPU, the decode shapes of Qwen2.5-1.5B and Llama-3.1-8B (stacked q/k/v
and gate/up included), compiled with Inductor and graphed. torch._scaled_mm runs on the CPU (torch 2.13, rowwise
scales included) and the kernel under Triton's interpreter (fp32 dots), so the CPU tests run the real op.

Tolerances, derived per element. The op computes y = bf16((xq q^T) sx scale + bf16(bias)) with xq, sx =
quantize_rows(x) (tests/test_fp8_linear.py bounds that rounding: it is quantize_fp8's), then casts y to x's dtype.
`reference` does the same quantization and the rest in fp64, where xq, q, sx and scale are exact, so:
  (a) op vs reference (`bound`): the GEMM's accumulation, acc = c_acc scale sx sum_k |xq_k q_k| + u32 (|ref| + |b|)
      (bias and scale products; u32 = 2^-24), the bias's rounding to bf16 (u16 |b|, u16 = 2^-8, bf16's unit
      roundoff), and the bf16 output's: u16 (|ref| + acc + u16 |b|); bf16 -> x's dtype is exact but for fp16's
      subnormals (one subnormal step). On the CPU the products e4m3 x e4m3 (8 significant bits) are exact in fp32
      and summed in fp32: c_acc = (K + 4) u32 (K - 1 additions, the two scale products and a dequantization
      rounding if the library scales the operands first). On Hopper's FP8 tensor cores the sums of one MMA
      (32 products) are kept to about 13 mantissa bits (DeepSeek-V3 report, section 3.3.2: "around 14 bits"),
      and torch's kernel without fast accumulation adds them into fp32 every 4 MMAs: c_acc = 4 x 2^-13 + (K + 4) u32
      (4 truncations per promotion, each relative to the partial sum, which is at most the sum of |products|).
      The Triton kernel promotes as often (every 128 of K: 4 MMAs of 32) and adds its split-K partials in fp32
      (at most K - 1 additions in all): the same bound. Triton's interpreter truncates fp32 to bf16 instead of
      rounding to nearest, so there the output's rounding is one ulp (2 u16), not half of one.
  (b) op vs the exact product of unquantized x with the dequantized weight: (a)'s bound plus what rounding x costs,
      sum_k |x_k - xq_k sx| |w_k| <= sum_k ((2^-4 + 2^-23) |x_k| + 2^-10 sx) |w_k| (3 mantissa bits, nearest; an
      fp32 division before; e4m3's subnormal step 2^-9 sx). Loose (the sum of absolute values) but it fails an
      activation scale that saturates or ignores a row's own amax.
(a) has the teeth: test_bound_catches_wrong_scaling shows it fails a per-tensor activation scale, a neighbouring
row's weight scale and unscaled activations.
"""
import os

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from fastgrpo.ops.fp8_linear import (
    FP8_MAX,
    dequantize_fp8,
    fp8_linear,
    fp8_linear_torch,
    group_scale_per_value,
    prepare_fp8_linear,
    quantize_fp8,
    quantize_groups,
    quantize_rows,
)
from fastgrpo.ops.fp8_scaled_linear import (
    GEMM,
    GEMMS,
    dequantized_x,
    fp8_scaled_linear,
    fp8_scaled_linear_reference,
    scaled_mm_fits,
)
from tests.graph_replay import assert_replays_exactly
from tests.error_bounds import assert_within

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
U32, U16 = 2.0**-24, 2.0**-8
CPU_ACC, GPU_ACC = 0.0, 4 * 2.0**-13  # c_acc beyond (K + 4) u32 (module docstring)


def make(g, M, N, K, dtype, with_bias=True, device="cpu"):
    """x [M, K] with rows of different magnitudes (2^-6 .. 2^6: per-token scales differ), a random weight [N, K]
    quantized with rows of different scales, bias [N] in dtype (or None)."""
    x = torch.randn(M, K, generator=g) * 2.0 ** torch.randint(-6, 7, (M, 1), generator=g)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 0.1
    q, scale = quantize_fp8(w.to(device))
    bias = torch.randn(N, generator=g).to(dtype).to(device) if with_bias else None
    return x.to(dtype).to(device), q, scale, bias


def sum_abs(x, q, scale, x_group=None):
    """scale sum_k |xq_k sx_k q_k| [M, N], fp64: the size of the GEMM's sum (sx_k: x_k's row or group scale)."""
    return (dequantized_x(x, x_group).abs() @ q.double().abs().T) * scale.double()


def bound(ref, x, q, scale, bias, dtype, c_acc=CPU_ACC, out_u=U16, x_group=None):
    """(a): |op - reference| per element (module docstring); out_u: the output's rounding (relative). With
    x_group the same: each group's partial sum is scaled once (one rounding of its own size, within (K + 4) u32)."""
    K = x.shape[-1]
    b = 0.0 if bias is None else bias.double().abs()
    acc = (c_acc + (K + 4) * U32) * sum_abs(x, q, scale, x_group) + U32 * (ref.abs() + b)
    subnormal = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    return out_u * (ref.abs() + acc + U16 * b) + acc + U16 * b + subnormal


def rounding_x(x, q, scale, x_group=None):
    """(b)'s extra term: sum_k ((2^-4 + 2^-23) |x_k| + 2^-10 sx_k) |w_k| [M, N], fp64 (sx_k: x_k's row or group
    scale)."""
    K = x.shape[-1]
    if x_group is None:
        sx = quantize_rows(x)[1].double()[:, None].expand(-1, K)
    else:
        sx = group_scale_per_value(quantize_groups(x, x_group)[1].double(), x_group, K)
    w = dequantize_fp8(q, scale, torch.float64).abs()
    return (2.0**-4 + 2.0**-23) * (x.double().abs() @ w.T) + 2.0**-10 * (sx @ w.T)


def exact(x, q, scale, bias):
    y = x.double() @ dequantize_fp8(q, scale, torch.float64).T
    return y if bias is None else y + bias.double()


def output_rounding(gemm, device):
    """u16, or one ulp where Triton's interpreter writes the kernel's bf16 output (it truncates)."""
    interpreted = (gemm or GEMM) == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    return 2 * U16 if interpreted else U16


def check(x, q, scale, bias, c_acc=CPU_ACC, what="", gemm=None, x_group=None):
    got = fp8_scaled_linear(x, q, scale, bias, gemm, x_group)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], q.shape[0])
    ref = fp8_scaled_linear_reference(x, q, scale, bias, x_group)
    tol = bound(ref, x, q, scale, bias, x.dtype, c_acc, output_rounding(gemm, x.device), x_group)
    assert_within(got, ref, tol, f"{what} vs the reference")
    assert_within(got, exact(x, q, scale, bias), tol + rounding_x(x, q, scale, x_group), f"{what} vs unquantized x")
    return got


# ---- CPU -------------------------------------------------------------------------------------------------------

@given(M=st.integers(1, 20), N=st.integers(1, 6).map(lambda n: 16 * n), K=st.integers(1, 8).map(lambda k: 16 * k),
       dtype=st.sampled_from(DTYPES), with_bias=st.booleans(), gemm=st.sampled_from(GEMMS),
       seed=st.integers(0, 2**16))
def test_matches_reference(M, N, K, dtype, with_bias, gemm, seed):
    """Shapes _scaled_mm takes (K, N multiples of 16, any M) within bounds (a) and (b); the Triton kernel with its
    interpreter tiles (16 wide: several row and feature tiles, up to 3 splits)."""
    g = torch.Generator().manual_seed(seed)
    check(*make(g, M, N, K, dtype, with_bias), what=f"{gemm} {dtype} M{M} N{N} K{K}", gemm=gemm)


def test_triton_gemm_splits_and_tiles():
    """The Triton GEMM with e4m3 x across tiles, splits and a ragged last K step (K = 120 in 16-wide steps: splits of
    48, 48 and 24 = 16 + 8), bias or none, against the reference; bitwise the same twice, tickets back to 0."""
    import triton

    from fastgrpo.kernels.fp8_linear import Fp8LinearConfig, _counters, fp8_linear_fwd

    g = torch.Generator().manual_seed(1)
    K = 120
    config = Fp8LinearConfig(block_m=16, block_n=16, block_k=16, split_k=3)
    per_split = triton.cdiv(triton.cdiv(K, 3), 16) * 16  # fp8_linear_fwd's rule
    assert (per_split, triton.cdiv(K, per_split), K % 16) == (48, 3, 8)
    for with_bias in (True, False):
        x, q, scale, bias = make(g, 21, 48, K, torch.bfloat16, with_bias)
        xq, sx = quantize_rows(x)
        b16 = None if bias is None else bias.bfloat16()
        got = fp8_linear_fwd(xq, q, scale, b16, config, x_scale=sx, out_dtype=torch.bfloat16)
        # the op's W8A8 math in fp64 (fp8_scaled_linear_reference would take W8A16's for K = 120, not a multiple of
        # 16: the op's rule, which this direct kernel call is not under)
        ref = fp8_linear_torch((xq.double() * sx.double()[:, None]), q, scale.double(),
                               None if bias is None else bias.double())
        tol = bound(ref, x, q, scale, bias, torch.bfloat16, out_u=output_rounding("triton", x.device))
        assert_within(got, ref, tol, f"triton split 3, bias {with_bias}")
        assert torch.equal(fp8_linear_fwd(xq, q, scale, b16, config, x_scale=sx, out_dtype=torch.bfloat16), got)
        assert not _counters(torch.device("cpu")).any()


@given(M=st.integers(1, 9), N=st.integers(1, 40), K=st.integers(1, 40), with_bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_other_shapes_run_fp8_linear(M, N, K, with_bias, seed):
    """Where K or N is not a multiple of 16 (what CUDA's _scaled_mm refuses), the op is fp8_linear bit for bit, on
    the CPU too (which would take any shape): both devices run the same math."""
    assume(not scaled_mm_fits(N, K))
    g = torch.Generator().manual_seed(seed)
    x, q, scale, bias = make(g, M, N, K, torch.bfloat16, with_bias)
    assert torch.equal(fp8_scaled_linear(x, q, scale, bias), fp8_linear(x, q, scale, bias))


def test_runs_one_scaled_mm_with_rowwise_scales(monkeypatch):
    """One _scaled_mm per call where the shape fits, with scale_a [M, 1] and scale_b [1, N] (what CUDA's rowwise
    kernel wants) and an e4m3 column-major weight operand; none where it does not."""
    calls = []
    scaled_mm = torch._scaled_mm

    def recorded(a, b, **kwargs):
        calls.append((a.dtype, b.stride(), kwargs["scale_a"].shape, kwargs["scale_b"].shape, kwargs["out_dtype"]))
        return scaled_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recorded)
    g = torch.Generator().manual_seed(0)
    fp8_scaled_linear(*make(g, 5, 48, 32, torch.bfloat16), gemm="scaled_mm")
    assert calls == [(torch.float8_e4m3fn, (1, 32), (5, 1), (1, 48), torch.bfloat16)]
    fp8_scaled_linear(*make(g, 5, 44, 32, torch.bfloat16), gemm="scaled_mm")
    assert len(calls) == 1


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows(dtype, gemm):
    """An all-zero row (a padded token) gets scale fp32's smallest normal, not 0/0: its output is the bias (through
    bf16), and the other rows are untouched; an all-zero x too."""
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 4, 32, 48, dtype)
    x[1] = 0
    got = check(x, q, scale, bias, what=f"{gemm} {dtype} zero row", gemm=gemm)
    assert torch.equal(got[1], bias.bfloat16().to(dtype))
    zeros = fp8_scaled_linear(torch.zeros_like(x), q, scale, None, gemm)
    assert torch.equal(zeros, torch.zeros(4, 32, dtype=dtype))


def test_bound_catches_wrong_scaling():
    """Bound (a) fails what a wrong op would compute with the same _scaled_mm: one activation scale for the whole
    tensor (per-tensor, rows of different magnitudes), a neighbouring row's weight scale, unscaled activations."""
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 8, 32, 64, torch.bfloat16)
    ref = fp8_scaled_linear_reference(x, q, scale, bias)
    tol = bound(ref, x, q, scale, bias, torch.bfloat16)

    def scaled(xq, sx, w_scale):
        return torch._scaled_mm(xq, q.t(), scale_a=sx[:, None], scale_b=w_scale[None, :], bias=bias,
                                out_dtype=torch.bfloat16)

    xq, sx = quantize_rows(x)
    whole = x.float().abs().amax() / FP8_MAX
    per_tensor = scaled((x.float() / whole).to(torch.float8_e4m3fn), whole.expand(8).contiguous(), scale)
    unscaled = scaled(x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), torch.ones(8), scale)
    for wrong in (per_tensor, scaled(xq, sx, scale.roll(1)), unscaled):
        assert ((wrong.double() - ref).abs() > tol).any()


def test_leading_dims_and_strides():
    """[B, 1, K] decode-step inputs and a non-contiguous x give the 2-D results, reshaped; a strided bias the
    contiguous one's, through either GEMM."""
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 6, 32, 48, torch.bfloat16)
    flat = fp8_scaled_linear(x, q, scale, bias)
    assert torch.equal(fp8_scaled_linear(x[:, None], q, scale, bias), flat[:, None])
    wide = torch.cat([x, x], 1)[:, ::2]  # stride 2 along K
    assert torch.equal(fp8_scaled_linear(wide, q, scale, bias), fp8_scaled_linear(wide.contiguous(), q, scale, bias))
    strided_bias = torch.stack([bias, -bias], 1)[:, 0]  # stride 2
    for gemm in GEMMS:
        assert torch.equal(fp8_scaled_linear(x, q, scale, strided_bias, gemm),
                           fp8_scaled_linear(x, q, scale, bias.contiguous(), gemm)), gemm


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("N", [48, 44])  # the GEMM, fp8_linear
def test_traced_whole(N, gemm):
    """Traced with fullgraph (no graph break: no host sync, nothing data-dependent) and functionalized
    (aot_eager, as under Inductor), the op gives its eager bits."""
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 5, N, 32, torch.bfloat16)
    torch._dynamo.reset()
    step = torch.compile(lambda t: fp8_scaled_linear(t, q, scale, bias, gemm), backend="aot_eager", fullgraph=True,
                         dynamic=False)
    assert torch.equal(step(x), fp8_scaled_linear(x, q, scale, bias, gemm))
    torch._dynamo.reset()


def test_bad_input():
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 2, 16, 16, torch.float32)
    for args, name in (((x, q.float(), scale, bias), "q"), ((x[:, :8], q, scale, bias), "q"),
                       ((x, q, scale[:7], bias), "scale"), ((x, q, scale, bias[:3]), "bias"),
                       ((x.double(), q, scale, bias), "x"), ((x, q, scale, bias, "cublas"), "gemm")):
        with pytest.raises(ValueError, match=name):
            fp8_scaled_linear(*args)


# ---- per-group activation scales (x_group) ----------------------------------------------------------------------

def grouped(g, M, N, K, dtype, with_bias=True, device="cpu"):
    """make's operands with x's groups of 16 along K at magnitudes 2^-6 .. 2^6 within a row, so that a row's scale
    and its groups' differ."""
    x, q, scale, bias = make(g, M, N, K, torch.float32, with_bias)
    x = x * 2.0 ** torch.randint(-6, 7, (1, K // 16 + 1), generator=g).repeat_interleave(16, 1)[:, :K]
    return x.to(dtype).to(device), q.to(device), scale.to(device), bias if bias is None else bias.to(device)


@given(M=st.integers(1, 20), N=st.integers(1, 6).map(lambda n: 16 * n), K=st.integers(1, 8).map(lambda k: 16 * k),
       x_group=st.sampled_from([16, 32, 64]), dtype=st.sampled_from(DTYPES), with_bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_groups_match_reference(M, N, K, x_group, dtype, with_bias, seed):
    """x_group: bounds (a) and (b) with each group's own scale, through the Triton GEMM (interpreter tiles: K steps
    of 16, up to 3 splits, a last group shorter than x_group where it does not divide K)."""
    g = torch.Generator().manual_seed(seed)
    check(*grouped(g, M, N, K, dtype, with_bias), what=f"groups of {x_group} {dtype} M{M} N{N} K{K}", gemm="triton",
          x_group=x_group)


def test_quantize_groups():
    """Each group of a row is quantize_rows of that group alone (its amax to 448, its own scale; an all-zero group
    gets fp32's smallest normal), a last, shorter group too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 40, generator=g) * 2.0 ** torch.randint(-6, 7, (5, 40), generator=g)
    x[2, 16:32] = 0
    xq, sx = quantize_groups(x, 16)
    assert xq.shape == (5, 40) and sx.shape == (5, 3) and xq.dtype == torch.float8_e4m3fn
    for j, (lo, hi) in enumerate(((0, 16), (16, 32), (32, 40))):
        want_q, want_s = quantize_rows(x[:, lo:hi])
        assert torch.equal(sx[:, j], want_s) and torch.equal(xq[:, lo:hi].float(), want_q.float())
    assert sx[2, 1] == torch.finfo(torch.float32).tiny


def test_group_bound_catches_wrong_scaling():
    """Bound (a) with x_group fails the per-row op on the same x (rows whose groups differ by up to 2^12), and the
    kernel fed every group's scale but the first's."""
    from fastgrpo.kernels.fp8_linear import fp8_linear_fwd

    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = grouped(g, 8, 32, 64, torch.bfloat16)
    ref = fp8_scaled_linear_reference(x, q, scale, bias, 16)
    tol = bound(ref, x, q, scale, bias, torch.bfloat16, out_u=output_rounding("triton", x.device), x_group=16)
    assert_within(fp8_scaled_linear(x, q, scale, bias, "triton", 16), ref, tol, "groups of 16")
    xq, sx = quantize_groups(x, 16)
    first_only = sx[:, :1].expand(-1, sx.shape[1]).contiguous()
    for wrong in (fp8_scaled_linear(x, q, scale, bias, "triton"),
                  fp8_linear_fwd(xq, q, scale, bias.bfloat16(), x_scale=first_only, out_dtype=torch.bfloat16,
                                 x_group=16)):
        assert ((wrong.double() - ref).abs() > tol).any()


def test_group_bad_input():
    """x_group: a power of two of at least 16 (whole K steps of the GEMM), the Triton GEMM only; the kernel refuses a
    scale of the wrong shape and a config whose K step crosses groups."""
    from fastgrpo.kernels.fp8_linear import Fp8LinearConfig, fp8_linear_fwd

    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 2, 16, 64, torch.bfloat16)
    for x_group, gemm in ((24, "triton"), (8, "triton"), (0, "triton"), (True, "triton"), (16, "scaled_mm")):
        with pytest.raises(ValueError, match="x_group"):
            fp8_scaled_linear(x, q, scale, bias, gemm, x_group)
    xq, sx = quantize_groups(x, 16)
    with pytest.raises(ValueError, match="x_scale"):
        fp8_linear_fwd(xq, q, scale, None, x_scale=sx[:, :2].contiguous(), out_dtype=torch.bfloat16, x_group=16)
    with pytest.raises(ValueError, match="block_k"):
        fp8_linear_fwd(xq, q, scale, None, Fp8LinearConfig(16, 16, 32, 1), x_scale=sx, out_dtype=torch.bfloat16,
                       x_group=16)


# ---- GPU -------------------------------------------------------------------------------------------------------

# (M, N, K): a decode step's GEMMs at 64 rows, stacked as the copy runs them (Llama-3.1-8B q/k/v, o, gate/up, down,
# lm_head; Qwen2.5-1.5B's), and odd ones: M < 16, ragged K (fp8_linear's path), K = 2000 (a multiple of 16 only)
GPU_SHAPES = [(64, 6144, 4096), (64, 4096, 4096), (64, 28672, 4096), (64, 4096, 14336), (64, 128256, 4096),
              (64, 2048, 1536), (64, 1536, 1536), (64, 17920, 1536), (64, 1536, 8960), (3, 304, 2000),
              (37, 1000, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("M, N, K", GPU_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_matches_reference(M, N, K, with_bias, gemm):
    """bf16 within bounds (a) (Hopper's accumulator) and (b), no worse than cuBLAS's bf16 GEMM of the same e4m3
    operands (exact in bf16) scaled in fp32, plus an ulp; bitwise the same on a second call."""
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, M, N, K, torch.bfloat16, with_bias, device="cuda")
    prepare_fp8_linear(x.device)
    if not scaled_mm_fits(N, K):
        assert torch.equal(fp8_scaled_linear(x, q, scale, bias, gemm), fp8_linear(x, q, scale, bias))
        return
    got = check(x, q, scale, bias, GPU_ACC, f"gpu {gemm} M{M} N{N} K{K}", gemm)
    ref = fp8_scaled_linear_reference(x, q, scale, bias)
    xq, sx = quantize_rows(x)
    cublas = (xq.bfloat16() @ q.bfloat16().T).float() * sx[:, None] * scale
    cublas = (cublas if bias is None else cublas + bias.float()).bfloat16()
    eps = torch.finfo(torch.bfloat16).eps
    assert (got.double() - ref).abs().max() <= (cublas.double() - ref).abs().max() + eps * ref.abs().max()
    assert torch.equal(fp8_scaled_linear(x, q, scale, bias, gemm), got)


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("N", [6144, 1000])  # the GEMM, fp8_linear (ragged N)
def test_gpu_compiled_and_graphed(N, gemm):
    """Inductor-compiled (the quantizer fused, _scaled_mm an extern kernel) and replayed as a CUDA graph, as in the
    decode step: the eager op's bits, replay after replay. Each row's largest |x| is 448 x 2^-j, so its scale is
    2^-j whether Inductor divides by 448 or multiplies by its fp32 reciprocal (448 fl(1/448) rounds to 1): the
    quantized x, and then the GEMM's inputs, are the same bits either way."""
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 64, N, 4096, torch.bfloat16, device="cuda")
    top = 2.0 ** torch.randint(-8, 0, (64,), generator=g).cuda()
    x = (x / x.abs().amax(1, keepdim=True) * 0.99 * FP8_MAX * top[:, None]).bfloat16()
    x[:, 0] = FP8_MAX * top
    prepare_fp8_linear(x.device)
    want = fp8_scaled_linear(x, q, scale, bias, gemm)
    torch._dynamo.reset()
    assert_replays_exactly(lambda t: fp8_scaled_linear(t, q, scale, bias, gemm).relu(), x, want.relu())
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K", [shape for shape in GPU_SHAPES if scaled_mm_fits(*shape[1:])])
@pytest.mark.parametrize("x_group", [128, 256])
def test_gpu_groups_match_reference(M, N, K, x_group):
    """x_group on the FP8 tensor cores: bounds (a) (Hopper's accumulator) and (b) at the decode shapes, groups of
    128 (K steps cut to 128 from the narrow tiles' 256) and 256; bitwise the same on a second call."""
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = grouped(g, M, N, K, torch.bfloat16, device="cuda")
    prepare_fp8_linear(x.device)
    got = check(x, q, scale, bias, GPU_ACC, f"gpu groups of {x_group} M{M} N{N} K{K}", "triton", x_group)
    assert torch.equal(fp8_scaled_linear(x, q, scale, bias, "triton", x_group), got)
