"""Flash-decoding in Triton: one query token per row over a static K/V cache, grouped K/V heads, split over keys.

Why: the rollout engine's decode step ran one SDPA call per layer over all M padded cache slots (masked), about
three times what reading only the filled slots takes (measured: benchmarks/NOTES_rollout.md). Here each program
reads only slots < length, where length is a device tensor [1]: the grid is fixed (CUDA-graph capturable), the
work of a split follows the current length, and nothing at or past it is loaded (but for an e4m3 V read in whole
tiles: below).

Layout: q [N, Hkv, G, D] (the G query heads of a K/V head as G rows, rollout/attention.py's layout), cache
k/v [N, Hkv, M, D], visible [N, M] (bool: slots holding a real token). Optional shared prefix: S consecutive rows
n*S..n*S+S-1 share prefix_k/prefix_v [N // S, Hkv, P, D] (all P slots filled, prefix_visible [N // S, P]); the
cache then holds only each row's suffix. One program of (group, K/V head, split) holds the S*G query rows of the
group: a prefix tile is loaded once for all of them (the bandwidth saving), a suffix tile of sample s only
counts for sample s's G rows. The plain call is the same kernel with S = 1 and no prefix.

Work split: the tiles of one (group, head) are numbered prefix first, then sample 0's suffix, sample 1's...; split
i takes a contiguous run of them. Partial (max, sum, acc) go out in fp32; `_combine_kernel` merges the splits. With
one split (Llama-3.1-8B's 512 (row, head) programs fill the GPU alone) the kernel writes the output itself: no
partials, no second launch.
Scores use exp2 with log2(e) folded into the scale. Under TRITON_INTERPRET a bf16/fp16 cache's dots run in fp32
(Triton 3.9's interpreter returns garbage for bf16 tl.dot, shared/DESIGN.md; its fp16 dots are right, so an e4m3
cache's run as on a GPU); on a GPU a 16-bit cache's q.k is in the input dtype with fp32 accumulation and p is rounded
to q's dtype for p.v, as flash-attention does (an e4m3 cache's dots: e4m3 or fp16, below); fp32 inputs use "ieee" dots.

FP8 K/V (KV_FP8): k/v are e4m3 with one fp32 scale per (row, slot, head) (ops/decode_attention.py's format). A tile is
loaded as e4m3 (half the bytes: the point, attention is bound by reading K/V) and, without fp8_dots (below), widened
to fp16 in registers (exact; fp16 dots: below); the key scales multiply the tile's scores (q.k_q k_scale = q.k), and
the value scales the weights p before the p.v dot (sum_j p_j v_scale_j v_q,j = sum_j p_j v_j), so no dequantized tile
is ever written. The running sum l is of the unscaled p.

Without fp8_dots an e4m3 cache's dots run in fp16, not in q's bf16: e4m3 widens to fp16 in one conversion per two
elements, to bf16 only through fp16 (three per two: the conversions, not the bytes, were the kernel's cost; sm_90 PTX
census in NOTES_rollout.md). fp16's range is made safe by powers of two, which are exact: each q row is divided by the
power of two at or below its largest |q| (so |q| < 2, and bf16's 8 significant bits fit fp16's 11 down to 2^-14), and
each tile's weights p v_scale by the one at or below the tile's largest value scale (p <= 1: weights <= 2); both
powers multiply back in fp32. What is rounded: q below 2^-14 of its row's power (fp16 subnormals, at most 2^-25 of it)
and the weights to fp16 (half an ulp, 2^-11 relatively, or 2^-25 of the tile's power below 2^-14) instead of bf16's
2^-8.

fp8_dots (FP8_DOTS; ops.decode_attention's path for an e4m3 cache and a 16-bit q where fp8_dots_pay: 16% less time per
call than the fp16 dots at Llama-3.1-8B heads on an H200, NOTES_rollout.md): an e4m3 cache's dots on the FP8 tensor
cores, which take e4m3 as loaded. Hopper's 8-bit wgmma needs an M of 64, and a program's 16 query rows take the
mma.sync path, which widens e4m3 again, so the dots run transposed: scores [slots, rows] = k . q^T (M: the tile's
slots) and the output [dims, rows] += v^T . w (M: the head dim; V's slots contiguous as its reduction dimension
needs). q is rounded to e4m3 per row (q / q_scale, q_scale its largest |q| / 448: 2^-4 relative, or 2^-10 q_scale
below e4m3's normals) and so are the weights w = p v_scale / v_pow2 x E4M3_WEIGHTS; both scales multiply back in fp32.
The softmax state (m, l) is per row as above, l of the unrounded p. An sm_90 compile (on the CPU) has e4m3 wgmma for
both dots and no e4m3 conversion (tests/test_decode_attention.py); the test's bound: fp8_dots_bound there.
fp8_split (FP8_SPLIT, not the op's): q and the weights also send what their rounding dropped, times SPLIT_SCALE and
rounded to e4m3, through a second dot divided by it: 2^-8 relative instead of 2^-4 (bf16's precision), for twice the
MMAs and the weights' first parts widened back to take their remainder (16 conversions a tile at Llama's 16 x 128
programs, against the fp16 dots' 128: sm_90 compile). Timed on an H200 it gives back most of fp8_dots' gain (44.4
against 38.7 us at Llama-3.1-8B heads; the fp16 dots 45.9) for fp8_dots' extra rollout KL (NOTES_rollout.md).

An e4m3 V is best stored with its slots contiguous (rollout/kv_cache.py allocates it so): p.v takes V as the MMA's
B operand with the slots as its reduction dimension, which 8-bit operands must have contiguous; from a [M, D]
row-major tile Triton gathers it from shared memory one byte at a time (an sm_90 compile: 188 byte loads per
thread against 28 with the slots contiguous). The kernel reads V through its strides either way. Where the slots
are contiguous and every tile lies inside its buffer (V_WHOLE_TILES: the rows' own V and the shared prefix's, both),
V's loads are not masked, so they stay vectorized and pipelined, and the hidden slots' values are zeroed after the
load (a hidden slot may hold anything, NaN included) unless the caller vouches that every slot is finite
(V_FINITE: the engine's zero-allocated cache; a hidden slot's weight is 0, and 0 x finite adds nothing): that
zeroing, per byte, took 12% of the kernel's time (H100, Llama-3.1-8B heads). One flag for both: a choice per tile
(prefix or suffix) is a branch at run time, and the sm_90 compile then neither vectorizes nor pipelines V's loads.
Whole tiles need the buffer's slots to be a multiple of block_n: the engine's plain cache is (length_bucket 128),
a shared prefix's suffix (max_new_tokens slots) may not be, and then takes the masked loads.
"""
from __future__ import annotations

