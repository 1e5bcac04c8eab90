"""Weight-only FP8 linear for skinny GEMMs (decode steps): y = x W^T * scale + bias, W in e4m3, x in 16 bits.

Why: a decode step multiplies every weight by 64 rows or so, which reads each weight once and does ~128 FLOPs
per weight byte: the GEMMs are bound by the weight reads (benchmarks/NOTES_rollout.md: 4.8 ms of a Llama-3.1-8B
step, at 74% of the read roofline). Storing W in e4m3 (1 byte) halves what is read; each tile is upcast in
registers (e4m3 -> bf16 is exact) and multiplied on the 16-bit tensor cores with fp32 accumulation (W8A16:
activations keep their precision). The per-output-channel scale is constant along K, so it is applied once
to the accumulator, exactly.

Layout: x [M, K] (unit stride along K), W [N, K] e4m3 (nn.Linear's layout), scale [N] fp32, bias [N], y [M, N]
in x's dtype. One program computes a BLOCK_N x BLOCK_M tile of y^T = W x^T (the weight tile is the left
operand: BLOCK_N output features on the MMA's long side, the few rows on its short side) over one split of K.

Split-K without a second kernel: with 64 rows, q_proj of Llama-3.1-8B (N = 4096) has 64 tiles of 64 features
for 132 SMs, too few to keep the reads in flight. Each (tile, split) program then writes its fp32 partial to a
workspace and takes a ticket from a per-tile counter (atomic, acq_rel); the program that draws the last ticket
sums the partials in split order (bitwise reproducible whichever program arrives last), applies scale and
bias, writes y, and resets the counter to 0, so the counters are zero again between launches (and across CUDA
graph replays) with no memset. Partials are read with .cg (L2, not a possibly stale L1 line of an earlier launch).
Under TRITON_INTERPRET tl.dot runs in fp32 (Triton 3.9's interpreter returns garbage for bf16 tl.dot,
shared/DESIGN.md); fp32 activations use "ieee" dots on a GPU too.

W8A8 (x_scale given): x is e4m3 too, one fp32 scale per row (ops/fp8_scaled_linear.py quantizes it), and the tiles
go to the FP8 tensor cores as loaded: no upcast, and half the bytes of x per K step. Why: in W8A16 every program
reads its [BLOCK_K, 64] bf16 tile of x (16 KB) from L2 beside an 8 KB weight tile, so the SMs load three bytes
for each byte of weight streamed from memory; the row scale, constant along K, is applied in the epilogue.
With x_group, x has a scale per row and group of x_group along K instead (a quantizer that needs no reduction over
a whole row): each K step's dot, within one group, is multiplied by its rows' scales as it is added into fp32.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from fastgrpo.kernels.cards import max_shared, sm_count

# Tickets of one launch; the counters are shared by all launches on a device (one stream at a time: the engine's
# steps run in order), so this bounds tiles per launch: 64K tiles of 64 features is a 4M-wide output.
MAX_TILES = 1 << 16
GPU_TILES = dict(block_n=64, block_k=128, programs_per_sm=2, num_warps=4, num_stages=3)  # see default_config
# e4m3 x (default_config): by how many 64-feature tiles the GEMM has against the SMs (w8a8_tiles)
W8A8_TILES = dict(block_n=64, block_k=128, programs_per_sm=1, num_warps=4, num_stages=5)  # any card, any width
W8A8_NARROW_TILES = dict(block_n=64, block_k=256, programs_per_sm=1, num_warps=4, num_stages=5)  # <= one wave
W8A8_NARROW_SHARED = 5 * 2 * 64 * 256  # its shared memory, bytes: 5 stages x (weight + x) tiles of 64 x 256 e4m3
W8A8_WIDE_TILES = dict(block_n=64, block_k=128, programs_per_sm=1, num_warps=4, num_stages=3)  # > one wave


@dataclasses.dataclass(frozen=True)
class Fp8LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _fp8_linear_kernel(
    X, W, SCALE, BIAS, Y, PARTIAL, COUNTS, X_SCALE,
    stride_xm, stride_wn, stride_ym,
    M, N, K, k_per_split, splits,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, FP32_DOT: tl.constexpr, FP8_X: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISE_EVERY: tl.constexpr,
    X_GROUP: tl.constexpr,
):
    tile, split, feats, rows = program_tile(tl.program_id(0), splits, N, BLOCK_M, BLOCK_N)
    feat_ok = feats < N
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    w_ptrs = W + feats[:, None].to(tl.int64) * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = X + rows[None, :].to(tl.int64) * stride_xm + ks[:, None]  # [BLOCK_K, BLOCK_M]: x^T
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:  # no mask along the contiguous dimension: loads stay vectorized
            w = tl.load(w_ptrs + k, mask=feat_ok[:, None], other=0.0)
            x = tl.load(x_ptrs + k, mask=row_ok[None, :], other=0.0)
        else:
            k_ok = (k + ks) < k_end
            w = tl.load(w_ptrs + k, mask=feat_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs + k, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        if X_GROUP:  # each K step lies in one group of x's scales (the launch checks): its dot scaled by them
            sx = tl.load(X_SCALE + rows * tl.cdiv(K, X_GROUP) + k // X_GROUP, mask=row_ok, other=0.0)
            if FP32_DOT:
                acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee") * sx[None, :]
            else:
                acc += tl.dot(w, x, max_num_imprecise_acc=PRECISE_EVERY) * sx[None, :]
        elif FP32_DOT:
            acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
        elif FP8_X:  # the tensor cores' partial sums go into acc in fp32 every PRECISE_EVERY of K (see the launch)
            acc += tl.dot(w, x, max_num_imprecise_acc=PRECISE_EVERY)
        else:
            acc += tl.dot(w.to(x.dtype), x)

    y_ptrs = Y + rows[None, :].to(tl.int64) * stride_ym + feats[:, None]  # y^T tile
    y_mask = feat_ok[:, None] & row_ok[None, :]
    row_scaled = FP8_X and X_GROUP == 0  # one scale per row of x, applied once at the end (groups: in the K loop)
    if not SPLIT:
        _epilogue(acc, SCALE, BIAS, X_SCALE, y_ptrs, y_mask, feats, feat_ok, rows, row_ok, HAS_BIAS, row_scaled)
    else:
        total, last = split_k_total(acc, PARTIAL, COUNTS, tile, split, splits, rows, feats, y_mask, M, N)
        if last:
            _epilogue(total, SCALE, BIAS, X_SCALE, y_ptrs, y_mask, feats, feat_ok, rows, row_ok, HAS_BIAS,
                      row_scaled)
            tl.atomic_xchg(COUNTS + tile, 0)


@triton.jit
def program_tile(pid, splits, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tile, split, output features n [BLOCK_N], input rows m [BLOCK_M]) of program `pid`: the programs of a
    tile's splits are adjacent, so they start together."""
    tile = pid // splits
    split = pid % splits
    tiles_n = tl.cdiv(N, BLOCK_N)
    feats = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    return tile, split, feats, rows


