"""NF4 weight-only linear (fastgrpo.ops.nf4_linear) over bitsandbytes' own 4-bit weights: the dequantization bit for
bit against bitsandbytes' dequantize_4bit (nibble order, absmax blocks, double quantization), the kernel against
the fp64 reference (hypothesis-drawn shapes, blocksize 64 and 128, nested absmax on and off, bias or none, splits,
ragged K steps), the CPU path against bitsandbytes' Linear4bit forward, what the op refuses; compiled for sm_90 on
the CPU; on a GPU, bf16 at the decode shapes of Llama-3.1-8B, compiled and graphed.

Reference: bitsandbytes' dequantize_4bit in fp32 (W32 = code[q] absmax, the nested absmax dequantized as it does),
then an fp64 matmul: x (16-bit or fp32), W32 and bias are exact in fp64.

Kernel tolerance, derived per element (`bound`): (1) each weight rounded from W32 to x's dtype in registers:
|dW| <= eps |W32| (eps = one ulp at 1: the interpreter truncates, a GPU rounds to nearest: half that; none for fp32
x); NF4 values times an fp32 absmax are not bf16 numbers, so this is not exact; (2) fp32 accumulation of K exact
products (8 x 8 mantissa bits for 16-bit x; fp32 x: each product rounded once) in one dot per block plus the
split partial sums and the bias add: (K + splits + 3) 2^-24 sum_k |x_k W_k| + 2^-24 (|bias| + |ref|); (3) the
output's rounding to x's dtype: eps (|ref| + the rest). Bitsandbytes' own bf16 forward has the same weight rounding
(its dequantize_4bit to the compute dtype) and cuBLAS's accumulation: the kernel is held to what it does.
"""
import copy
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.kernels.nf4_linear import GPU_TILES
from fastgrpo.ops import nf4_linear as ops
from fastgrpo.ops.nf4_linear import dequantize_nf4, nf4_linear, nf4_linear_torch, nf4_weight
from tests.error_bounds import assert_within
from tests.graph_replay import assert_replays_exactly
from tests.sm90_compile import sm90_compile_output

bnb_functional = pytest.importorskip("bitsandbytes.functional")
U32 = 2.0**-24


def quantized(g, N, K, dtype=torch.bfloat16, blocksize=64, nested=False, device="cpu"):
    """A random weight [N, K] with rows of different scales, quantized by bitsandbytes: (packed, quant_state)."""
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 0.1
    return bnb_functional.quantize_4bit(w.to(dtype).to(device), blocksize=blocksize, compress_statistics=nested,
                                        quant_type="nf4")


def inputs(g, M, N, dtype, with_bias=True, K=None, device="cpu"):
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    bias = torch.randn(N, generator=g).to(dtype).to(device) if with_bias else None
    return x, bias


def reference(x, packed, state, bias):
    """bitsandbytes' dequantize_4bit in fp32, then fp64: x W32^T + bias."""
    fp32 = copy.copy(state)
    fp32.dtype = torch.float32
    w32 = bnb_functional.dequantize_4bit(packed, fp32, quant_type="nf4")
    y = x.double() @ w32.double().T
    return (y if bias is None else y + bias.double()), w32


def bound(ref, w32, x, bias, dtype, splits):
    """Per-element error bound of the kernel's [M, N] output vs the fp64 `ref` (module docstring)."""
    K = x.shape[-1]
    sum_abs = x.double().abs() @ w32.double().abs().T
    eps = torch.finfo(dtype).eps
    eps_w = 0.0 if dtype == torch.float32 else eps
    fp32 = U32 * ((K + splits + 3) * (1 + eps_w) * sum_abs + ref.abs()
                  + (0.0 if bias is None else bias.double().abs()))
    return eps_w * sum_abs + eps * (ref.abs() + fp32 + eps_w * sum_abs) + fp32 + torch.finfo(dtype).tiny


