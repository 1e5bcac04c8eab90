"""FP8 weight-only linear (fastgrpo.ops.fp8_linear): the quantizer's error bound, the kernel against the fp64
dequantize-then-matmul reference (odd shapes, several tiles and splits, ragged K), its split-K tickets, the op's
dispatch and checks; on a GPU, bf16 at the decode shapes of Qwen2.5-1.5B and Llama-3.1-8B, compiled and graphed.

Triton's interpreter reads float8_e4m3fn exactly (every finite code, checked against torch), so the kernel runs
on the CPU here with fp32 dots (kernels/fp8_linear.py).

Kernel tolerance, derived per element (`bound`): x (16-bit or fp32), q (e4m3) and scale (fp32) are exact in fp64,
so the error comes from (1) fp32 accumulation of K products (exact for 16-bit x: 8 x 4 mantissa bits) plus the
SPLIT_K partial sums, the scale product and the bias add: (K + splits + 4) 2^-24 scale sum_k |x_k q_k| +
2^-24 (|bias| + |ref|); (2) the output's rounding to x's dtype: one ulp of it (the interpreter truncates).
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.ops import fp8_linear as ops
from fastgrpo.ops.fp8_linear import FP8_DTYPE, FP8_MAX, dequantize_fp8, fp8_linear, fp8_linear_torch, quantize_fp8
from tests.error_bounds import assert_within
from tests.graph_replay import assert_replays_exactly
from tests.sm90_compile import sm90_compile_output

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
U32 = 2.0**-24


def bound(ref, x, q, scale, bias, dtype, splits):
    """Per-element error bound of the kernel's [M, N] output vs the fp64 `ref` (module docstring)."""
    K = x.shape[-1]
    sum_abs = (x.double().abs() @ q.double().abs().T) * scale.double()  # scale sum_k |x_k q_k|
    fp32 = U32 * ((K + splits + 4) * sum_abs + ref.abs() + (0.0 if bias is None else bias.double().abs()))
    eps = torch.finfo(dtype).eps
    return eps * (ref.abs() + fp32) + fp32 + torch.finfo(dtype).tiny


def make(g, M, N, K, dtype, with_bias=True, device="cpu"):
    """x [M, K] in dtype, a random weight [N, K] quantized, bias [N] in dtype (or None)."""
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 0.1  # rows of different scales
    q, scale = quantize_fp8(w.to(device))
    bias = torch.randn(N, generator=g).to(dtype).to(device) if with_bias else None
    return x, q, scale, bias


def reference(x, q, scale, bias):
    return fp8_linear_torch(x.double(), q, scale.double(), None if bias is None else bias.double())


# ---- the quantizer -------------------------------------------------------------------------------------------

