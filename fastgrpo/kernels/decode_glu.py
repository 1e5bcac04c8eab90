"""A decode step's gated MLP input in one kernel: h = act(r g) * (r u), g = x Wg'^T, u = x Wu'^T, r = rsqrt(mean x^2
+ eps): RMSNorm, the stacked gate/up GEMM and the SiLU (or GeGLU) product, for the few rows of a decode step.

Why: a decode step of 64 rows runs RMSNorm (an Inductor kernel), gate/up (one cuBLAS GEMM over the stacked copy)
and SiLU(gate) * up (another Inductor kernel) per layer: three CUDA graph nodes, two of them small kernels, and the
GEMM's [M, 2N] output written and read back (benchmarks/NOTES_rollout.md: ~0.27 ms a step of small kernels and
~0.27 ms idle between nodes on Qwen2.5-1.5B). The norm factors out of the GEMM: norm(x) W^T = r[m] (x (W
diag(w_norm))^T), so with the norm weight folded into the copy of the weights (ops/decode_glu.py's
fold_norm_weight), the kernel needs only each row's sum of squares, which it accumulates from the x tiles its K loop
loads for the GEMM anyway, and applies r and the activation in the epilogue.

Layout: x [M, K] (unit stride along K), W [2N, K] (gate rows then up rows, norm weight folded in, unit stride along
K), h [M, N] in x's dtype. As in kernels/fp8_linear.py (program_tile): one program computes a BLOCK_N x BLOCK_M
tile of h^T over one split of K, the weight tiles as the MMA's left operand (BLOCK_N features on its long side) and
x^T as the right; here two weight tiles per K step (the same BLOCK_N features of gate and of up: two accumulators)
and the partial sum of squares of its K range ([BLOCK_M], fp32). On a GPU one row tile covers up to MAX_BLOCK_M
rows, so each weight is read from memory once per call (two row tiles would read it twice: gate/up of Qwen2.5-1.5B
is 55 MB, past the L2).

Split-K without a second kernel, fp8_linear's pattern (split_k_total) for three sums: each (tile, split) program
writes its gate and up partials and its sum of squares to workspaces, then takes a ticket from the tile's counter
(acq_rel); the last ticket sums the three in split order (the same bits whichever split arrives last), applies r
and the activation, writes h and resets the counter, so the counters (fp8_linear's, shared by every launch on the
device) are zero again between launches. Under TRITON_INTERPRET tl.dot runs in fp32 (Triton 3.9's interpreter
returns garbage for bf16 tl.dot, shared/DESIGN.md); fp32 inputs use "ieee" dots on a GPU too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastgrpo.kernels.cards import sm_count
from fastgrpo.kernels.fp8_linear import Fp8LinearConfig, _counters, _interpreting, config_for, program_tile, split_plan
from fastgrpo.kernels.swiglu import ACTIVATIONS, _act_and_grad

MAX_BLOCK_M = 128  # rows of one tile on a GPU: a decode step's 32-128 rows read each weight once
# fp8_linear's GPU_TILES with half its K step. Two bf16 weight tiles a stage (gate's and up's) besides x's: at 128
# of K, 3 stages take 128 KB of shared memory at 64 rows (as Triton 3.9 compiles them for sm_90), one program per
# SM; at 64 of K, 64 KB (80 KB at 128 rows, within an Ada card's 99 KB), two per SM as the splits plan. Swept on an
# H200 at 64 rows (72 configs, benchmarks/NOTES_rollout.md, thirty-third session): the fastest for both gate/up
# shapes has these tiles with 4 stages (3-6% faster, but 107 KB at 128 rows: past Ada's); split-K 2 and 32-feature
# tiles were 30-140% slower.
GPU_TILES = dict(block_n=64, block_k=64, programs_per_sm=2, num_warps=4, num_stages=3)


@triton.jit
def _decode_glu_kernel(
    X, W, H, PARTIAL, SUMSQ, COUNTS,
    stride_xm, stride_wn, stride_hm,
    M, N, K, k_per_split, splits, eps,
    ACT: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile, split, feats, rows = program_tile(tl.program_id(0), splits, N, BLOCK_M, BLOCK_N)
    feat_ok = feats < N
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    wg_ptrs = W + feats[:, None].to(tl.int64) * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K] of gate
    wu_ptrs = W + (feats[:, None].to(tl.int64) + N) * stride_wn + ks[None, :]  # the same features of up
    x_ptrs = X + rows[None, :].to(tl.int64) * stride_xm + ks[:, None]  # [BLOCK_K, BLOCK_M]: x^T
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    sumsq = tl.zeros([BLOCK_M], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:  # no mask along the contiguous dimension: loads stay vectorized
            wg = tl.load(wg_ptrs + k, mask=feat_ok[:, None], other=0.0)
            wu = tl.load(wu_ptrs + k, mask=feat_ok[:, None], other=0.0)
            x = tl.load(x_ptrs + k, mask=row_ok[None, :], other=0.0)
        else:
            k_ok = (k + ks) < k_end
            wg = tl.load(wg_ptrs + k, mask=feat_ok[:, None] & k_ok[None, :], other=0.0)
            wu = tl.load(wu_ptrs + k, mask=feat_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs + k, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=0)  # exact squares of 16-bit x, summed in fp32
        if FP32_DOT:
            acc_g += tl.dot(wg.to(tl.float32), xf, input_precision="ieee")
            acc_u += tl.dot(wu.to(tl.float32), xf, input_precision="ieee")
        else:
            acc_g += tl.dot(wg, x)
            acc_u += tl.dot(wu, x)

    h_ptrs = H + rows[None, :].to(tl.int64) * stride_hm + feats[:, None]  # h^T tile
    h_mask = feat_ok[:, None] & row_ok[None, :]
    if not SPLIT:
        _epilogue(acc_g, acc_u, sumsq, K, eps, h_ptrs, h_mask, ACT)
    else:
        g, u, s, last = _split_k_totals(acc_g, acc_u, sumsq, PARTIAL, SUMSQ, COUNTS, tile, split, splits, rows,
                                        feats, h_mask, row_ok, M, N)
        if last:
            _epilogue(g, u, s, K, eps, h_ptrs, h_mask, ACT)
            tl.atomic_xchg(COUNTS + tile, 0)


@triton.jit
def _split_k_totals(acc_g, acc_u, sumsq, PARTIAL, SUMSQ, COUNTS, tile, split, splits, rows, feats, h_mask, row_ok,
                    M, N):
    """fp8_linear's split_k_total for a program's three sums: gate's and up's partials go to PARTIAL [splits, 2, M, N]
    and the sum of squares to SUMSQ [splits, tiles, M] (fp32; each tile its own, though the tiles of a row tile compute
    the same sums: no two programs write one place); the program that takes the tile's last ticket gets (the
    three summed in split order, True), the others (their own, False). The last resets the counter after its
    epilogue."""
    part = PARTIAL + rows[None, :].to(tl.int64) * N + feats[:, None]
    up = tl.cast(M, tl.int64) * N  # up's partials, past gate's (tl.cast: M may be the constexpr 1)
    step = 2 * up  # one split's partials
    sq = SUMSQ + tile.to(tl.int64) * M + rows
    sq_step = tl.num_programs(0).to(tl.int64) // splits * M  # tiles x M: one split's sums of squares
    tl.store(part + split * step, acc_g, mask=h_mask)
    tl.store(part + split * step + up, acc_u, mask=h_mask)
    tl.store(sq + split * sq_step, sumsq, mask=row_ok)
    tl.debug_barrier()  # every thread's partials are stored before the ticket is taken (release)
    ticket = tl.atomic_add(COUNTS + tile, 1, sem="acq_rel")
    last = ticket == splits - 1
    total_g, total_u, total_sq = acc_g, acc_u, sumsq
    if last:
        total_g = tl.zeros_like(acc_g)
        total_u = tl.zeros_like(acc_u)
        total_sq = tl.zeros_like(sumsq)
        for _ in range(0, splits):
            total_g += tl.load(part, mask=h_mask, other=0.0, cache_modifier=".cg")
            total_u += tl.load(part + up, mask=h_mask, other=0.0, cache_modifier=".cg")
            total_sq += tl.load(sq, mask=row_ok, other=0.0, cache_modifier=".cg")
            part += step
            sq += sq_step
    return total_g, total_u, total_sq, last


@triton.jit
def _epilogue(acc_g, acc_u, sumsq, K, eps, h_ptrs, h_mask, ACT: tl.constexpr):
    r = tl.rsqrt(sumsq / K + eps)[None, :]  # each row's 1 / RMS, the norm's factor of both GEMMs
    act, _ = _act_and_grad(acc_g * r, ACT)
    tl.store(h_ptrs, (act * (acc_u * r)).to(h_ptrs.dtype.element_ty), mask=h_mask)


def default_config(M: int, N: int, K: int, device: torch.device) -> Fp8LinearConfig:
    """Tiles and splits for h [M, N] from x [M, K] and W [2N, K]: a function of the shape and the SM count only (no
    autotuning: the split order fixes the fp32 sums, so a given card always computes the same bits). GPU: GPU_TILES
    and config_for's splits. Interpreter: 16-wide tiles, so small test shapes cross tiles, splits and edges."""
    if device.type != "cuda":
        return Fp8LinearConfig(block_m=16, block_n=16, block_k=16, split_k=min(3, triton.cdiv(K, 16)))
    sms = sm_count(device)
    return config_for(M, N, K, sms, **GPU_TILES, max_block_m=MAX_BLOCK_M)