@triton.jit
def split_k_total(acc, PARTIAL, COUNTS, tile, split, splits, rows, feats, y_mask, M, N):
    """Split-K: this split's partial sum goes to the workspace PARTIAL [splits, M, N] fp32; the program that takes
    the tile's last ticket gets (the partials summed in split order: the same bits whatever order the splits ran
    in, True), the others (acc, False). The last one resets the tile's counter after its epilogue."""
    part = PARTIAL + rows[None, :].to(tl.int64) * N + feats[:, None]
    tl.store(part + split.to(tl.int64) * M * N, acc, mask=y_mask)
    tl.debug_barrier()  # every thread's partial is stored before the ticket is taken (release)
    ticket = tl.atomic_add(COUNTS + tile, 1, sem="acq_rel")
    last = ticket == splits - 1
    total = acc
    if last:
        total = tl.zeros_like(acc)
        for _ in range(0, splits):
            total += tl.load(part, mask=y_mask, other=0.0, cache_modifier=".cg")
            part += M * N
    return total, last


@triton.jit
def _epilogue(acc, SCALE, BIAS, X_SCALE, y_ptrs, y_mask, feats, feat_ok, rows, row_ok, HAS_BIAS: tl.constexpr,
              ROW_SCALED: tl.constexpr):
    y = acc * tl.load(SCALE + feats, mask=feat_ok, other=0.0)[:, None]
    if ROW_SCALED:
        y *= tl.load(X_SCALE + rows, mask=row_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(BIAS + feats, mask=feat_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptrs, y.to(y_ptrs.dtype.element_ty), mask=y_mask)


def _interpreting(x: torch.Tensor) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and not x.is_cuda


def default_config(M: int, N: int, K: int, device: torch.device, fp8_x: bool = False) -> Fp8LinearConfig:
    """Tiles and splits for y [M, N] = x [M, K] W^T: a function of the shape and the SM count only (no autotuning:
    the split order fixes the fp32 sums, so a given card always computes the same bits).

    GPU: GPU_TILES, the fastest of benchmarks/bench_fp8.py's sweep for every decode linear of Llama-3.1-8B shapes on
    an H100 (64 rows; q/o, k/v, gate/up, down, lm_head: 64 features x 128 of K, 4 warps, 3 stages; the first tiles,
    128 features and 8 warps, took 7-182% longer). The splits fill one wave of two programs per SM (not more: a
    second, partial wave would idle most SMs), each split at least two K steps; that is the sweep's best split for
    4 of the 5 shapes (k/v: 16 where 8 was best). With e4m3 x (fp8_x), by width (w8a8_tiles): at most one tile
    per SM (q/k/v, o, down), 256 of K per step and 5 stages where the card has the shared memory for it (Hopper,
    not Ada's 99 KB): each SM then holds 80 KB of weight in flight; wider (gate/up, lm_head), 128 of K and 3 stages,
    so several programs share an SM and overlap their loads. On an H200 that came within 1% of the best of 39 swept
    configs for 8 of the 10 decode GEMMs of Llama-3.1-8B and Qwen2.5-1.5B (within 4% and 5% for Qwen's lm_head and
    gate/up), and took 9% less GEMM time per Llama decode step than W8A8_TILES, the one family with the least summed
    time on both an H100 and an H200 (H100: 3% less; benchmarks/NOTES_rollout.md "W8A8 tiles by width").
    Interpreter: 16-wide tiles, so small test shapes cross tiles, splits and edges.
    """
    if device.type != "cuda":
        return Fp8LinearConfig(block_m=16, block_n=16, block_k=16, split_k=min(3, triton.cdiv(K, 16)))
    sms = sm_count(device)
    if not fp8_x:
        return config_for(M, N, K, sms, **GPU_TILES)
    return config_for(M, N, K, sms, **w8a8_tiles(M, N, sms, max_shared(device)))


def w8a8_tiles(M: int, N: int, sms: int, max_shared: int) -> dict:
    """W8A8's tile family for y [M, N] on a card of `sms` SMs and `max_shared` bytes of shared memory per block."""
    block = W8A8_NARROW_TILES["block_n"]  # every family's block_n, and the rows of a tile (block_m <= 64)
    tiles = triton.cdiv(N, block) * triton.cdiv(M, block)
    if tiles > sms:
        return W8A8_WIDE_TILES
    return W8A8_NARROW_TILES if max_shared >= W8A8_NARROW_SHARED else W8A8_TILES


def config_for(M: int, N: int, K: int, sms: int, block_n: int, block_k: int, programs_per_sm: int,
               num_warps: int, num_stages: int, max_block_m: int = 64) -> Fp8LinearConfig:
    """A GPU config with as many K splits as fill `programs_per_sm` x `sms` programs (at least one, and none
    shorter than two K steps), row tiles of up to max_block_m rows."""
    block_m = min(max_block_m, max(16, triton.next_power_of_2(M)))
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    split = max(1, min(programs_per_sm * sms // tiles, K // (2 * block_k)))
    return Fp8LinearConfig(block_m, block_n, block_k, split, num_warps, num_stages)


def split_plan(kernel: str, M: int, N: int, K: int, config: Fp8LinearConfig) -> tuple[int, int, int]:
    """(K per split, splits, tiles) of a split-K launch of `config` for y [M, N] over K: each split a whole number of
    K steps (so only the last K step of the last split may be ragged: EVEN_K), and a ticket counter per tile."""
    k_per_split = triton.cdiv(triton.cdiv(K, config.split_k), config.block_k) * config.block_k
    split = triton.cdiv(K, k_per_split)
    tiles = triton.cdiv(N, config.block_n) * triton.cdiv(M, config.block_m)
    if split > 1 and tiles > MAX_TILES:
        raise ValueError(f"{kernel}: {tiles} tiles exceed the {MAX_TILES} split-K counters; use split_k=1")
    return k_per_split, split, tiles


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    """The split-K tickets of a device: zero between launches (each launch resets what it used)."""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def prepare(device: torch.device) -> None:
    """Allocate the device's counters now (outside any CUDA graph capture, whose pool would otherwise own them)."""
    _counters(device)


def fp8_linear_fwd(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    config: Fp8LinearConfig | None = None, x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    x_group: int | None = None,
) -> torch.Tensor:
    """x [M, K] (unit stride along K), weight [N, K] float8_e4m3fn contiguous, scale [N] fp32, bias [N] or None
    -> y [M, N] in x's dtype. W8A8: x float8_e4m3fn with x_scale [M] fp32, y in out_dtype; with x_group, x_scale
    [M, cdiv(K, x_group)] contiguous, a scale per row and group of x_group along K (each K step then within one
    group: the default config's block_k is cut to x_group, a given config's must divide it)."""
    M, K = x.shape
    N = weight.shape[0]
    if x_scale is not None and out_dtype is None:
        raise ValueError("fp8_linear_fwd: out_dtype: expected a 16- or 32-bit float dtype with e4m3 x, got None")
    interpret = _interpreting(x)
    if config is None:
        config = default_config(M, N, K, torch.device("cpu") if interpret else x.device, fp8_x=x_scale is not None)
        if x_group is not None:
            config = dataclasses.replace(config, block_k=min(config.block_k, x_group))
    if x_group is not None:
        if x_scale is None or x_scale.shape != (M, triton.cdiv(K, x_group)) or not x_scale.is_contiguous():
            raise ValueError(f"fp8_linear_fwd: x_scale: expected a contiguous [{M}, {triton.cdiv(K, x_group)}] "
                             f"scale per row and group of {x_group}, got {None if x_scale is None else x_scale.shape}")
        if x_group % config.block_k:
            raise ValueError(f"fp8_linear_fwd: x_group {x_group} is not a multiple of the config's block_k "
                             f"{config.block_k}: a K step would cross two groups' scales")
    k_per_split, split, tiles = split_plan("fp8_linear", M, N, K, config)
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    # without splits the kernel touches neither: any tensors of the right dtypes
    partial = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else scale
    counts = _counters(x.device)
    _fp8_linear_kernel[(tiles * split,)](
        x, weight, scale, bias if bias is not None else scale, y, partial, counts,
        x_scale if x_scale is not None else scale,
        x.stride(0), weight.stride(0), y.stride(0),
        M, N, K, k_per_split, split,
        HAS_BIAS=bias is not None, SPLIT=split > 1, EVEN_K=K % config.block_k == 0,
        FP32_DOT=interpret or x.dtype == torch.float32, FP8_X=x_scale is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        # Hopper's FP8 MMA keeps its sums to ~14 bits; Triton's default never adds them into a full fp32 total.
        # Every 128 of K (4 MMAs) is what torch._scaled_mm does without fast accumulation: the same error bound.
        PRECISE_EVERY=min(config.block_k, 128),
        X_GROUP=x_group or 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y