@given(N=st.integers(1, 9), K=st.integers(1, 70), spread=st.sampled_from([1e-3, 1.0, 1e3]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_quantizer_error_bound(N, K, spread, dtype, seed):
    """|w - q scale| <= 2^-4 |w| (3 mantissa bits, nearest) or 2^-10 scale (e4m3's subnormal step) per weight; the
    row's largest |w| becomes +-448 exactly. Truncating instead of rounding breaks the bound (2^-3 |w|)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * spread * torch.rand(N, 1, generator=g)).to(dtype)
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == (N, K) and scale.shape == (N,) and scale.dtype == torch.float32
    w64 = w.double()
    err = (w64 - dequantize_fp8(q, scale, torch.float64)).abs()
    tol = (2.0**-4 + 2.0**-23) * w64.abs() + 2.0**-10 * scale.double()[:, None]
    assert (err <= tol).all(), f"max excess {(err - tol).max():.3e}"
    top = w64.abs().argmax(1)
    assert (q.float().abs().gather(1, top[:, None]) == FP8_MAX).all()


def test_quantizer_zero_rows_and_chunks(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(11, 37, generator=g)
    w[3] = 0.0
    q, scale = quantize_fp8(w)
    assert (q[3].float() == 0).all() and torch.isfinite(scale).all() and scale[3] > 0
    monkeypatch.setattr(ops, "QUANT_CHUNK", 40)  # one row per chunk
    q2, scale2 = quantize_fp8(w)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)


def test_quantizer_into_out_buffers():
    """out=(q, scale): the rows land in the caller's buffers (slices of a fused group's stacked copy) with the bytes
    of a plain call; a wrong buffer gets a clear error."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 40, generator=g).bfloat16()
    q, scale = torch.zeros(10, 40, dtype=FP8_DTYPE), torch.zeros(10)
    got = quantize_fp8(w, (q[3:9], scale[3:9]))
    want = quantize_fp8(w)
    assert got[0].data_ptr() == q[3:9].data_ptr()
    assert torch.equal(q[3:9].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scale[3:9], want[1])
    assert (q[:3].float() == 0).all() and (scale[9:] == 0).all()  # nothing outside the slice
    with pytest.raises(ValueError, match=r"out\[0\]: expected shape \[6, 40\]"):
        quantize_fp8(w, (q[:5], scale[:6]))
    with pytest.raises(ValueError, match=r"out\[1\]: expected dtype"):
        quantize_fp8(w, (q[:6], scale[:6].double()))
    with pytest.raises(ValueError, match=r"out\[0\]: expected a tensor on the weight's device cpu"):
        quantize_fp8(w, (q[:6].to("meta"), scale[:6]))


def test_quantizer_keeps_fp8_weights():
    """Weights already on the grid (power-of-two row scales, one +-448 per row) come back bit for bit."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(6, 20, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q[:, 0] = FP8_MAX
    scale = 2.0 ** torch.randint(-12, 2, (6,), generator=g).float()
    q2, scale2 = quantize_fp8(dequantize_fp8(q, scale))
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)


# ---- the kernel (Triton interpreter on the CPU) ----------------------------------------------------------------

@pytest.mark.parametrize("M, N, K", [(1, 16, 16), (5, 47, 100), (37, 33, 64), (70, 20, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_fp64_reference(M, N, K, dtype):
    """Default tiles (16 wide under the interpreter): several feature and row tiles, up to 3 splits, ragged K."""
    from fastgrpo.kernels.fp8_linear import default_config

    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, q, scale, bias = make(g, M, N, K, dtype)
    got = fp8_linear(x, q, scale, bias)
    ref = reference(x, q, scale, bias)
    splits = default_config(M, N, K, torch.device("cpu")).split_k
    assert got.dtype == dtype and got.shape == (M, N)
    assert_within(got, ref, bound(ref, x, q, scale, bias, dtype, splits), f"{dtype} M{M} N{N} K{K}")


@pytest.mark.parametrize("split_k, block_k", [(1, 16), (2, 32), (4, 16), (7, 16), (12, 16)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_splits(split_k, block_k, with_bias):
    """Each split-K count gives the reference (K = 100: the last split ragged; 12 asked of 16-wide K steps gives
    7), bitwise the same twice, and the tickets are all back to 0."""
    from fastgrpo.kernels.fp8_linear import Fp8LinearConfig, _counters, fp8_linear_fwd

    g = torch.Generator().manual_seed(split_k)
    x, q, scale, bias = make(g, 9, 40, 100, torch.bfloat16, with_bias)
    config = Fp8LinearConfig(block_m=16, block_n=16, block_k=block_k, split_k=split_k)
    got = fp8_linear_fwd(x, q, scale, bias, config)
    ref = reference(x, q, scale, bias)
    assert_within(got, ref, bound(ref, x, q, scale, bias, torch.bfloat16, min(split_k, 7)), f"split {split_k}")
    assert torch.equal(fp8_linear_fwd(x, q, scale, bias, config), got)
    assert not _counters(torch.device("cpu")).any()


def test_bound_catches_a_wrong_scale():
    """The bound is tight enough to fail a kernel that scales by a neighbouring row's scale."""
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 4, 16, 64, torch.bfloat16)
    ref = reference(x, q, scale, bias)
    wrong = fp8_linear_torch(x, q, scale.roll(1), bias)
    assert ((wrong.double() - ref).abs() > bound(ref, x, q, scale, bias, torch.bfloat16, 1)).any()


