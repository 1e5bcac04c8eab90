"""Decode attention for one query token per row: the Triton flash-decoding kernel, or plain torch on the CPU.

`decode_attention(q, k, v, visible, length, scale)` attends the G query rows of each K/V head (q [N, Hkv, G, D],
rollout/attention.py's layout) over the cache slots < length (a device tensor [1]: no host sync, so a CUDA graph
can replay the call) that `visible` marks. With `prefix_k/prefix_v/prefix_visible` the S = N // B rows of each group
share one prompt's K/V and the cache holds only their suffixes. No autograd: the rollout runs under no_grad.
`decode_attention_torch` is the eager masked softmax (any dtype; the tests run it in fp64).

FP8 K/V (EngineConfig.kv_cache="fp8"): k/v (and prefix_k/prefix_v) in float8_e4m3fn with `k_scale`/`v_scale` fp32
[N, Hkv, M] (prefix: [N // S, Hkv, P]), one per cached vector, so that k ~= k_q * k_scale[..., None]
(`quantize_kv` writes that format). Per (row, slot, head) and not per tensor: a scale fixed ahead would clip the rare
large keys of a new step or waste the 3 mantissa bits of the small ones, and a per-vector amax is computed from the
vector alone, at the step that writes it. fp32, not bf16: 4 bytes next to D (128) e4m3 bytes per vector, 3% of what
the kernel reads; bf16 would save half of that (~1.5%) and its rounded scale could push amax / scale past 448.
"""
from __future__ import annotations

import math

import torch

from fastgrpo._checks import check_dtype, check_shape
from fastgrpo.ops._backend import use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_kv(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """states [..., D] -> (e4m3 [..., D], fp32 scale [...]): scale = amax over D / 448, states ~= q * scale.

    Each element's error is at most half an e4m3 ulp at its magnitude: |x| 2^-4 for normals, and below the smallest
    normal (2^-6 scale) half the subnormal step of 2^-9 scale, so |error| <= max(|x| 2^-4, 2^-10 scale)."""
    x = states.float()
    scale = x.abs().amax(-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, 1.0)  # an all-zero vector: q = 0 whatever the scale, and no 0 / 0
    # |x| / scale <= 448 up to one fp32 rounding; the clamp keeps 448.00003 from depending on the cast's overflow rule
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] e4m3, scale [...] -> q * scale in `dtype` (exact in fp32 and fp64: 4 x 24 mantissa bits)."""
    return q.to(dtype) * scale.to(dtype)[..., None]


def decode_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, length: torch.Tensor,
    scale: float | None = None, prefix_k: torch.Tensor | None = None, prefix_v: torch.Tensor | None = None,
    prefix_visible: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, prefix_k_scale: torch.Tensor | None = None,
    prefix_v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T scale, masked) v in q's dtype (fp32 math for half types); a row with no visible key gives 0.
    With k_scale/v_scale (fp8 K/V) the keys and values are first dequantized in that math's dtype.

    Masked slots are replaced, not multiplied, so whatever they hold (NaN included) never reaches the output."""
    N, H, G, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    work = torch.promote_types(q.dtype, torch.float32)
    if k_scale is not None:
        k, v = dequantize_kv(k, k_scale, work), dequantize_kv(v, v_scale, work)
        if prefix_k is not None:
            prefix_k = dequantize_kv(prefix_k, prefix_k_scale, work)
            prefix_v = dequantize_kv(prefix_v, prefix_v_scale, work)
    keep = visible & (torch.arange(k.shape[2], device=k.device) < length.reshape(()))  # keep: [N, M]
    if prefix_k is not None:
        S = N // prefix_k.shape[0]
        k = torch.cat([prefix_k.repeat_interleave(S, dim=0), k], dim=2)
        v = torch.cat([prefix_v.repeat_interleave(S, dim=0), v], dim=2)
        keep = torch.cat([prefix_visible.repeat_interleave(S, dim=0), keep], dim=1)
    keep = keep[:, None, None, :]  # [N, 1, 1, M']
    k = torch.where(keep[:, :, 0, :, None], k.to(work), 0.0)
    v = torch.where(keep[:, :, 0, :, None], v.to(work), 0.0)
    scores = torch.where(keep, q.to(work) @ k.transpose(-1, -2) * scale, float("-inf"))  # [N, H, G, M']
    top = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(work).min)
    p = torch.exp(scores - top)
    total = p.sum(-1, keepdim=True)
    out = (p @ v) / torch.where(total > 0, total, 1.0)
    return out.to(q.dtype)