import itertools
import os

import torch
import triton
import triton.language as tl

from fastgrpo.kernels.cards import max_shared, sm_count

LOG2E = 1.4426950408889634
# initial running max: finite (-1e30), so a split that sees no key gives exp2(-inf + 1e30) = 0, not NaN
NEG = tl.constexpr(-1.0e30)  # a global a @jit function reads must be a tl.constexpr instance (compiler rule)
E4M3_MAX = tl.constexpr(448.0)
# fp8_dots: the weights p v_scale / v_pow2 (<= 2) are scaled by this before their e4m3 rounding, so that the
# largest is 256 (< 448) and weights down to 2^-13 keep e4m3's 3 mantissa bits (its normals start at 2^-6)
E4M3_WEIGHTS = tl.constexpr(128.0)
# fp8_split: a rounding's remainder (at most 2^-4 of the value, half an e4m3 ulp) times this stays within e4m3's range
SPLIT_SCALE = tl.constexpr(16.0)
# a program's tile and launch on a GPU, with default_splits' WARPS_PER_SM: of the tiles and splits timed on an H100
# at the rollout's shapes (benchmarks/bench_decode_attention.py --splits), the fastest for Qwen2.5-1.5B and
# Llama-3.1-8B heads (16 query rows, D 128) with a bf16 and an e4m3 cache alike: 10-23% less time per call than 64
# slots, 2 warps and about 4 programs per SM (NOTES_rollout.md)
GPU_TILES = dict(block_n=128, num_warps=4, num_stages=2)
# a program's shared memory grows with its rows x head dim (a shared prefix's S x G rows, a head dim of 256): past
# 16 x 128, GPU_TILES' would pass an Ada card's 99 KB per block (bf16, 64 rows x D 128: 152 KB; x D 256: 296 KB,
# past an H100's 227 KB too), so taller or wider programs take smaller tiles: (rows x D up to, tiles); all fit 99 KB
# (test_decode_attention.py compiles them). 64 slots / 2 warps was the default before the splits sweep.
TILES_BY_SIZE = ((16 * 128, GPU_TILES), (64 * 128, dict(block_n=64, num_warps=2, num_stages=2)),
                 (None, dict(block_n=32, num_warps=2, num_stages=2)))
