"""RMSNorm + gate/up GEMM + SiLU / GeGLU in one kernel (fastgrpo.ops.decode_glu): the kernel on the folded weights
against an fp64 reference on the unfolded ones (Hugging Face's RMSNorm math, the two GEMMs, the activation) over odd
shapes, tiles and splits crossing edges, both activations, fp32 and bf16; its split-K tickets; the fold; the op's
checks and torch path; the sm_90 compile; on a GPU, the decode shapes of Qwen2.5-1.5B and Llama-3.1-8B.

Tolerance, derived per element (`bound`) from x, W, the norm weight w and the offset (exact in fp64), s = offset + w,
G = r x (W_g s)^T and U = r x (W_u s)^T the exact pre-activations, A_g, A_u = r |x| |W s|^T their sums of magnitudes:
(1) the folded weight's rounding to its dtype (u_w; plus 2^-24 each for the fp32 product and offset + w) and the fp32
    sums over K (K + splits + 2 roundings of 2^-24, products of 16-bit values exact): per_sum A;
(2) r's relative error (the fp32 sum of squares, the mean, eps, rsqrt): rho = ((K + splits) / 2 + 12) 2^-24, so
    |G~ - G| <= e_G = per_sum A_g (1 + rho) + rho |G|, and U's alike;
(3) the activation: Lipschitz with L = 1.13 (silu' <= 1.0998, gelu_tanh' <= 1.129) in G's error, evaluated in fp32
    (an exp whose argument ~ |G| + |G|^3 carries 2^-24 of it: (16 + 8 |G| + |G|^3) 2^-24 relative), times U~, one
    more rounding;
(4) the output's rounding to x's dtype: one ulp of it (eps: the interpreter truncates where a GPU rounds).
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.loss import reference
from fastgrpo.ops.decode_glu import decode_glu, decode_glu_torch, fold_norm_weight
from tests.error_bounds import assert_within
from tests.graph_replay import assert_replays_exactly
from tests.sm90_compile import sm90_compile_output

U32 = 2.0**-24
LIPSCHITZ = 1.13
ACTS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
EPS = 1e-6


def make(g, M, N, K, dtype, offset=0.0, device="cpu"):
    """x [M, K] (rows of different scales), gate_w and up_w [N, K] (rows of different scales), the norm weight [K]
    (offset + w around 1)."""
    x = torch.randn(M, K, generator=g) * (0.1 + 3 * torch.rand(M, 1, generator=g))
    gate_w, up_w = (torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 2 / K**0.5 for _ in range(2))
    norm_w = 1 - offset + 0.2 * torch.randn(K, generator=g)
    return [t.to(dtype).to(device) for t in (x, gate_w, up_w, norm_w)]


def exact(x, gate_w, up_w, norm_w, offset=0.0):
    """fp64 from the same inputs, unfolded: G, U (the RMSNorm's output, Hugging Face's math, times each weight) and
    A_g, A_u (their sums of magnitudes, for the bound)."""
    x64, s = x.double(), offset + norm_w.double()
    xn = reference.rms_norm(x64, norm_w.double(), EPS, offset)
    r = torch.rsqrt(x64.square().mean(-1, keepdim=True) + EPS)
    G, U = xn @ gate_w.double().T, xn @ up_w.double().T
    A_g, A_u = (r * (x64.abs() @ (w.double() * s).abs().T) for w in (gate_w, up_w))
    return G, U, A_g, A_u


def glu_of(G, U, activation):
    return ACTS[activation](G) * U


def bound(G, U, A_g, A_u, activation, K, dtype, splits):
    """Per-element error bound of the kernel's [M, N] output against glu_of(G, U) (module docstring)."""
    rho = ((K + splits) / 2 + 12) * U32
    per_sum = torch.finfo(dtype).eps / 2 + 2 * U32 + (K + splits + 2) * U32
    e_g = per_sum * A_g * (1 + rho) + rho * G.abs()
    e_u = per_sum * A_u * (1 + rho) + rho * U.abs()
    act = ACTS[activation](G).abs()
    act_err = LIPSCHITZ * e_g + (16 + 8 * G.abs() + G.abs() ** 3) * U32 * (act + LIPSCHITZ * e_g)
    ref = act * U.abs()
    pre = act_err * (U.abs() + e_u) + act * e_u
    pre = pre + U32 * (ref + pre)
    return torch.finfo(dtype).eps * (ref + pre) + pre + torch.finfo(dtype).tiny


def check(got, x, gate_w, up_w, norm_w, activation, offset, splits, what):
    G, U, A_g, A_u = exact(x, gate_w, up_w, norm_w, offset)
    tol = bound(G, U, A_g, A_u, activation, x.shape[-1], x.dtype, splits)
    assert got.dtype == x.dtype and got.shape == G.shape
    assert_within(got, glu_of(G, U, activation), tol, what)


