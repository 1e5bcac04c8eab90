"""AdamW steps in Triton, in fp32, with stochastic rounding of bf16 results: one tensor per launch (adamw_step_),
or many (adamw_multi_tensor_step_).

Why: at lr 1e-6 an AdamW step moves a weight by about 1e-6, less than half a bf16 ulp of any weight above 2^-12,
so round-to-nearest drops the whole update and a bf16 model does not train. Rounding up or down at random, with
the probability that makes the expected result exact, keeps the update on average. The step reads param, grad,
exp_avg and exp_avg_sq once and writes param and both moments once (14 bytes per bf16 element).

Many tensors per launch: a launch per tensor costs ~35 us of host time (Triton's launcher and the optimizer's
Python around it), and a model has hundreds of tensors: for Qwen2.5-1.5B's 338 an optimizer step took 14.6 ms of
host time with one launch per tensor, 3.5 ms with one per group, 3.1 ms for torch's fused AdamW (an H100,
benchmarks/results/adamw-nvidia-h100-80gb-hbm3.json).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _round_bf16_stochastic(x, bits):
    """fp32 x -> bf16, rounded away from zero with probability (|x| - lower neighbour) / spacing; NaN, inf kept."""
    # Adding r ~ U{0 .. 2^16 - 1} to x's bit pattern carries into bit 16 with probability low16(x) / 2^16, which is
    # where |x| lies between its two bf16 neighbours (the pattern is linear in |x| within a binade, and a carry
    # into the exponent gives the next binade's first value), so E[result] = x. NaN gets its quiet bit set instead,
    # so clearing the low bits keeps it a NaN; inf + r stays inf once cleared; no finite x overflows int32.
    xi = x.to(tl.int32, bitcast=True)
    xi = tl.where(x != x, xi | 0x400000, xi + (bits & 0xFFFF).to(tl.int32))
    return (xi & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _adamw_block(
    P, G, M, V, offs, mask,
    decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bias2_sqrt, eps, seed,
    STOCHASTIC: tl.constexpr,
):
    """The step on the elements `offs` (int64 indices within the tensor, so that Philox takes the same 64-bit
    counters in both kernels) of one tensor: the one body of both kernels, hence their bitwise equal results."""
    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    # torch.optim.AdamW (_single_tensor_adam, decoupled weight decay), each line its formula:
    p = p * decay  # param.mul_(1 - lr * weight_decay)
    m = m + one_minus_beta1 * (g - m)  # exp_avg.lerp_(grad, 1 - beta1)
    v = v * beta2 + one_minus_beta2 * g * g  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps  # (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    p = p - step_size * tl.div_rn(m, denom)  # param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if STOCHASTIC:
        bits_p, bits_m, bits_v, _ = tl.randint4x(seed, offs)  # Philox(seed, element index): reproducible
        tl.store(P + offs, _round_bf16_stochastic(p, bits_p), mask=mask)
        tl.store(M + offs, _round_bf16_stochastic(m, bits_m), mask=mask)
        tl.store(V + offs, _round_bf16_stochastic(v, bits_v), mask=mask)
    else:
        tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
        tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)
        tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(
    P, G, M, V,
    n, decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bias2_sqrt, eps, seed,
    BLOCK: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _adamw_block(P, G, M, V, offs, offs < n, decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bias2_sqrt,
                 eps, seed, STOCHASTIC)


def adamw_step_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    decay: float, beta1: float, beta2: float, step_size: float, bias2_sqrt: float, eps: float, seed: int,
) -> None:
    """One AdamW step in place. param (bf16 / fp16 / fp32), exp_avg and exp_avg_sq (param's dtype) contiguous, grad
    (any float dtype) of param's shape. decay = 1 - lr * weight_decay, step_size = lr / (1 - beta1^step), bias2_sqrt
    = sqrt(1 - beta2^step). bf16 results are rounded stochastically from Philox(seed, element index), others to
    nearest. seed must lie in [2^62, 2^63) so that it is always an int64 argument (no recompile per value)."""
    n = param.numel()
    if n == 0:
        return
    # 1024 elements per program on a GPU (memory-bound); up to 64K under the interpreter, whose cost is per program.
    block = min(1 << 16, triton.next_power_of_2(n)) if os.environ.get("TRITON_INTERPRET") == "1" else 1024
    _adamw_kernel[(triton.cdiv(n, block),)](
        param, grad.contiguous(), exp_avg, exp_avg_sq,
        n, decay, 1.0 - beta1, beta2, 1.0 - beta2, step_size, bias2_sqrt, eps, seed,
        BLOCK=block, STOCHASTIC=param.dtype == torch.bfloat16,
    )


# Many tensors in one launch, one BLOCK of one tensor per program (grid = all tensors' blocks). The host sends one
# int64 table: each tensor's first program (ascending), then _FIELDS values per tensor; a program finds its tensor by
# a binary search over the first column. Why not the earlier 64K-element chunk per program, stepped 1024 elements at
# a time: each pass of that loop waited for its own loads (nothing else in flight in the program), and on an H100 it
# ran Qwen2.5-1.5B's step at 1.18 TB/s against 1.56 for one launch per tensor of 1024-element programs (18.3 vs 13.8
# ms, benchmarks/NOTES.md). One block per program is that per-tensor kernel's work and schedule, plus ~log2(tensors)
# dependent loads of a table of a few KiB (9 for Qwen's 338 tensors, L1 hits after the first program on an SM). A
# table row per block instead would cost 12 MB per step for Qwen (1.5M blocks) and its host-to-device copy.
BLOCK = 1024
_FIELDS = tl.constexpr(6)  # param, grad, exp_avg, exp_avg_sq addresses; numel; Philox seed
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
              torch.float64: tl.float64}


@triton.jit(do_not_specialize=["tensors"])
def _adamw_multi_tensor_kernel(
    TABLE, tensors,
    decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bias2_sqrt, eps,
    P_TYPE: tl.constexpr, G_TYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    program = tl.program_id(0)
    # the last tensor whose first program is <= this one (TABLE[0] = 0): branch-free, the same steps in every program
    tensor = 0
    size = tensors
    while size > 1:
        half = size // 2
        tensor = tl.where(tl.load(TABLE + tensor + half) <= program, tensor + half, tensor)
        size -= half
    row = TABLE + tensors + _FIELDS * tensor
    # Addresses arrive as integers: the compiler knows nothing of their alignment, and without it loads go one
    # element at a time. The host checks 16 bytes (a 128-bit access) and says so through ALIGNED.
    P = tl.load(row).to(tl.pointer_type(P_TYPE))
    G = tl.load(row + 1).to(tl.pointer_type(G_TYPE))
    M = tl.load(row + 2).to(tl.pointer_type(P_TYPE))
    V = tl.load(row + 3).to(tl.pointer_type(P_TYPE))
    if ALIGNED:
        P, G, M, V = tl.multiple_of(P, 16), tl.multiple_of(G, 16), tl.multiple_of(M, 16), tl.multiple_of(V, 16)
    n, seed = tl.load(row + 4), tl.load(row + 5)
    start = (program - tl.load(TABLE + tensor)) * BLOCK  # int64, a multiple of BLOCK the compiler can see
    offs = start + tl.arange(0, BLOCK)
    # A whole block's mask is uniform over BLOCK (its bound a visible multiple of BLOCK), so its accesses stay 128-bit
    # wide; `offs < n` splits them into single elements (n's divisibility is unknown): only a tensor's last partial
    # block takes it. Two ifs, not if / else: with an else, Triton 3.9 made both branches scalar (sm_90 PTX).
    if start + BLOCK <= n:
        _adamw_block(P, G, M, V, offs, offs < start + BLOCK, decay, one_minus_beta1, beta2, one_minus_beta2,
                     step_size, bias2_sqrt, eps, seed, STOCHASTIC)
    if start + BLOCK > n:
        _adamw_block(P, G, M, V, offs, offs < n, decay, one_minus_beta1, beta2, one_minus_beta2, step_size,
                     bias2_sqrt, eps, seed, STOCHASTIC)


def adamw_multi_tensor_step_(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], seeds: list[int], *,
    decay: float, beta1: float, beta2: float, step_size: float, bias2_sqrt: float, eps: float,
    block: int | None = None,
) -> None:
    """adamw_step_ on every (param, grad, exp_avg, exp_avg_sq, seed) of the lists, with the same scalars for all:
    the same results bit for bit (the same body, Philox keyed by each tensor's seed and element index), in one
    launch per (device, param dtype, grad dtype, 16-byte alignment) instead of one per tensor. The tensors meet
    adamw_step_'s conditions on a single device each. See adamw_multi_tensor_launch_ for `block`."""
    launches: dict[tuple, tuple[list, list]] = {}
    for p, g, m, v, seed in zip(params, grads, exp_avgs, exp_avg_sqs, seeds, strict=True):
        if p.numel() == 0:
            continue
        g = g.contiguous()  # a copy, if any, lives in `launches` until its kernel is queued
        row = [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), seed]
        aligned = (row[0] | row[1] | row[2] | row[3]) % 16 == 0
        rows, keep = launches.setdefault((p.device, p.dtype, g.dtype, aligned), ([], []))
        rows.append(row)
        keep.append(g)
    for (device, p_dtype, g_dtype, aligned), (rows, _) in launches.items():
        adamw_multi_tensor_launch_(torch.tensor(rows, dtype=torch.int64), device, p_dtype, g_dtype, aligned,
                                   decay=decay, beta1=beta1, beta2=beta2, step_size=step_size,
                                   bias2_sqrt=bias2_sqrt, eps=eps, block=block)


def adamw_multi_tensor_launch_(
    rows: torch.Tensor, device: torch.device, p_dtype: torch.dtype, g_dtype: torch.dtype, aligned: bool, *,
    decay: float, beta1: float, beta2: float, step_size: float, bias2_sqrt: float, eps: float,
    block: int | None = None,
) -> None:
    """One launch for the tensors of `rows` (CPU int64 [tensors, 6]: param, grad, exp_avg, exp_avg_sq addresses on
    `device`, numel > 0, seed), all of p_dtype (grads g_dtype), all 16-byte aligned if `aligned`; the tensors must
    outlive the launch (stream order). block: elements per program, a power of two; default BLOCK on a GPU, up to
    64K under the interpreter, whose cost is per program and operation, not per element. The table is built with a
    few torch ops (no Python per tensor) and sent in one copy from pinned memory (torch's caching host allocator
    keeps a block until the copy that reads it is done)."""
    if block is None:
        block = BLOCK
        if os.environ.get("TRITON_INTERPRET") == "1":
            block = min(1 << 16, triton.next_power_of_2(int(rows[:, 4].max())))
    blocks = (rows[:, 4] + (block - 1)) // block
    ends = torch.cumsum(blocks, 0)
    tensors = len(rows)
    host = torch.empty(tensors * (1 + _FIELDS.value), dtype=torch.int64, pin_memory=device.type == "cuda")
    torch.cat([ends - blocks, rows.reshape(-1)], out=host)
    table = host.to(device, non_blocking=True)
    _adamw_multi_tensor_kernel[(int(ends[-1]),)](
        table, tensors, decay, 1.0 - beta1, beta2, 1.0 - beta2, step_size, bias2_sqrt, eps,
        P_TYPE=_TL_DTYPES[p_dtype], G_TYPE=_TL_DTYPES[g_dtype], ALIGNED=aligned, BLOCK=block,
        STOCHASTIC=p_dtype == torch.bfloat16,
    )