# fp8_dots' 16-row programs (the plain layout's: Qwen2.5's and Llama-3.1's G) with a third stage, on cards where a
# block may take its ~102 KB (an sm_90 compile: Hopper; not an Ada card's 99 KB): at the mean context of a
# 4096-token rollout 8% less time per call at Llama-3.1-8B heads and 7% at Qwen2.5-1.5B's, at a 1024-token one 1-2%
# (H200, bench_decode_attention --new-tokens: NOTES_rollout.md). A register cap for more programs per SM spilled and
# was slower; so were more splits.
FP8_DOTS_DEEP_TILES = dict(GPU_TILES, num_stages=3)
FP8_DOTS_DEEP_SHARED = 128 * 1024  # a card's shared memory per block from which they are taken
# (rows, head dim) up to which a program over an e4m3 cache (half the bytes) takes GPU_TILES: a shared prefix's S x G
# (Qwen2.5's 8 x 6, Llama-3.1's 8 x 4) ran 1.1-2.2x faster on them than on 64 slots / 2 warps, with the fp16 dots and
# fp8_dots alike (H200, bench_decode_attention --layouts shared: NOTES_rollout.md), within an Ada card's 99 KB; at
# D 256 fp8_dots' GPU_TILES take 140 KB from 32 rows, so wider programs keep TILES_BY_SIZE
E4M3_GPU_TILES_UP_TO = (64, 128)
# what a tiles dict passes to the launch: maxnreg (a register cap per thread, more programs per SM) only if it is set
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")
WARPS_PER_SM = 8  # default_splits: at most this many warps per SM in all (rounded down), at least one split
COMBINE_ROWS = 16  # output rows per combine program
INTERPRET_BLOCK_N = 16  # under the interpreter: small tiles so small tests cross tiles, splits and ragged tails