# ---- the kernel (Triton interpreter on the CPU) ----------------------------------------------------------------

@given(M=st.integers(1, 34), N=st.integers(1, 34), K=st.integers(1, 80),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), activation=st.sampled_from(list(ACTS)),
       offset=st.sampled_from([0.0, 1.0]), block_m=st.sampled_from([16, 32]), block_n=st.sampled_from([16, 32]),
       block_k=st.sampled_from([16, 32]), split_k=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_kernel_matches_fp64_reference(M, N, K, dtype, activation, offset, block_m, block_n, block_k, split_k, seed):
    """Row and feature tiles crossing M and N, ragged K steps and splits (asked 4 of K = 20: 2), both activations,
    Gemma's offset: within the bound of the unfolded fp64 reference."""
    from fastgrpo.kernels.decode_glu import decode_glu_fwd
    from fastgrpo.kernels.fp8_linear import Fp8LinearConfig

    x, gate_w, up_w, norm_w = make(torch.Generator().manual_seed(seed), M, N, K, dtype, offset)
    config = Fp8LinearConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k)
    got = decode_glu_fwd(x, fold_norm_weight(gate_w, up_w, norm_w, offset), EPS, activation, config)
    check(got, x, gate_w, up_w, norm_w, activation, offset, split_k, f"{dtype} {activation} M{M} N{N} K{K} {config}")


@pytest.mark.parametrize("shape, K", [((5,), 48), ((3, 1), 100), ((2, 7), 33)])
def test_op_default_tiles_and_leading_dims(shape, K):
    """Through the op: x [..., K] (a decode step's [B, 1, K]) at the interpreter's default tiles (16 wide, 3
    splits), bf16, the same bits as the flattened rows."""
    from fastgrpo.kernels.decode_glu import default_config

    rows = torch.Size(shape).numel()
    x, gate_w, up_w, norm_w = make(torch.Generator().manual_seed(K), rows, 20, K, torch.bfloat16)
    x = x.reshape(*shape, K)
    w_gu = fold_norm_weight(gate_w, up_w, norm_w)
    got = decode_glu(x, w_gu, EPS)
    assert got.shape == (*shape, 20)
    assert torch.equal(got.reshape(-1, 20), decode_glu(x.reshape(-1, K), w_gu, EPS))
    splits = default_config(rows, 20, K, torch.device("cpu")).split_k
    check(got.reshape(-1, 20), x.reshape(-1, K), gate_w, up_w, norm_w, "silu", 0.0, splits, f"{shape} K{K}")


def test_tickets_are_zero_after_a_launch_and_bits_repeat():
    """Split-K over several tiles: the counters are all back to 0 after the launch, and a second launch gives the same
    bits (the last ticket sums the partials in split order)."""
    from fastgrpo.kernels.decode_glu import decode_glu_fwd
    from fastgrpo.kernels.fp8_linear import Fp8LinearConfig, _counters

    x, gate_w, up_w, norm_w = make(torch.Generator().manual_seed(3), 19, 40, 100, torch.bfloat16)
    w_gu = fold_norm_weight(gate_w, up_w, norm_w)
    config = Fp8LinearConfig(block_m=16, block_n=16, block_k=16, split_k=4)
    got = decode_glu_fwd(x, w_gu, EPS, "gelu_tanh", config)
    assert not _counters(torch.device("cpu")).any()
    assert torch.equal(decode_glu_fwd(x, w_gu, EPS, "gelu_tanh", config), got)
    check(got, x, gate_w, up_w, norm_w, "gelu_tanh", 0.0, 4, "split 4")


def test_bound_catches_a_missing_norm_weight_and_a_one_split_norm():
    """The bound is tight enough to fail a fold without the norm weight, and a norm whose sum of squares covers one
    split's K range only (the partial sums of squares never summed)."""
    x, gate_w, up_w, norm_w = make(torch.Generator().manual_seed(0), 6, 24, 96, torch.bfloat16)
    G, U, A_g, A_u = exact(x, gate_w, up_w, norm_w)
    tol = bound(G, U, A_g, A_u, "silu", 96, torch.bfloat16, 3)
    want = glu_of(G, U, "silu")
    unfolded = decode_glu(x, torch.cat([gate_w, up_w]), EPS)
    assert ((unfolded.double() - want).abs() > tol).any()
    x64 = x.double()
    one_split = torch.rsqrt(x64[:, :32].square().sum(-1, keepdim=True) / 96 + EPS)
    ratio = one_split / torch.rsqrt(x64.square().mean(-1, keepdim=True) + EPS)
    assert ((glu_of(G * ratio, U * ratio, "silu") - want).abs() > tol).any()


