"""One AdamW step on one tensor in Triton, in fp32, with stochastic rounding of bf16 results.

Why: at lr 1e-6 an AdamW step moves a weight by about 1e-6, less than half a bf16 ulp of any weight above 2^-12,
so round-to-nearest drops the whole update and a bf16 model does not train. Rounding up or down at random, with
the probability that makes the expected result exact, keeps the update on average. The step reads param, grad,
exp_avg and exp_avg_sq once and writes param and both moments once (14 bytes per bf16 element).
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
def _adamw_kernel(
    P, G, M, V,
    n, decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bias2_sqrt, eps, seed,
    BLOCK: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
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