# ---- the format ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_is_bitsandbytes_bit_for_bit(nested, blocksize, dtype):
    """dequantize_nf4 (the op's CPU path and the kernel's formula) equals bitsandbytes' dequantize_4bit exactly, in
    the quantized dtype; 80 x 256 weights have 320 blocks of 64, so the nested absmax span two blocks of 256."""
    g = torch.Generator().manual_seed(blocksize + nested)
    packed, state = quantized(g, 80, 256, dtype, blocksize, nested)
    assert packed.shape == (80 * 256 // 2, 1) and packed.dtype == torch.uint8 and state.nested == nested
    want = bnb_functional.dequantize_4bit(packed, state, quant_type="nf4")
    got = dequantize_nf4(nf4_weight(packed, state), dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_nibble_order_matters():
    """The reference would catch the other nibble order (the check above is not vacuous)."""
    g = torch.Generator().manual_seed(0)
    packed, state = quantized(g, 8, 64)
    w = nf4_weight(packed, state)
    swapped = w._replace(packed=(w.packed << 4) | (w.packed >> 4))
    assert not torch.equal(dequantize_nf4(swapped, torch.bfloat16), dequantize_nf4(w, torch.bfloat16))


# ---- the kernel (Triton interpreter on the CPU) ----------------------------------------------------------------

@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_kernel_reads_the_format_exactly(nested, blocksize):
    """fp32 x = the identity: y = W^T with no rounding at all (fp32 dots of one nonzero product each), so the
    kernel's dequantized weight is bitsandbytes' fp32 one bit for bit, over several tiles and splits."""
    g = torch.Generator().manual_seed(blocksize)
    # 160 rows x 2 blocks: 320 blocks, so nested absmax span two of their 256-block scales
    packed, state = quantized(g, 160, 2 * blocksize, torch.float32, blocksize, nested)
    got = nf4_linear(torch.eye(2 * blocksize), packed, state)
    assert torch.equal(got.T, bnb_functional.dequantize_4bit(packed, state, quant_type="nf4"))


@given(M=st.integers(1, 19), N=st.integers(1, 40), blocks=st.integers(1, 3), blocksize=st.sampled_from([64, 128]),
       nested=st.booleans(), with_bias=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       seed=st.integers(0, 2**16))
def test_kernel_matches_fp64_reference(M, N, blocks, blocksize, nested, with_bias, dtype, seed):
    """Default interpreter tiles (16 x 16, one block per K step, up to 3 splits) on odd M and N, K = 1-3 blocks."""
    from fastgrpo.kernels.nf4_linear import default_config

    g = torch.Generator().manual_seed(seed)
    K = blocks * blocksize
    packed, state = quantized(g, N, K, dtype, blocksize, nested)
    x, bias = inputs(g, M, N, dtype, with_bias, K)
    got = nf4_linear(x, packed, state, bias)
    ref, w32 = reference(x, packed, state, bias)
    splits = default_config(M, N, K, blocksize, torch.device("cpu")).split_k
    assert got.dtype == dtype and got.shape == (M, N)
    assert_within(got, ref, bound(ref, w32, x, bias, dtype, splits), f"{dtype} M{M} N{N} K{K} bs{blocksize}")


@pytest.mark.parametrize("split_k, blocks_per_step", [(1, 1), (2, 2), (3, 1), (5, 2)])
@pytest.mark.parametrize("nested", [False, True])
def test_kernel_splits(split_k, blocks_per_step, nested):
    """K = 3 blocks: 2-block K steps leave a ragged last step (EVEN_K off); 5 splits asked of 3 blocks give 3.
    Within the bound, bitwise the same twice, and the tickets are all back to 0."""
    from fastgrpo.kernels.fp8_linear import Fp8LinearConfig, _counters
    from fastgrpo.kernels.nf4_linear import nf4_linear_fwd

    g = torch.Generator().manual_seed(split_k)
    packed, state = quantized(g, 33, 192, nested=nested)
    x, bias = inputs(g, 9, 33, torch.bfloat16, K=192)
    w = nf4_weight(packed, state)
    config = Fp8LinearConfig(block_m=16, block_n=16, block_k=64 * blocks_per_step, split_k=split_k)

    def call():
        return nf4_linear_fwd(x, w.packed, w.absmax, w.code, w.absmax_code, w.absmax_scale, w.offset, bias,
                              w.N, w.blocksize, w.nested_blocksize, config)

    got = call()
    ref, w32 = reference(x, packed, state, bias)
    assert_within(got, ref, bound(ref, w32, x, bias, torch.bfloat16, min(split_k, 3)), f"split {split_k}")
    assert torch.equal(call(), got)
    assert not _counters(torch.device("cpu")).any()


def test_bound_catches_a_wrong_block():
    """The bound is tight enough to fail a kernel that scales by the neighbouring block's absmax."""
    g = torch.Generator().manual_seed(0)
    packed, state = quantized(g, 16, 128)
    x, bias = inputs(g, 4, 16, torch.bfloat16, K=128)
    ref, w32 = reference(x, packed, state, bias)
    w = nf4_weight(packed, state)
    wrong = nf4_linear_torch(x, w._replace(absmax=w.absmax.roll(1)), bias)
    assert ((wrong.double() - ref).abs() > bound(ref, w32, x, bias, torch.bfloat16, 1)).any()


HOPPER_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastgrpo.kernels.nf4_linear import GPU_TILES as t, _nf4_linear_kernel as fn
sig = {"X": "*bf16", "PACKED": "*u8", "ABSMAX": "*u8", "CODE": "*fp32", "ABSMAX_CODE": "*fp32",
       "ABSMAX_SCALE": "*fp32", "OFFSET": "*fp32", "BIAS": "*bf16", "Y": "*bf16", "PARTIAL": "*fp32",
       "COUNTS": "*i32", **{a: "i32" for a in fn.arg_names[11:18]}, **{a: "constexpr" for a in fn.arg_names[18:]}}
attrs = {(i,): [["tt.divisibility", 16]] for i in range(18)}  # what a launch on aligned decode shapes specializes
for split in (True, False):
    consts = dict(HAS_BIAS=True, NESTED=True, SPLIT=split, EVEN_K=True, FP32_DOT=False, BLOCKSIZE=64,
                  NESTED_BLOCKSIZE=256, BLOCK_M=64, BLOCK_N=t["block_n"], BLOCK_K=t["block_k"])
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": t["num_warps"], "num_stages": t["num_stages"],
                                     "enable_fp_fusion": False})
    print(split, "warp_group_dot" in kernel.asm["ttgir"], kernel.asm["ptx"].count("fma.rn.f32"),
          kernel.metadata.shared, kernel.asm["ptx"].count("cp.async"))
