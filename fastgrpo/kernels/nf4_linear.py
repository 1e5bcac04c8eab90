"""W4A16 linear over a bitsandbytes NF4 weight for skinny GEMMs (decode steps): y = x dequant(W)^T + bias.

Why: a decode step of 64 rows is bound by reading the weights (kernels/fp8_linear.py); NF4 is half a byte per
weight, a quarter of bf16's. bitsandbytes' own forward (0.50.2, matmul_4bit -> gemm_4bit) runs a fused kernel only
for a few rows (M <= 4 always; on sm90 up to 16-64 by N) and otherwise dequantizes the whole weight to bf16 in memory
first: its Llama-3.1-8B QLoRA rollout of 64 rows ran 2.9x slower than one over a bf16 copy
(benchmarks/NOTES_rollout.md).
Here each tile is dequantized in registers and multiplied on the 16-bit tensor cores with fp32 accumulation.

The format (bitsandbytes 0.50.2, functional.quantize_4bit / dequantize_4bit, backends/default/ops.py): the weight
W [N, K] (nn.Linear's layout) is flattened row-major; element f is nibble f % 2 of byte f // 2 of the packed
uint8 tensor, the HIGH nibble first (byte = q[2i] << 4 | q[2i+1]); a nibble indexes the 16 NF4 code values
(fp32). Block b = f // blocksize of consecutive elements has one fp32 absmax, and W[f] = code[q_f] absmax[b] in
fp32, rounded once to the compute dtype. With double quantization (compress_statistics) the absmax are uint8
codes into a 256-value fp32 table, scaled per block of NESTED_BLOCKSIZE (256) of them, plus one fp32 offset:
absmax[b] = table[a_b] scale[b // 256] + offset, a product then a sum, each rounded to fp32 (no FMA: the kernel
is compiled with enable_fp_fusion=False, so its W is bitwise dequantize_4bit's).

The kernel reads the nested absmax itself rather than an fp32 absmax precomputed per rollout: fp32 absmax add
4 bytes per block of 64 weights, 12.5% on top of the 32 bytes of nibbles (a bandwidth-bound kernel pays that in
time, and an 8B model holds 0.44 GB more); the uint8 codes add 1 byte (3.1%), and the two lookups per block of
a row are nothing beside the 64 per-weight code lookups. With K a multiple of blocksize (the op checks) a block
never straddles rows, so a tile's K step of BLOCK_K (a multiple of blocksize) needs one absmax per row and block.

A block's bytes [BLOCK_N, blocksize / 2] give its even (high nibble) and odd (low) elements, interleaved in
registers (tl.join, then a reshape) into the [BLOCK_N, blocksize] tile of W that one dot multiplies with x^T's
[blocksize, BLOCK_M], loaded with unit stride along K (two half-tile dots against x's even and odd columns need no
interleave, but read x at stride 2, uncoalesced). Tiles, split-K and its tickets are kernels/fp8_linear.py's (the
same problem shape; the same per-device counters, which every launch leaves at zero). Under TRITON_INTERPRET
tl.dot runs in fp32 on W already rounded to x's dtype (Triton 3.9's interpreter returns garbage for bf16 dots,
shared/DESIGN.md); its fp32 -> bf16 conversion truncates where a GPU rounds to nearest.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastgrpo.kernels.cards import sm_count
from fastgrpo.kernels.fp8_linear import (Fp8LinearConfig, _counters, _interpreting, config_for, program_tile,
                                         split_k_total, split_plan)

# One stage: with two or more, Triton's pipeliner turns the code-table gathers into 4-byte cp.async copies, 6-10x
# slower on an H100. Four programs per SM hide the unpipelined loads' latency instead: within 9% of the best of 24
# one-stage configs on Llama-3.1-8B's shapes, M 64 (bench_fp8's nf4_sweep; benchmarks/NOTES_rollout.md).
GPU_TILES = dict(block_n=64, block_k=128, programs_per_sm=4, num_warps=4, num_stages=1)


@triton.jit
def _nf4_linear_kernel(
    X, PACKED, ABSMAX, CODE, ABSMAX_CODE, ABSMAX_SCALE, OFFSET, BIAS, Y, PARTIAL, COUNTS,
    stride_xm, stride_ym,
    M, N, K, k_per_split, splits,
    HAS_BIAS: tl.constexpr, NESTED: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    FP32_DOT: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile, split, feats, rows = program_tile(tl.program_id(0), splits, N, BLOCK_M, BLOCK_N)
    feat_ok = feats < N
    row_ok = rows < M
    half = tl.arange(0, BLOCKSIZE // 2)  # byte j of a block holds elements 2j (high nibble) and 2j + 1 (low)
    cols = tl.arange(0, BLOCKSIZE)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    w_ptrs = PACKED + feats[:, None].to(tl.int64) * (K // 2) + half[None, :]  # [BLOCK_N, BLOCKSIZE / 2] bytes
    x_ptrs = X + rows[None, :].to(tl.int64) * stride_xm + cols[:, None]  # [BLOCKSIZE, BLOCK_M]: x^T
    first_block = feats.to(tl.int64) * (K // BLOCKSIZE)  # absmax index of each row's first block
    if NESTED:
        offset = tl.load(OFFSET)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        for s in tl.static_range(BLOCK_K // BLOCKSIZE):
            kb = k + s * BLOCKSIZE  # this block's first column
            if EVEN_K:
                w_ok = feat_ok[:, None]
                x_ok = row_ok[None, :]
                a_ok = feat_ok
            else:  # a block past k_end is masked whole (blocks never straddle rows)
                w_ok = feat_ok[:, None] & ((kb + 2 * half) < k_end)[None, :]
                x_ok = ((kb + cols) < k_end)[:, None] & row_ok[None, :]
                a_ok = feat_ok & (kb + 0 * feats < k_end)
            block = first_block + kb // BLOCKSIZE
            if NESTED:
                a = tl.load(ABSMAX + block, mask=a_ok, other=0)
                scale = tl.load(ABSMAX_CODE + a) * tl.load(ABSMAX_SCALE + block // NESTED_BLOCKSIZE, mask=a_ok,
                                                           other=0.0)
                absmax = scale + offset
            else:
                absmax = tl.load(ABSMAX + block, mask=a_ok, other=0.0)
            packed = tl.load(w_ptrs + kb // 2, mask=w_ok, other=0)
            w_even = (tl.load(CODE + (packed >> 4)) * absmax[:, None]).to(X.dtype.element_ty)
            w_odd = (tl.load(CODE + (packed & 15)) * absmax[:, None]).to(X.dtype.element_ty)
            w = tl.reshape(tl.join(w_even, w_odd), (BLOCK_N, BLOCKSIZE))  # element 2j even_j, 2j + 1 odd_j
            x = tl.load(x_ptrs + kb, mask=x_ok, other=0.0)
            if FP32_DOT:
                acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(w, x)

    y_ptrs = Y + rows[None, :].to(tl.int64) * stride_ym + feats[:, None]  # y^T tile
    y_mask = feat_ok[:, None] & row_ok[None, :]
    if not SPLIT:
        _epilogue(acc, BIAS, y_ptrs, y_mask, feats, feat_ok, HAS_BIAS)
    else:
        total, last = split_k_total(acc, PARTIAL, COUNTS, tile, split, splits, rows, feats, y_mask, M, N)
        if last:
            _epilogue(total, BIAS, y_ptrs, y_mask, feats, feat_ok, HAS_BIAS)
            tl.atomic_xchg(COUNTS + tile, 0)


@triton.jit
def _epilogue(acc, BIAS, y_ptrs, y_mask, feats, feat_ok, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(BIAS + feats, mask=feat_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=y_mask)


def default_config(M: int, N: int, K: int, blocksize: int, device: torch.device) -> Fp8LinearConfig:
    """Tiles and splits for y [M, N] = x [M, K] W^T (no autotuning: a given card always computes the same bits).
    GPU: fp8_linear's rule (config_for: splits that fill one wave of GPU_TILES' programs per SM), BLOCK_K
    at least one block. Interpreter: 16-wide tiles and one block per K step, so small test shapes cross tiles,
    splits and edges."""
    if device.type != "cuda":
        return Fp8LinearConfig(block_m=16, block_n=16, block_k=blocksize, split_k=min(3, K // blocksize))
    sms = sm_count(device)
    return config_for(M, N, K, sms, **{**GPU_TILES, "block_k": max(GPU_TILES["block_k"], blocksize)})


def nf4_linear_fwd(
    x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
    absmax_code: torch.Tensor | None, absmax_scale: torch.Tensor | None, offset: torch.Tensor | None,
    bias: torch.Tensor | None, N: int, blocksize: int, nested_blocksize: int,
    config: Fp8LinearConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (unit stride along K; K a multiple of blocksize), packed [N K / 2] uint8, absmax [N K / blocksize]
    (fp32, or uint8 codes with absmax_code [256] fp32, absmax_scale [ceil(blocks / nested_blocksize)] fp32 and
    offset [] fp32: double quantization), code [16] fp32, bias [N] or None -> y [M, N] in x's dtype."""
    M, K = x.shape
    interpret = _interpreting(x)
    if config is None:
        config = default_config(M, N, K, blocksize, torch.device("cpu") if interpret else x.device)
    if config.block_k % blocksize:
        raise ValueError(f"nf4_linear: block_k {config.block_k} is not a multiple of blocksize {blocksize}")
    k_per_split, split, tiles = split_plan("nf4_linear", M, N, K, config)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    nested = absmax_code is not None
    # tensors the kernel does not touch (no split, bias or nesting): any of the right kind
    partial = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else code
    _nf4_linear_kernel[(tiles * split,)](
        x, packed, absmax, code, absmax_code if nested else code, absmax_scale if nested else code,
        offset if nested else code, bias if bias is not None else code, y, partial, _counters(x.device),
        x.stride(0), y.stride(0),
        M, N, K, k_per_split, split,
        HAS_BIAS=bias is not None, NESTED=nested, SPLIT=split > 1, EVEN_K=K % config.block_k == 0,
        FP32_DOT=interpret or x.dtype == torch.float32, BLOCKSIZE=blocksize, NESTED_BLOCKSIZE=nested_blocksize,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=False,
    )
    return y