def _check_scales(shape: tuple, **scales: torch.Tensor) -> None:
    """An FP8 cache's scales: fp32, one per (row, slot, head) of the K/V they scale."""
    for name, t in scales.items():
        check_shape(name, t, shape)
        check_dtype(name, t, (torch.float32,))


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, length: torch.Tensor,
    scale: float | None = None, prefix_k: torch.Tensor | None = None, prefix_v: torch.Tensor | None = None,
    prefix_visible: torch.Tensor | None = None, splits: int | None = None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, prefix_k_scale: torch.Tensor | None = None,
    prefix_v_scale: torch.Tensor | None = None, v_finite: bool = False,
) -> torch.Tensor:
    """q [N, Hkv, G, D], k/v [N, Hkv, M, D], visible [N, M] bool, length [1] int -> [N, Hkv, G, D] in q's dtype.

    Reads cache slots < length only. Optional shared prefix: prefix_k/prefix_v [N // S, Hkv, P, D] and
    prefix_visible [N // S, P] for rows n*S..n*S+S-1; keys are the prefix's then the row's own cache slots.
    FP8 K/V: k/v (and prefix_k/prefix_v) float8_e4m3fn with k_scale/v_scale fp32 [N, Hkv, M] (and
    prefix_k_scale/prefix_v_scale [N // S, Hkv, P]), the module docstring's format.
    scale defaults to D^-0.5; splits (Triton only) overrides the number of key-range splits per (group, head).
    v_finite: the caller vouches that every slot of v and prefix_v holds a finite value, hidden or not (the engine's
    zero-allocated cache does); the kernel may then skip zeroing hidden slots it loads (kernels/decode_attention.py).
    Without it a hidden slot may hold anything, NaN included.
    """
    N, H, G, D = q.shape
    M = k.shape[2]
    fp8 = k_scale is not None
    check_dtype("q", q, _FLOATS)
    check_shape("k", k, (N, H, M, D))
    check_shape("v", v, (N, H, M, D))
    check_shape("visible", visible, (N, M))
    check_shape("length", length, (1,))
    kv_dtype = FP8 if fp8 else q.dtype
    if k.dtype != kv_dtype or v.dtype != kv_dtype:
        raise ValueError(f"decode_attention: k and v must have dtype {kv_dtype} (q is {q.dtype}, scales "
                         f"{'given' if fp8 else 'not given'}), got {k.dtype}, {v.dtype}")
    if fp8:
        _check_scales((N, H, M), k_scale=k_scale, v_scale=v_scale)
    if prefix_k is not None:
        B, P = prefix_k.shape[0], prefix_k.shape[2]
        if B == 0 or N % B:
            raise ValueError(f"decode_attention: {N} rows do not split into groups of prefix_k's {B} prompts")
        check_shape("prefix_k", prefix_k, (B, H, P, D))
        check_shape("prefix_v", prefix_v, (B, H, P, D))
        check_shape("prefix_visible", prefix_visible, (B, P))
        if prefix_k.dtype != kv_dtype or prefix_v.dtype != kv_dtype:
            raise ValueError(f"decode_attention: prefix_k and prefix_v must have dtype {kv_dtype} like k and v, got "
                             f"{prefix_k.dtype}, {prefix_v.dtype}")
        if fp8:
            _check_scales((B, H, P), prefix_k_scale=prefix_k_scale, prefix_v_scale=prefix_v_scale)
    if splits is not None and splits < 1:
        raise ValueError(f"splits: expected at least 1 (or None: the kernel's choice), got {splits}")
    scales = (k_scale, v_scale, prefix_k_scale, prefix_v_scale)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not use_triton(q, k, v, visible, length):
        return decode_attention_torch(q, k, v, visible, length, scale, prefix_k, prefix_v, prefix_visible, *scales)
    from fastgrpo.kernels.decode_attention import decode_attention_fwd, fp8_dots_pay, rows_per_group

    rows = G * (rows_per_group(N, prefix_k.shape[0]) if prefix_k is not None else 1)  # a program's: S x G
    unit = _unit_stride
    q, k, v, visible = unit(q), unit(k), unit(v, values=True), unit(visible)
    prefix_k, prefix_v, prefix_visible = unit(prefix_k), unit(prefix_v, values=True), unit(prefix_visible)
    return decode_attention_fwd(q, k, v, visible, length, scale, prefix_k, prefix_v, prefix_visible, splits,
                                *(unit(t) for t in scales), v_finite=v_finite,
                                fp8_dots=fp8 and q.dtype != torch.float32 and fp8_dots_pay(rows, D))


def _unit_stride(t: torch.Tensor | None, values: bool = False) -> torch.Tensor | None:
    """t with a unit-stride last dimension (the kernels' loads assume it), copied only where it is not; values
    [.., M, D] may have their slots contiguous instead (an e4m3 cache's V: kernels/decode_attention.py)."""
    if t is None or t.stride(-1) == 1 or (values and t.stride(-2) == 1):
        return t
    return t.contiguous()