def decode_glu_fwd(x: torch.Tensor, w_gu: torch.Tensor, eps: float, activation: str,
                   config: Fp8LinearConfig | None = None) -> torch.Tensor:
    """x [M, K] (unit stride along K), w_gu [2N, K] of x's dtype (unit stride along K) -> h [M, N] in x's dtype."""
    M, K = x.shape
    N = w_gu.shape[0] // 2
    interpret = _interpreting(x)
    if config is None:
        config = default_config(M, N, K, torch.device("cpu") if interpret else x.device)
    k_per_split, split, tiles = split_plan("decode_glu", M, N, K, config)
    h = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if not h.numel():  # no rows or no features: nothing to launch
        return h
    if split > 1:
        partial = torch.empty(split, 2, M, N, dtype=torch.float32, device=x.device)
        sumsq = torch.empty(split, tiles, M, dtype=torch.float32, device=x.device)
    else:  # the kernel touches neither workspace: any fp32 tensor
        partial = sumsq = torch.empty(1, dtype=torch.float32, device=x.device)
    _decode_glu_kernel[(tiles * split,)](
        x, w_gu, h, partial, sumsq, _counters(x.device),
        x.stride(0), w_gu.stride(0), h.stride(0),
        M, N, K, k_per_split, split, eps,
        ACT=ACTIVATIONS.index(activation), SPLIT=split > 1, EVEN_K=K % config.block_k == 0,
        FP32_DOT=interpret or x.dtype == torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return h
