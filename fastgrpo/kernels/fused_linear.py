"""Row passes over one chunk of lm_head logits [C, V], the elementwise half of fastgrpo.ops.fused_linear.

`row_stats` reads each row once (online logsumexp, target logit, entropy accumulators); `row_grad` reads it once
more and overwrites it in place with dL/dlogits = (g (onehot(y) - p) - g_ent p (z - E_p[z])) / tau, in the
buffer's dtype. With a soft-cap (Gemma-2's final_logit_softcapping) z = cap tanh(logits / cap) / tau and
dL/dlogits carries the factor 1 - tanh^2, recomputed from the raw logits (no second [C, V] buffer); without one
the kernels compile as before (a constexpr flag). One program per row (rows on grid axis 0, never axis 1/2);
int64 row offsets since C * V passes 2^31 at 16K rows x V = 151936. Math in fp32 (fp64 for fp64 logits).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# 4096 lanes: 16-byte bf16 loads; the warp counts are the faster of 4 and 8 per pass, measured in
# benchmarks/NOTES_fused_linear.md. Under the CPU interpreter a small block makes the tests cross several blocks
# and a ragged tail with V <= 300.
BLOCK_V = 4096
STATS_WARPS = 4
GRAD_WARPS = 8
INTERPRET_BLOCK_V = 64


@triton.jit
def _softcap(x, cap):
    """(cap tanh(x / cap), 1 - tanh(x / cap)^2) from one exp and one division per element: tl has no tanh
    (libdevice's returns None under the interpreter). u = exp(-2|x| / cap) in [0, 1] cannot overflow, tanh(+-inf)
    = +-1, and 4u / (1 + u)^2 keeps the slope's relative precision where 1 - tanh^2 cancels. fp32 tanh: 1.2e-7
    absolute error (torch's 5.4e-8)."""
    u = tl.exp(tl.abs(x) * (-2.0 / cap))
    r = 1.0 / (1.0 + u)
    t = (1.0 - u) * r
    return cap * tl.where(x < 0, -t, t), 4.0 * u * r * r


@triton.jit
def _row_stats_kernel(
    logits_ptr, bias_ptr, target_ptr, lse_ptr, logp_ptr, entropy_ptr,
    stride_row, V, inv_tau, softcap,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr, ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    # One running max per row, not per lane: one exp per element (per-lane maxima need a second exp per element
    # to rescale, which made the stats pass bandwidth-starved: benchmarks/NOTES_fused_linear.md).
    m = tl.full((), float("-inf"), ACC)
    s = tl.zeros([BLOCK_V], ACC)  # per-lane sum of exp(z - m)
    t = tl.zeros([BLOCK_V], ACC)  # per-lane sum of exp(z - m) * z, for the entropy
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        inside = offs < V
        z = tl.load(base + offs, mask=inside, other=float("-inf")).to(ACC)
        if HAS_BIAS:
            z += tl.load(bias_ptr + offs, mask=inside, other=0.0).to(ACC)
        if SOFTCAP:  # the cap maps padding's -inf to -cap: padding is put back to -inf by position, not by value
            capped, _ = _softcap(z, softcap)
            z = tl.where(inside, capped, float("-inf"))
        z = z * inv_tau
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of only -inf: no -inf - -inf
        scale = tl.exp(m - m_safe)
        p = tl.exp(z - m_safe)
        s = s * scale + p
        if WITH_ENTROPY:
            t = t * scale + p * tl.where(z == float("-inf"), 0.0, z)  # padding and banned tokens add 0
        m = m_new
    total = tl.sum(s, axis=0)
    lse = m + tl.log(total)
    target = tl.load(target_ptr + row)
    z_target = tl.load(base + target).to(ACC)
    if HAS_BIAS:
        z_target += tl.load(bias_ptr + target).to(ACC)
    if SOFTCAP:
        z_target, _ = _softcap(z_target, softcap)
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, z_target * inv_tau - lse)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, lse - tl.sum(t, axis=0) / total)


@triton.jit
def _row_grad_kernel(
    logits_ptr, bias_ptr, target_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    stride_row, V, inv_tau, softcap,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, WITH_ENTROPY_GRAD: tl.constexpr, ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row).to(ACC)
    g = tl.load(grad_logp_ptr + row).to(ACC)
    target = tl.load(target_ptr + row)
    if WITH_ENTROPY_GRAD:
        g_ent = tl.load(grad_entropy_ptr + row).to(ACC)
        mean_z = lse - tl.load(entropy_ptr + row).to(ACC)  # E_p[z] = lse - entropy
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        inside = offs < V
        z = tl.load(base + offs, mask=inside, other=0.0).to(ACC)
        if HAS_BIAS:
            z += tl.load(bias_ptr + offs, mask=inside, other=0.0).to(ACC)
        if SOFTCAP:
            z, slope = _softcap(z, softcap)
        z = z * inv_tau
        p = tl.exp(z - lse)
        d = tl.where(offs == target, g, 0.0) - g * p
        if WITH_ENTROPY_GRAD:
            d -= g_ent * p * (tl.where(z == float("-inf"), 0.0, z) - mean_z)  # banned tokens: p = 0, not 0 x -inf
        if SOFTCAP:
            d *= slope
        tl.store(base + offs, (d * inv_tau).to(logits_ptr.dtype.element_ty), mask=inside)


def _meta(logits: torch.Tensor, num_warps: int) -> dict:
    interpret = os.environ.get("TRITON_INTERPRET") == "1" and not logits.is_cuda
    block = INTERPRET_BLOCK_V if interpret else min(BLOCK_V, triton.next_power_of_2(logits.shape[1]))
    acc = tl.float64 if logits.dtype == torch.float64 else tl.float32
    return {"ACC": acc, "BLOCK_V": block, "num_warps": num_warps}


def row_stats(logits, bias, targets, inv_tau, softcap, with_entropy):
    """logits: [C, V] raw h W^T, rows contiguous -> (lse [C], logp [C], entropy [C] or None) of
    z = (logits + bias) * inv_tau, soft-capped first when softcap is not None, in fp32 (fp64 for fp64 logits)."""
    C, V = logits.shape
    acc = torch.promote_types(logits.dtype, torch.float32)
    lse = torch.empty(C, dtype=acc, device=logits.device)
    logp = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if with_entropy else None
    if C:
        _row_stats_kernel[(C,)](
            logits, bias, targets, lse, logp, entropy, logits.stride(0), V, inv_tau, softcap,
            HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, WITH_ENTROPY=with_entropy,
            **_meta(logits, STATS_WARPS),
        )
    return lse, logp, entropy


def row_grad(logits, bias, targets, lse, entropy, grad_logp, grad_entropy, inv_tau, softcap):
    """Overwrite logits [C, V] in place with dL/dlogits, given dL/dlogp [C] (and dL/dentropy [C] or None)."""
    C, V = logits.shape
    if C:
        _row_grad_kernel[(C,)](
            logits, bias, targets, lse, entropy, grad_logp.contiguous(),
            None if grad_entropy is None else grad_entropy.contiguous(), logits.stride(0), V, inv_tau, softcap,
            HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, WITH_ENTROPY_GRAD=grad_entropy is not None,
            **_meta(logits, GRAD_WARPS),
        )