@triton.jit
def _decode_attention_kernel(
    Q, K, V, VIS, LENGTH, PK, PV, PVIS, KS, VS, PKS, PVS, M_OUT, L_OUT, ACC_OUT, O,
    stride_qn, stride_qh, stride_qg, stride_on, stride_oh, stride_og,
    stride_kn, stride_kh, stride_km,
    stride_vn, stride_vh, stride_vm, stride_vd,
    stride_visn,
    stride_pkb, stride_pkh, stride_pkm,
    stride_pvb, stride_pvh, stride_pvm, stride_pvd,
    stride_pvisb,
    stride_ksn, stride_ksh, stride_vsn, stride_vsh,
    stride_pksb, stride_pksh, stride_pvsb, stride_pvsh,
    H, G, D, P, S, splits, qk_scale,
    HAS_PREFIX: tl.constexpr, KV_FP8: tl.constexpr, FP8_DOTS: tl.constexpr, FP8_SPLIT: tl.constexpr,
    E4M3_BY_HAND: tl.constexpr, FP32_DOT: tl.constexpr, V_WHOLE_TILES: tl.constexpr,
    V_FINITE: tl.constexpr, WRITE_OUT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)  # group b (plain: row n) x K/V head h
    split = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.arange(0, BLOCK_R)  # r = sample * G + g
    sample_of_row = rows // G
    row_ok = rows < S * G
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    slots = tl.arange(0, BLOCK_N)

    q_ptrs = Q + (b * S + sample_of_row)[:, None] * stride_qn + h * stride_qh + (rows % G)[:, None] * stride_qg
    q = tl.load(q_ptrs + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # q: [BLOCK_R, BLOCK_D]
    if FP32_DOT:
        q = q.to(tl.float32)
    elif FP8_DOTS:  # e4m3 q (module docstring): q / q_scale, q_scale its row's amax / 448
        q_scale = tl.max(tl.abs(q.to(tl.float32)), axis=1) / E4M3_MAX
        q_scale = tl.where(q_scale > 0, q_scale, 1.0)  # an all-zero row (a padded one): 0 whatever the scale
        q_fp32 = q.to(tl.float32) / q_scale[:, None]
        q = _to_e4m3(q_fp32, E4M3_BY_HAND)
        if FP8_SPLIT:  # what rounding q dropped, scaled by 16 into e4m3's range: a second dot adds it back
            q_lo = _to_e4m3((q_fp32 - q.to(tl.float32)) * SPLIT_SCALE, E4M3_BY_HAND)
    elif KV_FP8:  # fp16 dots (module docstring): q / q_pow2 in fp16, exact but below 2^-14
        q_pow2 = _power_of_two_at_or_below(tl.max(tl.abs(q.to(tl.float32)), axis=1))
        q = (q.to(tl.float32) / q_pow2[:, None]).to(tl.float16)

    length = tl.load(LENGTH).to(tl.int32)
    n_prefix = 0
    if HAS_PREFIX:
        n_prefix = tl.cdiv(P, BLOCK_N)
    n_suffix = tl.cdiv(length, BLOCK_N)
    n_tiles = n_prefix + S * n_suffix
    per_split = tl.cdiv(n_tiles, splits)
    first = split * per_split
    last = tl.minimum(first + per_split, n_tiles)

    m_i = tl.full([BLOCK_R], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    if FP8_DOTS:  # transposed, [dims, rows]: the dots' M is the tile's dims (module docstring)
        acc = tl.zeros([BLOCK_D, BLOCK_R], tl.float32)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for t in range(first, last):
        if t < n_prefix:  # a prefix tile: every row of the group reads it
            offs = t * BLOCK_N + slots
            key_ok = tl.load(PVIS + b * stride_pvisb + offs, mask=offs < P, other=0) != 0
            k_ptrs = PK + b * stride_pkb + h * stride_pkh + offs[:, None].to(tl.int64) * stride_pkm
            v_ptrs = PV + b * stride_pvb + h * stride_pvh + offs[:, None].to(tl.int64) * stride_pvm + \
                dims[None, :] * stride_pvd
            if KV_FP8:
                ks_ptrs = PKS + b * stride_pksb + h * stride_pksh + offs
                vs_ptrs = PVS + b * stride_pvsb + h * stride_pvsh + offs
            use = row_ok[:, None] & key_ok[None, :]
            row_use = row_ok  # fp8_dots' transposed mask: its rows
        else:  # a suffix tile of one sample: only its G rows read it
            j = t - n_prefix
            sample = j // n_suffix
            offs = (j % n_suffix) * BLOCK_N + slots
            n = b * S + sample
            key_ok = tl.load(VIS + n * stride_visn + offs, mask=offs < length, other=0) != 0
            k_ptrs = K + n * stride_kn + h * stride_kh + offs[:, None].to(tl.int64) * stride_km
            v_ptrs = V + n * stride_vn + h * stride_vh + offs[:, None].to(tl.int64) * stride_vm + \
                dims[None, :] * stride_vd
            if KV_FP8:
                ks_ptrs = KS + n * stride_ksn + h * stride_ksh + offs
                vs_ptrs = VS + n * stride_vsn + h * stride_vsh + offs
            use = (row_ok & (sample_of_row == sample))[:, None] & key_ok[None, :]
            row_use = row_ok & (sample_of_row == sample)
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        # masked slots are not loaded (V in whole tiles: zeroed after the load, or left as they are under V_FINITE):
        # a pad or an unwritten slot may hold anything, NaN included
        k = tl.load(k_ptrs + dims[None, :], mask=kv_mask, other=0.0)  # k: [BLOCK_N, BLOCK_D]
        if V_WHOLE_TILES:
            v = tl.load(v_ptrs)
            if not V_FINITE:
                v = tl.where(key_ok[:, None], v, 0.0)
        else:
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if FP8_DOTS:  # [slots, rows] scores and weights, e4m3 operands as loaded: no conversion of k or v
            k_scale = tl.load(ks_ptrs, mask=key_ok, other=0.0)
            v_scale = tl.load(vs_ptrs, mask=key_ok, other=0.0)
            s = tl.dot(k, tl.trans(q))
            if FP8_SPLIT:
                s += tl.dot(k, tl.trans(q_lo)) / SPLIT_SCALE
            s = s * (k_scale * qk_scale).to(tl.float32)[:, None] * q_scale[None, :]
            s = tl.where(key_ok[:, None] & row_use[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            # weights p v_scale / v_pow2 <= 2, times E4M3_WEIGHTS <= 256 < 448, in e4m3; both factors multiplied back
            v_pow2 = _power_of_two_at_or_below(tl.max(v_scale, axis=0))
            w_fp32 = p * (v_scale / v_pow2 * E4M3_WEIGHTS)[:, None]
            w = _to_e4m3(w_fp32, E4M3_BY_HAND)
            v_t = tl.trans(v.to(tl.float8e4nv))
            pv = tl.dot(v_t, w)
            if FP8_SPLIT:
                pv += tl.dot(v_t, _to_e4m3((w_fp32 - w.to(tl.float32)) * SPLIT_SCALE, E4M3_BY_HAND)) / SPLIT_SCALE
            acc = acc * alpha[None, :] + pv * (v_pow2 / E4M3_WEIGHTS)
            m_i = m_new
        else:
            # k.to(q.dtype): e4m3 widened (exact); a no-op for a cache in q's dtype
            if FP32_DOT:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            # the casts: under torch.compile, Inductor passes the float qk_scale as fp64, which would make s fp64
            if KV_FP8:
                k_scale = tl.load(ks_ptrs, mask=key_ok, other=0.0)  # [BLOCK_N]
                v_scale = tl.load(vs_ptrs, mask=key_ok, other=0.0)
                if not FP32_DOT:
                    s = s * q_pow2[:, None]  # exact
                s = s * (k_scale * qk_scale).to(tl.float32)[None, :]
            else:
                s = s * qk_scale
            s = tl.where(use, s.to(tl.float32), float("-inf"))  # s: [BLOCK_R, BLOCK_N], log2 units
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if FP32_DOT:
                if KV_FP8:
                    p = p * v_scale[None, :]
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            elif KV_FP8:  # fp16 weights p v_scale / v_pow2 <= 2 (the division is exact), v_pow2 multiplied back
                v_pow2 = _power_of_two_at_or_below(tl.max(v_scale, axis=0))
                p = p * (v_scale / v_pow2)[None, :]
                pv = tl.dot(p.to(tl.float16), v.to(tl.float16)) * v_pow2
            else:
                pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    if FP8_DOTS:
        acc = tl.trans(acc)
    if WRITE_OUT:  # one split: the output itself, as _combine_kernel writes it, with no partials
        _store_output(O, acc, l_i, b, h, rows, dims, S, G, D, stride_on, stride_oh, stride_og)
    else:
        out = bh.to(tl.int64) * splits + split
        tl.store(M_OUT + out * BLOCK_R + rows, m_i)
        tl.store(L_OUT + out * BLOCK_R + rows, l_i)
        tl.store(ACC_OUT + (out * BLOCK_R + rows)[:, None] * BLOCK_D + dims[None, :], acc)


@triton.jit
def _to_e4m3(x, BY_HAND: tl.constexpr):
    """fp32 -> e4m3, to nearest even, saturating at +-448. BY_HAND (under Triton 3.9's interpreter, whose conversion
    drops the carry of a rounding into the next power of two, 31.2 -> 16, and truncates subnormals): round on the
    e4m3 grid in fp32 first, so that the conversion is exact; a GPU's cvt.rn.satfinite rounds itself."""
    x = tl.clamp(x, -E4M3_MAX, E4M3_MAX)
    if BY_HAND:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # 3 mantissa bits, ties to even
        normal = bits.to(tl.float32, bitcast=True)
        subnormal = (x + 24576.0) - 24576.0  # 1.5 x 2^14: fp32's own rounding to multiples of 2^-9
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)  # below 2^-6: e4m3's subnormals
    return x.to(tl.float8e4nv)


@triton.jit
def _power_of_two_at_or_below(x):
    """2^floor(log2 x) for x > 0 (its exponent bits alone), 1 where that is 0 (x zero or subnormal)."""
    p = (x.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(p > 0, p, 1.0)


@triton.jit
def _combine_kernel(
    M_IN, L_IN, ACC_IN, O,
    stride_on, stride_oh, stride_og,
    H, G, D, S, splits,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):
    """Merge the splits' partial softmax states of ROWS of the S*G rows of one (group, head) and write them."""
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    base = bh.to(tl.int64) * splits
    m = tl.full([ROWS], NEG, tl.float32)
    for i in range(0, splits):
        m = tl.maximum(m, tl.load(M_IN + (base + i) * BLOCK_R + rows))
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for i in range(0, splits):
        w = tl.exp2(tl.load(M_IN + (base + i) * BLOCK_R + rows) - m)
        l_sum += w * tl.load(L_IN + (base + i) * BLOCK_R + rows)
        acc += w[:, None] * tl.load(ACC_IN + ((base + i) * BLOCK_R + rows)[:, None] * BLOCK_D + dims[None, :])
    _store_output(O, acc, l_sum, b, h, rows, dims, S, G, D, stride_on, stride_oh, stride_og)


@triton.jit
def _store_output(O, acc, l_sum, b, h, rows, dims, S, G, D, stride_on, stride_oh, stride_og):
    """acc / l_sum of query rows `rows` (r = sample * G + g) of group b, K/V head h into O [N, Hkv, G, D]; a row
    that saw no key at all (not possible in the engine: a query sees its own slot) gets 0, not NaN."""
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o_ptrs = O + (b * S + rows // G)[:, None] * stride_on + h * stride_oh + (rows % G)[:, None] * stride_og
    o_mask = (rows < S * G)[:, None] & (dims < D)[None, :]
    tl.store(o_ptrs + dims[None, :], out.to(O.dtype.element_ty), mask=o_mask)


def default_splits(programs: int, max_slots: int, block_r: int, block_d: int, kv_bytes: int,
                   device: torch.device, block_n: int, num_warps: int) -> int:
    """Splits per (group, head): at most WARPS_PER_SM warps per SM in all (more splits only added partials and
    combine work: Llama-3.1-8B's 512 (row, head) programs ran fastest unsplit), no split shorter than 2 tiles at full
    length, and the fp32 [block_r, block_d] partial each split writes (and the combine reads back) under a quarter of
    the K/V bytes a program reads at full length: with few, tall shared-prefix programs that traffic had outgrown the
    attention itself (H100 profile, benchmarks/NOTES_rollout.md)."""
    if device.type != "cuda":
        return max(1, min(3, triton.cdiv(max_slots, 2 * INTERPRET_BLOCK_N)))
    sms = sm_count(device)
    kv_read = max_slots * block_d * 2 * kv_bytes  # K and V
    partial = block_r * block_d * 4 * 2  # fp32, written and read back
    by_partials = kv_read // (4 * partial)
    by_warps = WARPS_PER_SM * sms // (num_warps * programs)
    return max(1, min(by_warps, triton.cdiv(max_slots, 2 * block_n), by_partials))


def decode_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, length: torch.Tensor, scale: float,
    prefix_k: torch.Tensor | None = None, prefix_v: torch.Tensor | None = None,
    prefix_visible: torch.Tensor | None = None, splits: int | None = None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, prefix_k_scale: torch.Tensor | None = None,
    prefix_v_scale: torch.Tensor | None = None, tiles: dict | None = None, v_finite: bool = False,
    fp8_dots: bool = False, fp8_split: bool = False,
) -> torch.Tensor:
    """q [N, Hkv, G, D], k/v [N, Hkv, M, D], visible [N, M] bool, length [1] int (slots < length are read), with
    optional prefix_k/prefix_v [N // S, Hkv, P, D], prefix_visible [N // S, P] -> out [N, Hkv, G, D] in q's dtype.
    fp8 K/V: k/v (prefix_k/prefix_v) e4m3 with k_scale/v_scale fp32 [N, Hkv, M] (prefix_*_scale [N // S, Hkv, P]).
    q, k and visible need a unit-stride last dimension, v and prefix_v one of their last two (the op makes them so).
    tiles: some of the tiles' keys (block_n, num_warps, num_stages, maxnreg) over tiles_for's, for a benchmark's
    sweep.
    v_finite: every slot of v (and prefix_v) holds a finite value, hidden or not (module docstring).
    fp8_dots: an e4m3 cache's dots on the FP8 tensor cores, q and the weights rounded to e4m3 (module docstring);
    a 16-bit q only. Without it an e4m3 cache's dots run in fp16 (fewer roundings: the benchmark's baseline).
    fp8_split (with fp8_dots): q and the weights each as two e4m3 parts, two dots where there is one (module
    docstring); slower than fp8_dots, so no caller but the benchmark and the tests."""
    N, H, G, D = q.shape
    has_prefix = prefix_k is not None
    B = prefix_k.shape[0] if has_prefix else N
    S = rows_per_group(N, B)
    P = prefix_k.shape[2] if has_prefix else 0
    interpret = os.environ.get("TRITON_INTERPRET") == "1" and not q.is_cuda
    if fp8_dots and (k_scale is None or q.dtype == torch.float32):
        raise ValueError(f"fp8_dots: needs an e4m3 cache (k_scale, v_scale) and a 16-bit q, got k {k.dtype}, "
                         f"q {q.dtype}")
    if fp8_split and not fp8_dots:
        raise ValueError("fp8_split: splits fp8_dots' operands; pass fp8_dots=True too")
    fp8 = k_scale is not None
    block_r, block_d = program_blocks(S * G, D, fp8_dots)
    own = launch_tiles(block_r, block_d, fp8, fp8_dots, max_shared(q.device) if q.is_cuda else 0)
    tiles = {**own, **(tiles or {})}
    block_n = INTERPRET_BLOCK_N if interpret else tiles["block_n"]
    if splits is None:
        splits = default_splits(B * H, P + S * k.shape[2], block_r, block_d, k.element_size(), q.device, block_n,
                                tiles["num_warps"])
    # bool masks go to the kernel as they are (Triton reads *i1): a .view(torch.uint8) here would break inductor's
    # lowering when the engine compiles the decode step
    if has_prefix:
        pk, pv, pvis = prefix_k, prefix_v, prefix_visible
    else:  # unused by the kernel (HAS_PREFIX=False): any tensors of the right dtype
        pk, pv, pvis = k, v, visible
    # likewise the scales it does not read (KV_FP8=False, or no prefix)
    ks, vs = (k_scale, v_scale) if fp8 else (k, v)
    pks, pvs = (prefix_k_scale, prefix_v_scale) if fp8 and has_prefix else (ks, vs)
    out = torch.empty_like(q)
    # one split: the kernel writes `out` itself; the partials' pointers, never touched, are `out` too (a tensor the
    # kernel does write, so a compiler's analysis of what the launch mutates sees nothing new)
    if splits == 1:
        m_part = l_part = acc_part = out
    else:
        m_part = torch.empty(B * H, splits, block_r, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(B * H, splits, block_r, block_d, dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(B * H, splits)](
        q, k, v, visible, length, pk, pv, pvis, ks, vs, pks, pvs, m_part, l_part, acc_part, out,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        visible.stride(0),
        pk.stride(0), pk.stride(1), pk.stride(2),
        pv.stride(0), pv.stride(1), pv.stride(2), pv.stride(3),
        pvis.stride(0),
        *_head_strides(ks, vs, pks, pvs),
        H, G, D, P, S, splits, scale * LOG2E,
        HAS_PREFIX=has_prefix, KV_FP8=fp8, FP8_DOTS=fp8_dots, FP8_SPLIT=fp8_split, E4M3_BY_HAND=interpret,
        FP32_DOT=q.dtype == torch.float32 or (interpret and not fp8),
        V_WHOLE_TILES=_whole_v_tiles(v, block_n, block_d) and (not has_prefix or _whole_v_tiles(pv, block_n, block_d)),
        V_FINITE=v_finite, WRITE_OUT=splits == 1, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d,
        **({} if interpret else {key: tiles[key] for key in LAUNCH_OPTIONS if key in tiles}),
    )
    if splits == 1:
        return out
    rows = min(block_r, COMBINE_ROWS)  # row tiles as programs: one program per (group, head) left SMs idle
    _combine_kernel[(B * H, block_r // rows)](
        m_part, l_part, acc_part, out, out.stride(0), out.stride(1), out.stride(2),
        H, G, D, S, splits, BLOCK_R=block_r, BLOCK_D=block_d, ROWS=rows,
    )
    return out


def fp8_dots_pay(rows: int, D: int) -> bool:
    """Whether fp8_dots is the faster e4m3 path for programs of `rows` query rows (S x G) and head dim D: where they
    take GPU_TILES, whose 4 warps make fp8_dots' dots e4m3 wgmma on Hopper (the timed cases: module docstring).
    Smaller tiles' 2 warps make them mma.sync, which widens e4m3 to fp16 there as the fp16 dots do (an sm_90
    compile, tests/test_decode_attention.py): only fp8_dots' roundings would be added."""
    return tiles_for(*program_blocks(rows, D, fp8_dots=True), fp8=True) is GPU_TILES


def rows_per_group(N: int, B: int) -> int:
    """N // B (B dividing N) as a plain int, also where N and B are symbolic sizes: under torch.compile with a
    dynamic batch (the engine's compaction) tracing then guards on s * B >= N for s = 1, 2, ..., simple relations,
    where carrying N // B into the launch arithmetic's nested floor divisions took sympy minutes per layer."""
    return next(s for s in itertools.count(1) if s * B >= N)


def program_blocks(rows: int, D: int, fp8_dots: bool = False) -> tuple[int, int]:
    """(block_r, block_d) of a program of `rows` query rows (S x G) and head dim D; an 8-bit MMA reduces 32 at a
    time."""
    return max(16, triton.next_power_of_2(rows)), max(32 if fp8_dots else 16, triton.next_power_of_2(D))


def tiles_for(block_r: int, block_d: int, fp8: bool = False) -> dict:
    """The GPU tiles of a program of block_r query rows and head dim block_d over a bf16 cache (TILES_BY_SIZE) or an
    e4m3 one (fp8: E4M3_GPU_TILES_UP_TO, then TILES_BY_SIZE)."""
    if fp8 and block_r <= E4M3_GPU_TILES_UP_TO[0] and block_d <= E4M3_GPU_TILES_UP_TO[1]:
        return GPU_TILES
    return next(tiles for limit, tiles in TILES_BY_SIZE if limit is None or block_r * block_d <= limit)


def launch_tiles(block_r: int, block_d: int, fp8: bool, fp8_dots: bool, shared: int) -> dict:
    """The tiles a launch takes on a card of `shared` bytes of shared memory per block (0: not a GPU): tiles_for's,
    or FP8_DOTS_DEEP_TILES for fp8_dots' 16-row programs where the card has room for them."""
    tiles = tiles_for(block_r, block_d, fp8)
    if fp8_dots and tiles is GPU_TILES and block_r == 16 and shared >= FP8_DOTS_DEEP_SHARED:
        return FP8_DOTS_DEEP_TILES
    return tiles


def _whole_v_tiles(v: torch.Tensor, block_n: int, block_d: int) -> bool:
    """Whether a V [.., slots, D] has its slots contiguous and every tile the kernel may load from it (block_n slots
    by block_d dims) lies inside it: then its loads need no mask."""
    return v.stride(2) == 1 and v.shape[2] % block_n == 0 and v.shape[3] == block_d


def _head_strides(*scales: torch.Tensor) -> list[int]:
    """(row, head) strides of each [rows, Hkv, slots] scale tensor (or of its stand-in, not read)."""
    return [stride for t in scales for stride in (t.stride(0), t.stride(1))]