# ---- the fold, the op's torch path and checks --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fold_norm_weight_rounds_once(dtype, offset):
    """[gate; up] (offset + w) in the weights' dtype: with offset 0 the exact product rounded once (the same bits as
    fp64's, rounded), with Gemma's 1 + w (fp32, as Hugging Face computes it) within a rounding of the exact one."""
    x, gate_w, up_w, norm_w = make(torch.Generator().manual_seed(0), 1, 9, 21, dtype, offset)
    w_gu = fold_norm_weight(gate_w, up_w, norm_w, offset)
    exact_fold = torch.cat([gate_w, up_w]).double() * (offset + norm_w.double())
    assert w_gu.dtype == dtype and w_gu.shape == (18, 21) and w_gu.is_contiguous()
    if offset == 0.0:
        assert torch.equal(w_gu, exact_fold.to(dtype))
    tol = (torch.finfo(dtype).eps / 2 + 2 * U32) * exact_fold.abs() + torch.finfo(dtype).tiny
    assert ((w_gu.double() - exact_fold).abs() <= tol).all()


def test_op_torch_path_without_interpreter(monkeypatch):
    """Off CUDA and the interpreter: decode_glu_torch, within the kernel's bound too."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, gate_w, up_w, norm_w = make(torch.Generator().manual_seed(0), 5, 12, 40, torch.float32, 1.0)
    w_gu = fold_norm_weight(gate_w, up_w, norm_w, 1.0)
    got = decode_glu(x, w_gu, EPS, "gelu_tanh")
    assert torch.equal(got, decode_glu_torch(x, w_gu, EPS, "gelu_tanh"))
    check(got, x, gate_w, up_w, norm_w, "gelu_tanh", 1.0, 1, "torch path")


def test_op_bad_input():
    x, gate_w, up_w, norm_w = make(torch.Generator().manual_seed(0), 2, 8, 16, torch.float32)
    w_gu = fold_norm_weight(gate_w, up_w, norm_w)
    cases = [((x.double(), w_gu, EPS), r"x: expected dtype in \(float16, bfloat16, float32\), got float64"),
             ((x[:, :15], w_gu, EPS), r"w_gu: expected shape \[\*, 15\], got \[16, 16\]"),
             ((x, w_gu.bfloat16(), EPS), r"w_gu: expected dtype in \(float32\), got bfloat16"),
             ((x, w_gu[:15], EPS), r"w_gu: expected gate's rows then as many of up's \(an even count\), got 15"),
             ((x, w_gu, -1.0), r"eps: expected a number >= 0, got -1.0"),
             ((x, w_gu, EPS, "relu"), r"activation: expected one of \['silu', 'gelu_tanh'\], got 'relu'")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            decode_glu(*args)
    with pytest.raises(ValueError, match=r"up_w: expected the shape of gate_w \[8, 16\], got \[7, 16\]"):
        fold_norm_weight(gate_w, up_w[:7], norm_w)
    with pytest.raises(ValueError, match=r"norm_weight: expected shape \[16\], got \[15\]"):
        fold_norm_weight(gate_w, up_w, norm_w[:15])
    with pytest.raises(ValueError, match=r"up_w: expected dtype in \(float32\), got bfloat16"):
        fold_norm_weight(gate_w, up_w.bfloat16(), norm_w)


HOPPER_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastgrpo.kernels.decode_glu import GPU_TILES as t, _decode_glu_kernel as fn
pointers = {"X": "*bf16", "W": "*bf16", "H": "*bf16", "PARTIAL": "*fp32", "SUMSQ": "*fp32", "COUNTS": "*i32"}
aligned = ("stride_xm", "stride_wn", "stride_hm", "M", "N", "K", "k_per_split")  # as a launch specializes them
for block_m in (32, 64, 128):  # the decode step's 32-128 rows
    for split in (False, True):
        consts = dict(ACT=0, SPLIT=split, EVEN_K=True, FP32_DOT=False, BLOCK_M=block_m, BLOCK_N=t["block_n"],
                      BLOCK_K=t["block_k"])
        sig = {a: "constexpr" if a in consts else pointers.get(a, "fp32" if a == "eps" else "i32")
               for a in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in pointers or a in aligned}
        kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": t["num_warps"], "num_stages": t["num_stages"]})
        ir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
        print(block_m, split, "warp_group_dot" in ir, ptx.count("wgmma.mma_async"), ptx.count("mma.sync"),
              ir.count("async_copy_global_to_local"), kernel.metadata.shared, t["num_stages"], t["programs_per_sm"])
"""