HOPPER_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastgrpo.kernels.fp8_linear import (GPU_TILES, W8A8_NARROW_TILES, W8A8_TILES, W8A8_WIDE_TILES,
                                        _fp8_linear_kernel as fn)
ints = {a: "i32" for a in fn.arg_names[8:16]}
consts = {a: "constexpr" for a in fn.arg_names[16:]}
# what the JIT specializes at a launch on aligned tensors of the decode shapes (multiples of 16; not `splits`)
attrs = {(i,): [["tt.divisibility", 16]] for i in range(15)}
for name, fp8_x, t in (("GPU_TILES", False, GPU_TILES), ("W8A8_TILES", True, W8A8_TILES),
                       ("W8A8_NARROW_TILES", True, W8A8_NARROW_TILES), ("W8A8_WIDE_TILES", True, W8A8_WIDE_TILES)):
    sig = {"X": "*fp8e4nv" if fp8_x else "*bf16", "W": "*fp8e4nv", "SCALE": "*fp32", "BIAS": "*bf16", "Y": "*bf16",
           "PARTIAL": "*fp32", "COUNTS": "*i32", "X_SCALE": "*fp32", **ints, **consts}
    for split in (True, False):
        values = dict(HAS_BIAS=True, SPLIT=split, EVEN_K=True, FP32_DOT=False, FP8_X=fp8_x, BLOCK_M=64,
                      BLOCK_N=t["block_n"], BLOCK_K=t["block_k"], PRECISE_EVERY=min(t["block_k"], 128))
        kernel = triton.compile(ASTSource(fn, sig, values, attrs), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": t["num_warps"], "num_stages": t["num_stages"]})
        ir = kernel.asm["ttgir"]
        print(name, split, "warp_group_dot" in ir, ir.count("async_copy_global_to_local"), kernel.metadata.shared,
              t["num_stages"], t["programs_per_sm"])
"""


def test_compiles_for_hopper():
    """The default GPU configs compile for sm_90 on the CPU (Triton's own ptxas, no GPU), W8A16 and W8A8's three
    tile families: wgmma, loads pipelined with cp.async (stages x 2 loads), shared memory for the programs per SM
    they plan; the narrow W8A8 tiles take what W8A8_NARROW_SHARED says (w8a8_tiles compares it with the card's), the
    others would fit an Ada card's 99 KB (as compiled for sm_90: sm_89's compile is not checked). CI never sees a GPU;
    this keeps an edit that breaks the real compile, or its pipelining, from passing as the interpreter would."""
    from fastgrpo.kernels.fp8_linear import W8A8_NARROW_SHARED

    out = sm90_compile_output(HOPPER_CHECK)
    lines = out.split("\n")[:8]
    assert len(lines) == 8, out
    for line in lines:
        name, _, wgmma, copies, shared, stages, per_sm = line.split()
        assert wgmma == "True" and int(copies) == 2 * int(stages) and int(shared) <= 228 * 1024 // int(per_sm), line
        assert int(shared) == W8A8_NARROW_SHARED if name == "W8A8_NARROW_TILES" else int(shared) <= 99 * 1024, line


def test_w8a8_tiles_by_width():
    """At most one 64 x 64 tile per SM: the narrow tiles where the card has their shared memory, else W8A8_TILES;
    more tiles than SMs: the wide ones (an H100's 132 SMs: Llama-3.1-8B's q/k/v, o and down are narrow, gate/up and
    lm_head wide)."""
    from fastgrpo.kernels.fp8_linear import (W8A8_NARROW_SHARED, W8A8_NARROW_TILES, W8A8_TILES, W8A8_WIDE_TILES,
                                            w8a8_tiles)

    hopper, ada = 227 * 1024, 99 * 1024
    assert W8A8_NARROW_SHARED > ada
    for M, N in ((64, 6144), (64, 4096), (64, 64 * 132), (128, 64 * 66), (5, 100)):
        assert w8a8_tiles(M, N, 132, hopper) == W8A8_NARROW_TILES == w8a8_tiles(M, N, 132, W8A8_NARROW_SHARED)
        assert w8a8_tiles(M, N, 132, ada) == W8A8_TILES == w8a8_tiles(M, N, 132, W8A8_NARROW_SHARED - 1)
    for M, N in ((64, 28672), (64, 128256), (64, 64 * 133), (128, 64 * 67)):
        assert w8a8_tiles(M, N, 132, hopper) == W8A8_WIDE_TILES == w8a8_tiles(M, N, 132, ada)


def test_default_config_on_a_gpu_takes_the_tiles_by_width(monkeypatch):
    """default_config on a CUDA device (faked: the SM count and shared memory of an H100, then of a card with 99 KB)
    hands w8a8_tiles the shape and the card, and config_for the family it returns; W8A16 keeps GPU_TILES."""
    from fastgrpo.kernels import fp8_linear as kernel

    monkeypatch.setattr(kernel, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    for shared, narrow in ((227 * 1024, kernel.W8A8_NARROW_TILES), (99 * 1024, kernel.W8A8_TILES)):
        monkeypatch.setattr(kernel, "max_shared", lambda device, shared=shared: shared)
        for N, tiles in ((6144, narrow), (4096, narrow), (28672, kernel.W8A8_WIDE_TILES)):
            got = kernel.default_config(64, N, 4096, cuda, fp8_x=True)
            assert got == kernel.config_for(64, N, 4096, 132, **tiles), (shared, N)
        assert kernel.default_config(64, 6144, 4096, cuda) == kernel.config_for(64, 6144, 4096, 132,
                                                                                **kernel.GPU_TILES)


# ---- the op ----------------------------------------------------------------------------------------------------

def test_op_leading_dims_and_strides():
    """[N, 1, K] decode-step inputs and a non-contiguous x give the 2-D results, reshaped."""
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 6, 24, 32, torch.bfloat16)
    flat = fp8_linear(x, q, scale, bias)
    assert torch.equal(fp8_linear(x[:, None], q, scale, bias), flat[:, None])
    wide = torch.cat([x, x], 1)[:, ::2]  # stride 2 along K
    assert torch.equal(fp8_linear(wide, q, scale, bias), fp8_linear(wide.contiguous(), q, scale, bias))


def test_op_torch_path_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 5, 12, 20, torch.float32)
    torch.testing.assert_close(fp8_linear(x, q, scale, bias), fp8_linear_torch(x, q, scale, bias), rtol=0, atol=0)


def test_op_bad_input():
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="q"):
        fp8_linear(x, q.float(), scale, bias)
    with pytest.raises(ValueError, match="q"):
        fp8_linear(x[:, :15], q, scale, bias)
    with pytest.raises(ValueError, match="scale"):
        fp8_linear(x, q, scale[:7], bias)
    with pytest.raises(ValueError, match="scale"):
        fp8_linear(x, q, scale.double(), bias)
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(x, q, scale, bias[:3])
    with pytest.raises(ValueError, match="x"):
        fp8_linear(x.double(), q, scale, bias)


# ---- GPU -------------------------------------------------------------------------------------------------------

# (M, N, K): the decode GEMMs of 64 rows (q, k/v, o, gate/up, down, lm_head) and odd ones (ragged K, M < 16)
GPU_SHAPES = [(64, 4096, 4096), (64, 1024, 4096), (64, 14336, 4096), (64, 4096, 14336), (64, 128256, 4096),
              (64, 256, 1536), (64, 8960, 1536), (64, 1536, 8960), (37, 1000, 1000), (3, 300, 2000)]


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K", GPU_SHAPES)
def test_gpu_matches_fp64_and_cublas(M, N, K):
    """bf16 within the bound, no worse than cuBLAS on the dequantized bf16 weight (plus an ulp), bitwise the same
    on a second call (the split order fixes the sums)."""
    from fastgrpo.kernels.fp8_linear import default_config

    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, M, N, K, torch.bfloat16, device="cuda")
    got = fp8_linear(x, q, scale, bias)
    ref = reference(x, q, scale, bias)
    splits = default_config(M, N, K, x.device).split_k
    assert_within(got, ref, bound(ref, x, q, scale, bias, torch.bfloat16, splits), f"gpu M{M} N{N} K{K}")
    cublas = torch.nn.functional.linear(x, dequantize_fp8(q, scale, torch.bfloat16), bias)
    eps = torch.finfo(torch.bfloat16).eps
    assert (got.double() - ref).abs().max() <= (cublas.double() - ref).abs().max() + eps * ref.abs().max()
    assert torch.equal(fp8_linear(x, q, scale, bias), got)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_quantizer_kernel_gives_the_eager_bytes(dtype):
    """On CUDA quantize_fp8 runs kernels/quantize_fp8.py: its bytes and scales are quantize_rows' on the CPU (IEEE
    divisions) for rows of any length (one element, ragged past the kernel's block, Llama's down_proj), magnitudes
    spread over orders (e4m3 subnormals), an all-zero row, x / scale on rounding ties, rows with a gap between them,
    a transposed weight and into slices; a NaN weight makes its row NaN, as in torch."""
    g = torch.Generator().manual_seed(0)
    for N, K in ((3, 1), (17, 33), (9, 2049), (64, 14336)):
        w = torch.randn(N, K, generator=g) * torch.exp(4 * torch.randn(N, 1, generator=g))
        w = w.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)  # finite weights (fp16 overflows past 65504)
        w[1 % N] = 0.0
        # the last row: amax 448 (scale 1), then values halfway between e4m3 neighbours (round half to even)
        ties = ((torch.arange(8) + 0.5) / 8 + 1) * 2.0 ** torch.arange(-3, 8)[:, None]
        w[-1] = 0.0
        w[-1, 0] = 448.0
        w[-1, 1:] = ties.flatten().repeat(K)[: K - 1]
        w = w.to(dtype).cuda()
        gapped = torch.zeros(N, K + 5, dtype=dtype, device="cuda")
        gapped[:, :K] = w
        for weight in (w, gapped[:, :K], w.T.contiguous().T):
            q, scale = quantize_fp8(weight)
            q0, scale0 = ops.quantize_rows(weight.cpu())  # torch's CUDA eager divides amax by 448 as x * (1/448)
            diff = (q.cpu().view(torch.uint8) != q0.view(torch.uint8)).sum().item()
            scales = (scale.cpu() != scale0).sum().item()
            assert diff == 0 and scales == 0, f"N{N} K{K} {dtype}: {diff} bytes and {scales} scales differ"
    buf, scales = torch.zeros(80, 14336, dtype=FP8_DTYPE, device="cuda"), torch.zeros(80, device="cuda")
    quantize_fp8(w, (buf[10:74], scales[10:74]))
    assert torch.equal(buf[10:74].view(torch.uint8).cpu(), q0.view(torch.uint8))
    assert (buf[:10].view(torch.uint8) == 0).all() and (buf[74:].view(torch.uint8) == 0).all()
    w = torch.randn(2, 100, device="cuda").to(dtype)
    w[1, 7] = float("nan")
    q, scale = quantize_fp8(w)
    assert scale[0].isfinite() and scale[1].isnan() and q[1].float().isnan().all()


@pytest.mark.gpu
def test_gpu_compiled_and_graphed():
    """In a torch.compile'd function replayed as a CUDA graph (the decode step's setting) the op gives its eager
    bits, replay after replay (the split-K tickets reset themselves)."""
    g = torch.Generator().manual_seed(0)
    x, q, scale, bias = make(g, 64, 4096, 4096, torch.bfloat16, device="cuda")
    ops.prepare_fp8_linear(x.device)
    want = fp8_linear(x, q, scale, bias)
    assert_replays_exactly(lambda t: fp8_linear(t, q, scale, bias).relu(), x, want.relu())