"""


def test_compiles_for_hopper():
    """The default GPU config compiles for sm_90 on the CPU (Triton's own ptxas, no GPU): wgmma, no fused
    multiply-add (the nested absmax' product and sum rounded apart, as bitsandbytes does: with fusion on, the PTX
    has 8), shared memory for GPU_TILES' programs per SM, no cp.async. CI never sees a GPU: this catches what the
    interpreter accepts and the compiler does not."""
    for line in sm90_compile_output(HOPPER_CHECK).split("\n")[:2]:
        _, wgmma, fmas, shared, async_copies = line.split()
        assert wgmma == "True" and fmas == "0" and int(shared) <= 228 * 1024 // GPU_TILES["programs_per_sm"], line
        assert async_copies == "0", line  # pipelined, the code-table gathers became 4-byte cp.async: 6x slower


# ---- the op ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_path_is_bitsandbytes_forward(monkeypatch, nested, dtype):
    """Without Triton the op computes what bitsandbytes' Linear4bit forward does on the CPU, bit for bit (its
    default backend: dequantize_4bit to the compute dtype, F.linear)."""
    import bitsandbytes as bnb

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(0)
    dense = torch.nn.Linear(128, 24, dtype=dtype)
    layer = bnb.nn.Linear4bit(128, 24, compute_dtype=dtype, quant_type="nf4", compress_statistics=nested,
                              device="meta")
    layer.support_avx512bf16_for_cpu = False  # bitsandbytes' repacked CPU layout: a different format
    layer.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, quant_type="nf4",
                                     compress_statistics=nested).to("cpu")
    layer.bias = dense.bias
    x = torch.randn(5, 3, 128, dtype=dtype)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = layer(x)
    got = nf4_linear(x, layer.weight, layer.weight.quant_state, layer.bias)
    assert got.shape == (5, 3, 24) and torch.equal(got, want)


def test_op_leading_dims_and_strides():
    """[N, 1, K] decode-step inputs and a non-contiguous x give the 2-D results, reshaped."""
    g = torch.Generator().manual_seed(0)
    packed, state = quantized(g, 24, 64)
    x, bias = inputs(g, 6, 24, torch.bfloat16, K=64)
    flat = nf4_linear(x, packed, state, bias)
    assert torch.equal(nf4_linear(x[:, None], packed, state, bias), flat[:, None])
    wide = torch.cat([x, x], 1)[:, ::2]  # stride 2 along K
    assert torch.equal(nf4_linear(wide, packed, state, bias), nf4_linear(wide.contiguous(), packed, state, bias))


def test_op_refusals():
    """One ValueError naming the reason: K not a multiple of the blocksize (blocks would straddle rows; the engine
    keeps such layers on bitsandbytes' forward), FP4, bitsandbytes' repacked CPU layout, a wrong x or bias."""
    g = torch.Generator().manual_seed(0)
    packed, state = quantized(g, 8, 96)  # 768 elements: 12 blocks of 64 across rows of 96
    with pytest.raises(ValueError, match="K=96 is not a multiple of blocksize 64"):
        nf4_linear(torch.randn(2, 96), packed, state)
    packed, state = bnb_functional.quantize_4bit(torch.randn(8, 64), quant_type="fp4")
    with pytest.raises(ValueError, match="'fp4' is not 'nf4'"):
        nf4_linear(torch.randn(2, 64), packed, state)
    packed, state = quantized(g, 8, 64)
    state.packing_format_for_cpu = True
    with pytest.raises(ValueError, match="repacked"):
        nf4_linear(torch.randn(2, 64), packed, state)
    state.packing_format_for_cpu = False
    with pytest.raises(ValueError, match="x"):
        nf4_linear(torch.randn(2, 63), packed, state)
    with pytest.raises(ValueError, match="x"):
        nf4_linear(torch.randn(2, 64).double(), packed, state)
    with pytest.raises(ValueError, match="bias"):
        nf4_linear(torch.randn(2, 64), packed, state, torch.zeros(7))


# ---- GPU -------------------------------------------------------------------------------------------------------

# (M, N, K): the decode GEMMs of 64 rows of Llama-3.1-8B (q/o, k/v, gate/up, down) and odd ones (M < 16, N ragged)
GPU_SHAPES = [(64, 4096, 4096), (64, 1024, 4096), (64, 14336, 4096), (64, 4096, 14336), (37, 1000, 1536),
              (3, 300, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("M, N, K", GPU_SHAPES)
def test_gpu_matches_fp64_and_bitsandbytes(M, N, K, nested):
    """bf16 within the bound, no worse than bitsandbytes' own bf16 forward (plus an ulp), bitwise the same on a
    second call; a bf16 identity gives bitsandbytes' bf16-rounded weight exactly (round to nearest here)."""
    from fastgrpo.kernels.nf4_linear import default_config

    g = torch.Generator().manual_seed(0)
    packed, state = quantized(g, N, K, nested=nested, device="cuda")
    x, bias = inputs(g, M, N, torch.bfloat16, K=K, device="cuda")
    got = nf4_linear(x, packed, state, bias)
    ref, w32 = reference(x, packed, state, bias)
    splits = default_config(M, N, K, 64, x.device).split_k
    assert_within(got, ref, bound(ref, w32, x, bias, torch.bfloat16, splits), f"gpu M{M} N{N} K{K}")
    own = bnb_functional.dequantize_4bit(packed, state, quant_type="nf4")
    theirs = torch.nn.functional.linear(x, own, bias)
    eps = torch.finfo(torch.bfloat16).eps
    assert (got.double() - ref).abs().max() <= (theirs.double() - ref).abs().max() + eps * ref.abs().max()
    assert torch.equal(nf4_linear(x, packed, state, bias), got)
    if K <= 4096:
        eye = torch.eye(K, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(nf4_linear(eye, packed, state).T, own)


@pytest.mark.gpu
def test_gpu_compiled_and_graphed():
    """In a torch.compile'd function replayed as a CUDA graph (the decode step's setting) the op gives its eager
    bits, replay after replay (the split-K tickets reset themselves)."""
    g = torch.Generator().manual_seed(0)
    packed, state = quantized(g, 4096, 4096, nested=True, device="cuda")
    x, bias = inputs(g, 64, 4096, torch.bfloat16, K=4096, device="cuda")
    ops.prepare_nf4_linear(x.device)
    w = nf4_weight(packed, state)
    want = ops.nf4_linear_unpacked(x, w, bias)
    assert_replays_exactly(lambda t: ops.nf4_linear_unpacked(t, w, bias).relu(), x, want.relu())