def test_compiles_for_hopper():
    """GPU_TILES compile for sm_90 on the CPU (Triton's own ptxas, no GPU) at 32, 64 and 128 rows, with and without
    splits: both bf16 dots are wgmma (no mma.sync), the three loads (gate's, up's and x's tiles) pipelined with
    cp.async in every stage, in the shared memory of the programs per SM the splits plan for on an H100 / H200."""
    out = sm90_compile_output(HOPPER_CHECK)
    lines = out.strip().split("\n")
    assert len(lines) == 6, out
    for line in lines:
        block_m, split, wgmma_ir, wgmma, mma, copies, shared, stages, per_sm = line.split()
        assert wgmma_ir == "True" and int(wgmma) > 0 and int(mma) == 0, line
        assert int(copies) == 3 * int(stages) and int(shared) <= 228 * 1024 // int(per_sm), line


# ---- the benchmark's dry run ------------------------------------------------------------------------------------

def test_bench_dry_run_times_each_path_and_the_sweep(capsys, tmp_path, monkeypatch):
    """benchmarks/bench_decode_glu.py --dry-run --sweep on the CPU (the kernel under the interpreter): today's path,
    the kernel and the GEMM alone at each row count, then the sweep's configs; the kernel's error against fp64
    within a bf16 ulp of the largest output; no results file in RESULTS_DIR."""
    from benchmarks import bench_decode_glu as bench
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    bench.main(["--dry-run", "--sweep", "--rows", "5"])
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("tiny")]
    swept, table = lines[:-3], lines[-3:]
    assert [line[2] for line in table] == ["today", "decode_glu", "gemm"], lines
    assert len(swept) == 3 and all(line[-1] == "-" for line in swept), swept  # three configs, no error
    errors = [float(table[1][7])] + [float(line[5]) for line in swept]
    assert all(0 < err <= torch.finfo(torch.bfloat16).eps for err in errors), lines
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, message", [(["--shapes", "nope"], "--shapes: unknown ['nope']"),
                                           (["--rows", "0"], "--rows: expected positive integers")])
def test_bench_refuses_unknown_names_before_running(args, message, capsys, tmp_path, monkeypatch):
    from benchmarks import bench_decode_glu as bench
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    with pytest.raises(SystemExit) as done:
        bench.main(args)
    assert done.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ---- GPU -------------------------------------------------------------------------------------------------------

# (M, N, K): Qwen2.5-1.5B's and Llama-3.1-8B's gate/up at 64 rows, 128 rows (the largest tile), odd ones with splits
GPU_SHAPES = [(64, 8960, 1536), (64, 14336, 4096), (128, 8960, 1536), (37, 1000, 1000), (3, 300, 2000)]


def eager_error(x, gate_w, up_w, norm_w, activation, want):
    """Max |error| of today's path in x's dtype: Hugging Face's RMSNorm (rounded to x's dtype, then times w), cuBLAS
    over the stacked weights, the activation's product (Inductor's: in fp32, rounded once)."""
    h = x.float()
    xn = norm_w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    g, u = F.linear(xn, torch.cat([gate_w, up_w])).float().chunk(2, dim=-1)
    return (glu_of(g, u, activation).to(x.dtype).double() - want).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K", GPU_SHAPES)
@pytest.mark.parametrize("activation", list(ACTS))
def test_gpu_matches_fp64_and_the_eager_path(M, N, K, activation):
    """bf16 within the bound, no worse than today's path (plus an ulp of the largest output), bitwise the same on a
    second call."""
    from fastgrpo.kernels.decode_glu import default_config

    x, gate_w, up_w, norm_w = make(torch.Generator().manual_seed(0), M, N, K, torch.bfloat16, device="cuda")
    w_gu = fold_norm_weight(gate_w, up_w, norm_w)
    got = decode_glu(x, w_gu, EPS, activation)
    splits = default_config(M, N, K, x.device).split_k
    check(got, x, gate_w, up_w, norm_w, activation, 0.0, splits, f"gpu {activation} M{M} N{N} K{K}")
    want = glu_of(*exact(x, gate_w, up_w, norm_w)[:2], activation)
    eps = torch.finfo(torch.bfloat16).eps
    err = (got.double() - want).abs().max()
    assert err <= eager_error(x, gate_w, up_w, norm_w, activation, want) + eps * want.abs().max(), err
    assert torch.equal(decode_glu(x, w_gu, EPS, activation), got)


@pytest.mark.gpu
def test_gpu_compiled_and_graphed():
    """In a torch.compile'd function replayed as a CUDA graph (the decode step's setting) the op gives its eager
    bits, replay after replay (the split-K tickets reset themselves: N 2048 takes several splits a tile)."""
    x, gate_w, up_w, norm_w = make(torch.Generator().manual_seed(0), 64, 2048, 4096, torch.bfloat16, device="cuda")
    w_gu = fold_norm_weight(gate_w, up_w, norm_w)
    want = decode_glu(x, w_gu, EPS)
    assert_replays_exactly(lambda t: decode_glu(t, w_gu, EPS).relu(), x, want.relu())
