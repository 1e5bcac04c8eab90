"""Decode attention (fastgrpo.ops.decode_attention) against the fp64 masked softmax: odd shapes, left padding,
any filled length, splits, the shared-prefix layout, and the engine's rollout with attention="triton".

Tolerance, derived per element (`bound`): bf16/fp16/fp32 inputs are exact in fp64, so the kernel's error comes from
(1) the output's rounding to the input dtype: one ulp of |ref| (the interpreter truncates instead of rounding);
(2) on a GPU, p rounded to v's dtype before p.v: half an ulp of each weight, at most eps/2 sum_j p_j |v_j|;
(3) fp32 arithmetic: a score's D-term dot carries ~(D + 2) 2^-24 sum|q_d k_d| scale, which moves the softmax
weights by twice that relatively; exp2 a few ulps; the sum over the M keys M 2^-24 sum_j p_j |v_j|.
Measured under the interpreter: bf16 errors reach ~0.6 of the bound, fp16 ~0.3, fp32 ~0.01 (worst-case sums).

An e4m3 V may be stored with its slots contiguous (the engine's cache does): same values, other loads, same bound.

FP8 K/V: the reference is the fp64 softmax over the same dequantized values (q_e4m3 x scale is exact in fp64), so
the bound is the kernel's own arithmetic: the terms above for the dequantized k/v, plus one fp32 rounding of each
score (key scale x softmax scale, then x the score) and one of each weight (p x value scale). For a 16-bit q its
dots run in fp16 (under the interpreter too): q scaled by a power of two loses at most 2^-25 of it below fp16's
normals, and the weights round to fp16 (2^-11, not (2)'s bf16 2^-8) or, below its normals, by 2^-25 of the tile's
largest value scale (`bound` spells both out). The quantization itself (quantize_kv) has its own bound, half an e4m3
ulp per element (test_quantize_kv_error_bound).
"""
import functools
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.ops.decode_attention import (
    FP8,
    FP8_MAX,
    decode_attention,
    decode_attention_torch,
    dequantize_kv,
    quantize_kv,
)
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams
from tests.error_bounds import assert_within
from tests.sm90_compile import sm90_compile_output
from tests.test_rollout import PROMPTS, char_tokenizer, completions, tiny_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bound(ref, q, k, v, keep, scale, dtype, fp8=False):
    """Per-element error bound of the kernel's output vs the fp64 `ref` (see the module docstring); fp8: k, v are the
    dequantized e4m3 cache (the kernel read the e4m3 values and their scales)."""
    eps = torch.finfo(dtype).eps
    keep4 = keep[:, None, :, None]
    k = torch.where(keep4, k.double(), 0.0)  # only the keys the row reads
    v_kept = torch.where(keep4, v.double(), 0.0)
    # pv_abs: sum_j p_j |v_j|, the size of what p.v adds up, per output element (fp64)
    pv_abs = decode_attention_torch(q.double(), k, v_kept.abs(), keep, keep.new_tensor([keep.shape[-1]],
                                                                                     dtype=torch.long), scale)
    smax = (q.double().abs() @ k.abs().transpose(-1, -2)).amax(-1, keepdim=True) * abs(scale)  # [N, H, G, 1]
    D, M = q.shape[-1], keep.shape[-1]
    extra = 1 if fp8 else 0  # one more rounding per score and per weight
    fp32 = 2.0**-24 * pv_abs * (2 * (D + 2 + extra) * smax + M + 8 + extra)
    if dtype == torch.float32:
        p_round = q_round = 0.0
    elif fp8:  # fp16 dots over powers of two (the kernel's docstring)
        # q below 2^-14 of its row's power of two (<= max|q|): off by <= 2^-25 of it; a score by that times sum|k|,
        # which moves the weights by twice that relatively
        q_max = q.double().abs().amax(-1, keepdim=True)  # [N, H, G, 1]
        q_round = 2 * 2.0**-25 * q_max * k.abs().sum(-1).amax(-1)[:, :, None, None] * abs(scale) * pv_abs
        # a weight p v_scale / v_pow2 (v_pow2 <= the tile's largest v_scale, p <= 1, l >= 1) rounded to fp16: half
        # an ulp (2^-11) of it, or below 2^-14 at most 2^-25 v_pow2; v_scale |v_q| is |v|, v_pow2 448 <= max |v|
        n_kept = keep.sum(-1)[:, None, None, None]  # [N, 1, 1, 1]
        v_max = v_kept.abs().amax((-2, -1))[:, :, None, None]  # [N, H, 1, 1]
        p_round = 2.0**-11 * pv_abs + 2.0**-25 * n_kept * v_max
    else:
        p_round, q_round = eps / 2 * pv_abs, 0.0
    return eps * ref.abs() + torch.finfo(dtype).tiny + p_round + q_round + 2 * fp32


def make_cache(g, N, H, M, D, length, dtype, pad_fill):
    """Random left-padded rows: k/v [N, H, M, D] with NaN at slots >= length and `pad_fill` on the pads."""
    k = torch.randn(N, H, M, D, generator=g).to(dtype)
    v = torch.randn(N, H, M, D, generator=g).to(dtype)
    offset = torch.randint(0, length, (N,), generator=g)  # first real slot of each row
    slots = torch.arange(M)
    visible = (slots[None, :] >= offset[:, None]) & (torch.rand(N, M, generator=g) > 0.1)  # and some holes
    visible[:, length - 1] = True  # the query's own slot
    for t in (k, v):
        t[:, :, length:] = float("nan")  # never to be read
        t.masked_fill_(~visible[:, None, :, None] & (slots < length)[None, None, :, None], pad_fill)
    return k, v, visible


@given(
    N=st.integers(1, 4), H=st.integers(1, 3), G=st.integers(1, 5), D=st.sampled_from([16, 24, 32, 64]),
    M=st.integers(1, 70), length_frac=st.floats(0, 1), dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([None, 0.3, 1.7]), splits=st.sampled_from([None, 1, 2, 5]),
    pad_fill=st.sampled_from([float("nan"), 1e4]), seed=st.integers(0, 2**16),
)
def test_matches_fp64_reference(N, H, G, D, M, length_frac, dtype, scale, splits, pad_fill, seed):
    g = torch.Generator().manual_seed(seed)
    length = 1 + round(length_frac * (M - 1))
    q = torch.randn(N, H, G, D, generator=g).to(dtype)
    k, v, visible = make_cache(g, N, H, M, D, length, dtype, pad_fill)
    L = torch.tensor([length])
    got = decode_attention(q, k, v, visible, L, scale, splits=splits)
    s = D**-0.5 if scale is None else scale
    ref = decode_attention_torch(q.double(), k.double(), v.double(), visible, L, s)
    keep = visible & (torch.arange(M) < length)
    assert got.dtype == dtype and got.shape == q.shape
    assert_within(got, ref, bound(ref, q, k, v, keep, s, dtype), f"{dtype} N{N} H{H} G{G} D{D} M{M} len{length}")


@pytest.mark.parametrize("splits, length", [(1, 67), (2, 61)])
def test_running_max_across_tiles(splits, length):
    """Several tiles per split, keys growing along the sequence: each tile raises the running max, so the
    rescaling of what came before is exercised (random draws can leave every split one tile long)."""
    g = torch.Generator().manual_seed(1)
    N, H, G, D, M = 2, 1, 3, 16, 67
    q = torch.randn(N, H, G, D, generator=g) * 2
    k, v, visible = make_cache(g, N, H, M, D, length, torch.float32, float("nan"))
    k[:, :, :length] += torch.linspace(0, 2, length)[:, None] * q.mean(2, keepdim=True)  # later keys score higher
    L = torch.tensor([length])
    got = decode_attention(q, k, v, visible, L, splits=splits)
    ref = decode_attention_torch(q.double(), k.double(), v.double(), visible, L)
    keep = visible & (torch.arange(M) < length)
    assert_within(got, ref, bound(ref, q, k, v, keep, D**-0.5, torch.float32), f"splits {splits}")


@given(
    B=st.integers(1, 3), S=st.integers(1, 4), H=st.integers(1, 2), G=st.integers(1, 4), D=st.sampled_from([16, 32]),
    P=st.integers(1, 40), M=st.integers(1, 40), length_frac=st.floats(0, 1), splits=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**16),
)
def test_shared_prefix_equals_unshared(B, S, H, G, D, P, M, length_frac, splits, seed):
    """The prefix kernel on (prefix once per group, suffix per row) == the plain kernel on each row's whole keys."""
    g = torch.Generator().manual_seed(seed)
    N, length = B * S, 1 + round(length_frac * (M - 1))
    q = torch.randn(N, H, G, D, generator=g)
    pk, pv = torch.randn(B, H, P, D, generator=g), torch.randn(B, H, P, D, generator=g)
    pvis = torch.arange(P)[None, :] >= torch.randint(0, P + 1, (B, 1), generator=g)  # left-padded prompts
    k, v, visible = make_cache(g, N, H, M, D, length, torch.float32, float("nan"))
    L = torch.tensor([length])
    shared = decode_attention(q, k, v, visible, L, prefix_k=pk, prefix_v=pv, prefix_visible=pvis, splits=splits)
    # unshared: every row holds its prompt's copy, then its suffix; NaN stays past P + length
    fk = torch.cat([pk.repeat_interleave(S, 0), k], dim=2)
    fv = torch.cat([pv.repeat_interleave(S, 0), v], dim=2)
    fvis = torch.cat([pvis.repeat_interleave(S, 0), visible], dim=1)
    plain = decode_attention(q, fk, fv, fvis, torch.tensor([P + length]), splits=splits)
    ref = decode_attention_torch(q.double(), fk.double(), fv.double(), fvis, torch.tensor([P + length]))
    keep = fvis & (torch.arange(P + M) < P + length)
    tol = bound(ref, q, fk, fv, keep, D**-0.5, torch.float32)
    assert_within(shared, ref, tol, f"shared B{B} S{S} P{P} M{M} len{length}")
    assert_within(shared, plain.double(), 2 * tol, "shared vs plain")


def spread(g, *shape):
    """Log-normal magnitudes (e^(2 z)): vectors whose scales differ by orders, elements down into e4m3's subnormals."""
    return torch.exp(2 * torch.randn(*shape, generator=g))


@given(
    rows=st.integers(1, 40), D=st.sampled_from([1, 7, 16, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    exponent=st.integers(-30, 30), zero_rows=st.booleans(), seed=st.integers(0, 2**16),
)
def test_quantize_kv_error_bound(rows, D, dtype, exponent, zero_rows, seed):
    """Every element within half an e4m3 ulp of its magnitude (2^-4 |x|), or of the subnormal step (2^-10 scale)
    below e4m3's smallest normal, plus the fp32 rounding of x / scale (2^-24 relative, doubled for the margin of the
    cast's own rounding of it); scale = amax / 448 per vector; all-zero vectors stay exactly 0."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, D, generator=g) * spread(g, rows, D) * spread(g, rows, 1) * 2.0**exponent).to(dtype)
    if zero_rows:
        x[::3] = 0
    q, scale = quantize_kv(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (rows,)
    xd = x.double()
    amax = xd.abs().amax(-1)
    torch.testing.assert_close(scale.double(), torch.where(amax > 0, amax / FP8_MAX, 1.0), rtol=2**-23, atol=0)
    err = (dequantize_kv(q, scale, torch.float64) - xd).abs()
    tol = torch.maximum(xd.abs() * 2.0**-4, scale.double()[:, None] * 2.0**-10) + xd.abs() * 2.0**-22
    assert (err <= tol).all(), f"max err / bound {(err / tol).max():.4f}"


def test_quantize_kv_bound_is_reached():
    """The bound is not slack: among many draws some element sits next to a rounding midpoint."""
    x = torch.randn(4096, 128, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_kv(x)
    err = (dequantize_kv(q, scale, torch.float64) - x.double()).abs()
    tol = torch.maximum(x.double().abs() * 2.0**-4, scale.double()[:, None] * 2.0**-10)
    assert 0.9 < (err / tol).max() <= 1


def fp8_cache(g, N, H, M, D, length, pad_fill):
    """make_cache's rows with magnitudes spread per slot, quantized: (k_q, v_q, k_scale, v_scale, visible); the NaN
    past `length` and on the pads (pad_fill) become NaN codes and scales, which the kernel must never load."""
    k, v, visible = make_cache(g, N, H, M, D, length, torch.float32, pad_fill)
    kq, ks = quantize_kv(k * spread(g, N, H, M, 1))
    vq, vs = quantize_kv(v * spread(g, N, H, M, 1))
    return kq, vq, ks, vs, visible


def slot_major(v):
    """v [.., M, D] with the same values stored [.., D, M] (its slots contiguous), as the engine's e4m3 V."""
    return v.transpose(-1, -2).contiguous().transpose(-1, -2)


@given(
    N=st.integers(1, 4), H=st.integers(1, 3), G=st.integers(1, 5), D=st.sampled_from([16, 24, 32, 64]),
    M=st.integers(1, 70), length_frac=st.floats(0, 1), dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([None, 0.3]), splits=st.sampled_from([None, 1, 2, 5]),
    pad_fill=st.sampled_from([float("nan"), 1e4]), v_slot_major=st.booleans(), seed=st.integers(0, 2**16),
)
def test_fp8_cache_matches_fp64_reference(N, H, G, D, M, length_frac, dtype, scale, splits, pad_fill, v_slot_major,
                                          seed):
    g = torch.Generator().manual_seed(seed)
    length = 1 + round(length_frac * (M - 1))
    q = torch.randn(N, H, G, D, generator=g).to(dtype)
    kq, vq, ks, vs, visible = fp8_cache(g, N, H, M, D, length, pad_fill)
    if v_slot_major:
        vq = slot_major(vq)
    L = torch.tensor([length])
    got = decode_attention(q, kq, vq, visible, L, scale, splits=splits, k_scale=ks, v_scale=vs)
    s = D**-0.5 if scale is None else scale
    ref = decode_attention_torch(q.double(), kq, vq, visible, L, s, k_scale=ks, v_scale=vs)
    keep = visible & (torch.arange(M) < length)
    k, v = dequantize_kv(kq, ks, torch.float64), dequantize_kv(vq, vs, torch.float64)
    assert got.dtype == dtype and got.shape == q.shape
    assert_within(got, ref, e4m3_bound(ref, q, k, v, vq, vs, keep, s, dtype),
                  f"fp8 {dtype} N{N} H{H} G{G} D{D} M{M} len{length}")


@given(
    B=st.integers(1, 3), S=st.integers(1, 4), H=st.integers(1, 3), G=st.integers(1, 4), D=st.sampled_from([16, 32]),
    P=st.integers(1, 40), M=st.integers(1, 40), length_frac=st.floats(0, 1), splits=st.sampled_from([None, 1, 3]),
    dtype=st.sampled_from(DTYPES), v_slot_major=st.booleans(), seed=st.integers(0, 2**16),
)
def test_fp8_shared_prefix_matches_fp64_reference(B, S, H, G, D, P, M, length_frac, splits, dtype, v_slot_major,
                                                  seed):
    """The prefix layout with e4m3 prefix and suffix: against the fp64 softmax over each row's dequantized keys."""
    g = torch.Generator().manual_seed(seed)
    N, length = B * S, 1 + round(length_frac * (M - 1))
    q = torch.randn(N, H, G, D, generator=g).to(dtype)
    pkq, pks = quantize_kv(torch.randn(B, H, P, D, generator=g) * spread(g, B, H, P, 1))
    pvq, pvs = quantize_kv(torch.randn(B, H, P, D, generator=g))
    pvis = torch.arange(P)[None, :] >= torch.randint(0, P + 1, (B, 1), generator=g)  # left-padded prompts
    kq, vq, ks, vs, visible = fp8_cache(g, N, H, M, D, length, float("nan"))
    L = torch.tensor([length])
    layout = slot_major if v_slot_major else (lambda v: v)
    got = decode_attention(q, kq, layout(vq), visible, L, prefix_k=pkq, prefix_v=layout(pvq), prefix_visible=pvis,
                           splits=splits, k_scale=ks, v_scale=vs, prefix_k_scale=pks, prefix_v_scale=pvs)
    # each row's whole keys in fp64: its prompt's then its own; NaN stays past P + length
    k = torch.cat([dequantize_kv(pkq, pks, torch.float64).repeat_interleave(S, 0),
                   dequantize_kv(kq, ks, torch.float64)], dim=2)
    v = torch.cat([dequantize_kv(pvq, pvs, torch.float64).repeat_interleave(S, 0),
                   dequantize_kv(vq, vs, torch.float64)], dim=2)
    fvis = torch.cat([pvis.repeat_interleave(S, 0), visible], dim=1)
    ref = decode_attention_torch(q.double(), k, v, fvis, torch.tensor([P + length]))
    keep = fvis & (torch.arange(P + M) < P + length)
    all_vq = torch.cat([pvq.repeat_interleave(S, 0), vq], dim=2)
    all_vs = torch.cat([pvs.repeat_interleave(S, 0), vs], dim=2)
    assert_within(got, ref, e4m3_bound(ref, q, k, v, all_vq, all_vs, keep, D**-0.5, dtype, S),
                  f"fp8 shared {dtype} B{B} S{S} P{P} M{M} len{length}")


def e4m3_bound(ref, q, k, v, vq, vs, keep, scale, dtype, S=1):
    """The op's e4m3-cache path (ops/decode_attention.py): fp8_dots for a 16-bit q where fp8_dots_pay at the
    program's S x G rows, else the fp16 dots (fp32 dots for an fp32 q)."""
    from fastgrpo.kernels.decode_attention import fp8_dots_pay

    if dtype == torch.float32 or not fp8_dots_pay(S * q.shape[2], q.shape[3]):
        return bound(ref, q, k, v, keep, scale, dtype, fp8=True)
    return fp8_dots_bound(ref, q, k, v, vq, vs, keep, scale)


def fp8_dots_bound(ref, q, k, v, vq, vs, keep, scale, split=False):
    """Per-element bound of fp8_dots' output vs the fp64 `ref` over the dequantized cache (the kernel's docstring).
    q rounded to e4m3 per row moves score j by at most E_j = scale sum_d max(2^-4 |q_d|, 2^-10 q_scale) |k_jd| (half
    an e4m3 ulp, or half its subnormal step). Each normalized weight p_j e^(e_j) / sum_i p_i e^(e_i), |e_i| <= E_i,
    then lies within p_j [e^-E_j / Z+, e^E_j / Z-] (Z+- = sum_i p_i e^(+-E_i)): dp_j, and sum_j dp_j |v_j| bounds
    what the scores move. Each weight rounded to e4m3 adds 2^-4 of (p_j + dp_j) |v_j|, or below e4m3's normals 2^-10
    of the tile's v_pow2 / 128 times |v_q,j| (v_pow2 <= the row's largest v_scale, l >= 1); then fp32 arithmetic and
    the output's rounding as in `bound`. split (fp8_split): a second e4m3 part carries 16x what each rounding
    dropped, so q and the weights are off by 2^-4 of that remainder: 2^-8 relative, and the subnormal terms 2^-4 of
    theirs (2^-14 q_scale; 2^-21 for the weights)."""
    rel, q_sub, w_sub = (2.0**-8, 2.0**-14, 2.0**-21) if split else (2.0**-4, 2.0**-10, 2.0**-17)
    keep4 = keep[:, None, :, None]
    k = torch.where(keep4, k, 0.0)
    v_abs = torch.where(keep4, v, 0.0).abs()
    qd = q.double()
    q_scale = qd.abs().amax(-1, keepdim=True) / FP8_MAX
    q_err = torch.maximum(qd.abs() * rel, q_scale * q_sub)  # [N, H, G, D]
    E = (q_err @ k.abs().transpose(-1, -2) * abs(scale)).clamp_max(700)  # [N, H, G, M]; e^700 stays finite
    s = (qd @ k.transpose(-1, -2) * scale).masked_fill(~keep[:, None, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num()  # [N, H, G, M]; a row with no key: 0
    z_lo, z_hi = (p * torch.exp(-E)).sum(-1, keepdim=True), (p * torch.exp(E)).sum(-1, keepdim=True)
    # in logs: a key of weight 0 (masked, or underflowed) beside an E whose e^E overflows gives 0 here, not 0 x inf
    log_p, log_lo, log_hi = torch.log(p), torch.log(z_lo.clamp_min(1e-300)), torch.log(z_hi.clamp_min(1e-300))
    dp = torch.maximum(torch.exp(log_p + E - log_lo) - p, p - torch.exp(log_p - E - log_hi))
    pv_abs = p @ v_abs  # [N, H, G, D]
    scores = dp @ v_abs
    vs_max = torch.where(keep[:, None, :], vs.double(), 0.0).amax(-1)[:, :, None, None]
    vq_sum = torch.where(keep4, vq.double().abs(), 0.0).sum(-2)[:, :, None, :]  # [N, H, 1, D]
    weights = rel * (pv_abs + scores) + w_sub * vs_max * vq_sum
    n = keep.sum(-1)[:, None, None, None].clamp_min(1)
    smax = (qd.abs() @ k.abs().transpose(-1, -2)).amax(-1, keepdim=True) * abs(scale)
    fp32 = 2.0**-24 * (pv_abs + scores) * (2 * (q.shape[-1] + 3) * smax + n + 9)
    eps = torch.finfo(q.dtype).eps
    return eps * ref.abs() + torch.finfo(q.dtype).tiny + scores + weights + 2 * fp32


@given(
    N=st.integers(1, 3), H=st.integers(1, 2), G=st.integers(1, 5), D=st.sampled_from([16, 24, 32, 64]),
    M=st.integers(1, 70), length_frac=st.floats(0, 1), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    splits=st.sampled_from([1, 3]), v_slot_major=st.booleans(), split=st.booleans(), seed=st.integers(0, 2**16),
)
def test_fp8_dots_match_fp64_within_their_rounding(N, H, G, D, M, length_frac, dtype, splits, v_slot_major, split,
                                                   seed):
    """fp8_dots (e4m3 q and weights on the FP8 tensor cores) against the fp64 softmax over the dequantized cache,
    within fp8_dots_bound. Measured under the interpreter: errors up to ~0.3 of it; with the interpreter's own e4m3
    conversion (the carry it drops) up to 1.8x it, and with a suffix tile read by every row of its group (the
    shared-prefix test below) 40x. On a GPU machine the kernel runs there (the interpreter is only set without one)."""
    from fastgrpo.kernels.decode_attention import decode_attention_fwd

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    length = 1 + round(length_frac * (M - 1))
    q = torch.randn(N, H, G, D, generator=g).to(dtype)
    kq, vq, ks, vs, visible = fp8_cache(g, N, H, M, D, length, float("nan"))
    if v_slot_major:
        vq = slot_major(vq)
    L, s = torch.tensor([length]), D**-0.5
    got = decode_attention_fwd(*(t.to(device) for t in (q, kq, vq, visible, L)), s, splits=splits,
                               k_scale=ks.to(device), v_scale=vs.to(device), fp8_dots=True, fp8_split=split).cpu()
    ref = decode_attention_torch(q.double(), kq, vq, visible, L, s, k_scale=ks, v_scale=vs)
    keep = visible & (torch.arange(M) < length)
    k, v = dequantize_kv(kq, ks, torch.float64), dequantize_kv(vq, vs, torch.float64)
    assert_within(got, ref, fp8_dots_bound(ref, q, k, v, vq, vs, keep, s, split),
                  f"fp8_dots {dtype} N{N} H{H} G{G} D{D} M{M} len{length} splits{splits} split{split}")


@given(
    N=st.integers(1, 3), H=st.integers(1, 2), G=st.integers(1, 5), D=st.sampled_from([16, 24, 32]),
    M=st.integers(1, 50), length_frac=st.floats(0, 1), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    splits=st.sampled_from([1, 3]), v_slot_major=st.booleans(), magnitude=st.sampled_from([2.0**-9, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_fp16_dots_over_an_fp8_cache_match_fp64(N, H, G, D, M, length_frac, dtype, splits, v_slot_major, magnitude,
                                                 seed):
    """The e4m3 cache's fp16 dots (fp8_dots off: the op's path where fp8_dots do not pay, past 64 rows or a head dim
    of 128, which no other CPU test reaches) against the fp64 softmax over the dequantized cache, within bound's
    fp8 branch. q of several magnitudes: its rows are divided by their power of two for the fp16 dots and the
    scores multiplied back."""
    from fastgrpo.kernels.decode_attention import decode_attention_fwd

    g = torch.Generator().manual_seed(seed)
    length = 1 + round(length_frac * (M - 1))
    q = (torch.randn(N, H, G, D, generator=g) * magnitude).to(dtype)
    kq, vq, ks, vs, visible = fp8_cache(g, N, H, M, D, length, float("nan"))
    if v_slot_major:
        vq = slot_major(vq)
    L, s = torch.tensor([length]), 0.3 / magnitude
    got = decode_attention_fwd(q, kq, vq, visible, L, s, splits=splits, k_scale=ks, v_scale=vs, fp8_dots=False)
    ref = decode_attention_torch(q.double(), kq, vq, visible, L, s, k_scale=ks, v_scale=vs)
    keep = visible & (torch.arange(M) < length)
    k, v = dequantize_kv(kq, ks, torch.float64), dequantize_kv(vq, vs, torch.float64)
    assert_within(got, ref, bound(ref, q, k, v, keep, s, dtype, fp8=True),
                  f"fp16 dots {dtype} N{N} H{H} G{G} D{D} M{M} len{length} splits{splits} |q| ~{magnitude}")


def test_fp8_split_is_within_a_bound_plain_fp8_dots_exceed():
    """The control: on 4 rows of 64 keys, fp8_dots without the split land outside the split's (16x tighter) bound
    and with it inside, so the second parts do reach the output and the split's bound can fail."""
    from fastgrpo.kernels.decode_attention import decode_attention_fwd

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(11)
    N, H, G, D, M = 4, 1, 4, 32, 64
    q = torch.randn(N, H, G, D, generator=g).bfloat16()
    kq, vq, ks, vs, visible = fp8_cache(g, N, H, M, D, M, float("nan"))
    L, s = torch.tensor([M]), D**-0.5
    args = [t.to(device) for t in (q, kq, slot_major(vq), visible, L)]
    ref = decode_attention_torch(q.double(), kq, vq, visible, L, s, k_scale=ks, v_scale=vs)
    keep = visible & (torch.arange(M) < M)
    k, v = dequantize_kv(kq, ks, torch.float64), dequantize_kv(vq, vs, torch.float64)
    tight = fp8_dots_bound(ref, q, k, v, vq, vs, keep, s, split=True)
    errs = {}
    for split in (False, True):
        got = decode_attention_fwd(*args, s, k_scale=ks.to(device), v_scale=vs.to(device), fp8_dots=True,
                                   fp8_split=split).cpu()
        errs[split] = ((got.double() - ref).abs() / tight).max().item()
    assert errs[True] <= 1 < errs[False], errs


def test_the_op_takes_fp8_dots_where_they_pay(monkeypatch):
    """ops.decode_attention passes fp8_dots for an e4m3 cache and a 16-bit q whose programs take GPU_TILES (up to 64
    rows x D 128: Llama's and Qwen's plain layout, and their shared prefix's 8 samples x 4 or 6 query heads), not for
    a taller shared-prefix program, a head dim of 256 or an fp32 q (test_fp8_dots_are_wgmma_exactly_where_they_pay
    checks the compile behind the rule)."""
    from fastgrpo.kernels import decode_attention as kernels

    seen = []
    real = kernels.decode_attention_fwd
    monkeypatch.setattr(kernels, "decode_attention_fwd",
                        lambda *a, fp8_dots=False, **kw: seen.append(fp8_dots) or real(*a, fp8_dots=fp8_dots, **kw))
    g = torch.Generator().manual_seed(0)
    for S, G, D, dtype, want in ((1, 4, 128, torch.bfloat16, True), (1, 6, 128, torch.float16, True),
                                 (8, 4, 128, torch.bfloat16, True), (8, 6, 128, torch.bfloat16, True),
                                 (16, 8, 128, torch.bfloat16, False), (1, 4, 256, torch.bfloat16, False),
                                 (1, 4, 128, torch.float32, False)):
        B, M = 2, 16
        q = torch.randn(B * S, 1, G, D, generator=g).to(dtype)
        kq, ks = quantize_kv(torch.randn(B * S, 1, M, D, generator=g))
        prefix = {}
        if S > 1:
            pk, pks = quantize_kv(torch.randn(B, 1, 4, D, generator=g))
            prefix = dict(prefix_k=pk, prefix_v=pk, prefix_visible=torch.ones(B, 4, dtype=torch.bool),
                          prefix_k_scale=pks, prefix_v_scale=pks)
        decode_attention(q, kq, kq, torch.ones(B * S, M, dtype=torch.bool), torch.tensor([M]), k_scale=ks,
                         v_scale=ks, **prefix)
        assert seen.pop() is want, (S, G, D, dtype)


@pytest.mark.parametrize("splits, split", [(1, False), (3, False), (3, True)])
def test_fp8_dots_with_a_shared_prefix(splits, split):
    """The prefix layout under fp8_dots: a prefix tile counts for every row of its group, a suffix tile for its
    sample's rows only (the transposed mask), against each row's whole keys in fp64, within fp8_dots_bound."""
    from fastgrpo.kernels.decode_attention import decode_attention_fwd

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    B, S, H, G, D, P, M, length = 2, 3, 2, 4, 32, 37, 40, 29
    N = B * S
    q = torch.randn(N, H, G, D, generator=g).bfloat16()
    pkq, pks = quantize_kv(torch.randn(B, H, P, D, generator=g) * spread(g, B, H, P, 1))
    pvq, pvs = quantize_kv(torch.randn(B, H, P, D, generator=g))
    pvis = torch.arange(P)[None, :] >= torch.tensor([[4], [11]])  # left-padded prompts
    kq, vq, ks, vs, visible = fp8_cache(g, N, H, M, D, length, float("nan"))
    L = torch.tensor([length])
    args = [t.to(device) for t in (q, kq, slot_major(vq), visible, L)]
    got = decode_attention_fwd(*args, D**-0.5, *(t.to(device) for t in (pkq, slot_major(pvq), pvis)), splits,
                               *(t.to(device) for t in (ks, vs, pks, pvs)), fp8_dots=True, fp8_split=split).cpu()
    k = torch.cat([dequantize_kv(pkq, pks, torch.float64).repeat_interleave(S, 0),
                   dequantize_kv(kq, ks, torch.float64)], dim=2)
    v = torch.cat([dequantize_kv(pvq, pvs, torch.float64).repeat_interleave(S, 0),
                   dequantize_kv(vq, vs, torch.float64)], dim=2)
    fvis = torch.cat([pvis.repeat_interleave(S, 0), visible], dim=1)
    ref = decode_attention_torch(q.double(), k, v, fvis, torch.tensor([P + length]), D**-0.5)
    keep = fvis & (torch.arange(P + M) < P + length)
    all_vq = torch.cat([pvq.repeat_interleave(S, 0), vq], dim=2)
    all_vs = torch.cat([pvs.repeat_interleave(S, 0), vs], dim=2)
    assert_within(got, ref, fp8_dots_bound(ref, q, k, v, all_vq, all_vs, keep, D**-0.5, split),
                  f"fp8_dots shared prefix splits{splits} split{split}")


def test_fp8_dots_need_an_e4m3_cache_and_a_16_bit_q():
    from fastgrpo.kernels.decode_attention import decode_attention_fwd

    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="fp8_dots: needs an e4m3 cache"):
        decode_attention_fwd(q, k, k, torch.ones(1, 4, dtype=torch.bool), torch.tensor([4]), 1.0, fp8_dots=True)
    with pytest.raises(ValueError, match="fp8_split: splits fp8_dots' operands; pass fp8_dots=True too"):
        decode_attention_fwd(q, k, k, torch.ones(1, 4, dtype=torch.bool), torch.tensor([4]), 1.0, fp8_split=True)


def by_v_layout(monkeypatch, attend) -> tuple[list[torch.Tensor], list[bool]]:
    """attend(layout) with V row-major, then slot-major: the outputs, and per layout whether the kernel's every V
    (the rows' own, the prefix's) took the unmasked whole-tile load."""
    from fastgrpo.kernels import decode_attention as kernels

    check = kernels._whole_v_tiles
    outs, flags = [], []
    for layout in (lambda v: v, slot_major):
        whole = []
        monkeypatch.setattr(kernels, "_whole_v_tiles", lambda *a: whole.append(check(*a)) or whole[-1])
        outs.append(attend(layout))
        flags.append(all(whole))
    return outs, flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_major_16_and_32_bit_v_whole_tiles_zero_the_hidden_slots(dtype, monkeypatch):
    """A slot-major V of q's dtype whose tiles all fit is loaded unmasked too: its hidden slots (NaN on the pads and
    past `length`) must be zeroed after the load, or 0 x NaN reaches the output. An e4m3 V cannot show it here:
    the interpreter widens e4m3's NaN code to 480, finite (test_gpu_realistic_fp8_decode checks it on a GPU)."""
    g = torch.Generator().manual_seed(5)
    N, H, G, D, M, length = 3, 2, 3, 32, 64, 45
    q = torch.randn(N, H, G, D, generator=g).to(dtype)
    k, v, visible = make_cache(g, N, H, M, D, length, dtype, float("nan"))
    L = torch.tensor([length])
    outs, flags = by_v_layout(monkeypatch, lambda layout: decode_attention(q, k, layout(v), visible, L, splits=2))
    assert flags == [False, True]
    assert torch.isfinite(outs[1]).all(), "a hidden slot's NaN reached the output"
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("with_prefix", [False, True])
def test_slot_major_v_whole_tiles_give_the_same_bits(with_prefix, monkeypatch):
    """A slot-major e4m3 V whose tiles all fit (M and P multiples of the tile, D its width) is loaded unmasked and
    its hidden slots zeroed after the load: NaN on the pads, past `length` and in the prefix's hidden slots changes
    nothing, and the output is the row-major V's, bit for bit (the same values reach the same dots)."""
    g = torch.Generator().manual_seed(3)
    N, H, G, D, M, length, B, P = 4, 2, 3, 32, 64, 50, 2, 32
    q = torch.randn(N, H, G, D, generator=g).bfloat16()
    kq, vq, ks, vs, visible = fp8_cache(g, N, H, M, D, length, float("nan"))
    prefix = {}
    if with_prefix:
        pkq, pks = quantize_kv(torch.randn(B, H, P, D, generator=g))
        pv = torch.randn(B, H, P, D, generator=g)
        pvis = torch.arange(P)[None, :] >= torch.tensor([[5], [9]])
        pv[~pvis[:, None, :, None].expand_as(pv)] = float("nan")
        pvq, pvs = quantize_kv(pv)
        prefix = dict(prefix_k=pkq, prefix_visible=pvis, prefix_k_scale=pks, prefix_v_scale=pvs)
    L = torch.tensor([length])
    outs, flags = by_v_layout(monkeypatch, lambda layout: decode_attention(
        q, kq, layout(vq), visible, L, k_scale=ks, v_scale=vs,
        **({**prefix, "prefix_v": layout(pvq)} if with_prefix else {})))
    assert flags == [False, True]  # the rows' own V, and the prefix's where there is one
    assert torch.isfinite(outs[1]).all() and torch.equal(outs[0], outs[1])
    # v_finite (the engine's zero-allocated cache): hidden slots are read as they are, so a finite value there
    # (448, e4m3's largest) changes nothing (the NaN above would reach the output on a GPU, see
    # test_gpu_realistic_fp8_decode; Triton 3.9's interpreter widens e4m3's NaN code to 480)
    def nan_to_448(t):
        return torch.where(t.float().isnan(), 448.0, t.float()).to(FP8)

    engine_v = dict(v=slot_major(nan_to_448(vq)),
                    **({**prefix, "prefix_v": slot_major(nan_to_448(pvq))} if with_prefix else {}))
    fast = decode_attention(q, kq, visible=visible, length=L, k_scale=ks, v_scale=vs, v_finite=True, **engine_v)
    assert torch.equal(fast, outs[0])


HOPPER_CHECK = """
import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastgrpo.kernels.decode_attention import _decode_attention_kernel as fn, FP8_DOTS_DEEP_TILES, tiles_for


def compile(kv, v_slot_major, block_r, block_d, has_prefix, write_out, fp8_dots=False, fp8_split=False, tiles=None):
    # pointers, strides and D aligned as a launch specializes them; a unit stride specialized to the constant 1: the
    # slots' for a slot-major V (the engine's, with V_FINITE), the dims' otherwise
    tiles = tiles or tiles_for(block_r, block_d, kv != "bf16")
    consts = dict(HAS_PREFIX=has_prefix, KV_FP8=kv != "bf16", FP8_DOTS=fp8_dots, FP8_SPLIT=fp8_split,
                  E4M3_BY_HAND=False, FP32_DOT=False, V_WHOLE_TILES=v_slot_major,
                  V_FINITE=v_slot_major, WRITE_OUT=write_out, BLOCK_R=block_r, BLOCK_N=tiles["block_n"],
                  BLOCK_D=block_d)
    for name in ("stride_vm", "stride_pvm") if v_slot_major else ("stride_vd", "stride_pvd"):
        consts[name] = 1
    pointers = {"Q": "*bf16", "O": "*bf16", "K": f"*{kv}", "V": f"*{kv}", "VIS": "*i1", "LENGTH": "*i64",
                "PK": f"*{kv}", "PV": f"*{kv}", "PVIS": "*i1",
                **dict.fromkeys(("KS", "VS", "PKS", "PVS", "M_OUT", "L_OUT", "ACC_OUT"), "*fp32")}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
            if name.startswith("stride") or name == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"]})


# Llama-3.1-8B's launch: 16 rows, D 128, one split (the kernel writes the output)
for kv, v_slot_major in (("bf16", False), ("fp8e4nv", False), ("fp8e4nv", True)):
    ptx = compile(kv, v_slot_major, 16, 128, False, True).asm["ptx"]
    print("ptx", kv, v_slot_major, ptx.count("ld.shared.b8"), ptx.count("ld.global"))
# the engine's e4m3 cache (slot-major V) with its dots in fp16 and on the FP8 tensor cores
for fp8_dots in (False, True):
    ptx = compile("fp8e4nv", True, 16, 128, False, True, fp8_dots).asm["ptx"]
    print("dots", fp8_dots, ptx.count("wgmma.mma_async"), ptx.count("mma.sync"), ptx.count("cvt.rn.f16x2.e4m3x2"))
# fp8_dots' deeper pipeline for 16-row programs on cards with the shared memory for it
deep = compile("fp8e4nv", True, 16, 128, False, True, True, tiles=FP8_DOTS_DEEP_TILES)
print("deep", deep.asm["ptx"].count("wgmma.mma_async"), deep.asm["ptx"].count("cvt.rn.f16x2.e4m3x2"),
      deep.metadata.shared)
# fp8_split: a second e4m3 dot beside each, still no conversion
ptx = compile("fp8e4nv", True, 16, 128, False, True, True, True).asm["ptx"]
print("split", ptx.count("wgmma.mma_async"), ptx.count("mma.sync"), ptx.count("cvt.rn.f16x2.e4m3x2"))
# the largest program of each TILES_BY_SIZE class, with a shared prefix and a bf16 cache (2 bytes, row-major V);
# over the engine's e4m3 cache, with the fp16 dots and fp8_dots: the largest program of GPU_TILES (to
# E4M3_GPU_TILES_UP_TO) and of the two TILES_BY_SIZE classes past it
for block_r, block_d in ((16, 128), (16, 256), (64, 128), (64, 256)):
    print("shared bf16", block_r, block_d, compile("bf16", False, block_r, block_d, True, False).metadata.shared)
for (block_r, block_d), fp8_dots in itertools.product(((64, 128), (32, 256), (64, 256)), (False, True)):
    kernel = compile("fp8e4nv", True, block_r, block_d, True, False, fp8_dots)
    print("shared e4m3" + "-fp8-dots" * fp8_dots, block_r, block_d, kernel.metadata.shared)
# fp8_dots in each class with its tiles (the engine's e4m3 cache, a shared prefix)
for block_r, block_d in ((16, 128), (16, 256), (32, 64), (32, 256), (64, 128), (64, 256)):
    ptx = compile("fp8e4nv", True, block_r, block_d, True, False, True).asm["ptx"]
    print("fp8wgmma", block_r, block_d, ptx.count("wgmma.mma_async"), ptx.count("cvt.rn.f16x2.e4m3x2"))
"""


@functools.cache
def hopper_check() -> list[list[str]]:
    """HOPPER_CHECK's printed lines, split (one compile run for the tests that read it)."""
    return [line.split() for line in sm90_compile_output(HOPPER_CHECK).strip().split("\n")]


def test_fp8_dots_run_on_the_fp8_tensor_cores_without_widening():
    """Compiled for sm_90 on the CPU: the engine's e4m3 cache with fp16 dots widens every e4m3 pair
    (cvt.rn.f16x2.e4m3x2) for 16-row mma.sync dots; fp8_dots' transposed dots (M: the tile's slots, then its dims)
    are e4m3 wgmma and convert nothing."""
    dots = {line[1] == "True": tuple(int(x) for x in line[2:]) for line in hopper_check() if line[0] == "dots"}
    (fp16_wgmma, fp16_mma, fp16_cvt), (fp8_wgmma, fp8_mma, fp8_cvt) = dots[False], dots[True]
    assert fp16_cvt > 0 and fp16_mma > 0 and fp16_wgmma == 0, dots
    assert fp8_wgmma > 0 and fp8_mma == 0 and fp8_cvt == 0, dots
    (split,) = [tuple(int(x) for x in line[1:]) for line in hopper_check() if line[0] == "split"]
    # fp8_split: twice the e4m3 wgmma; its only conversions widen the weights' first parts back to take what they
    # dropped (16 a tile at these tiles, against the fp16 dots' 128)
    assert split[:2] == (2 * fp8_wgmma, 0) and split[2] <= fp16_cvt / 8, (split, dots)


def test_fp8_dots_are_wgmma_exactly_where_they_pay():
    """Compiled for sm_90 on the CPU: fp8_dots' dots are e4m3 wgmma, converting nothing, in the programs that take
    GPU_TILES (fp8_dots_pay), and mma.sync widening e4m3 to fp16 in the others (2 warps: no warpgroup), where the op
    keeps the fp16 dots."""
    from fastgrpo.kernels.decode_attention import fp8_dots_pay

    found = {(int(r), int(d)): (int(w), int(c))
             for what, r, d, w, c in (line for line in hopper_check() if line[0] == "fp8wgmma")}
    assert len(found) == 6, found
    for (rows, D), (wgmma, cvt) in found.items():
        assert (wgmma > 0 and cvt == 0) if fp8_dots_pay(rows, D) else (wgmma == 0 and cvt > 0), (rows, D, found)
    # a shared prefix's 64 rows (Qwen2.5's 8 samples x 6) too (E4M3_GPU_TILES_UP_TO), not D 256
    assert fp8_dots_pay(16, 128) and fp8_dots_pay(64, 128) and not fp8_dots_pay(16, 256)


def test_slot_major_e4m3_v_reads_no_more_bytes_one_by_one_than_bf16():
    """Compiled for sm_90 on the CPU (Triton's ptxas, no GPU): a row-major e4m3 V's MMA operand is gathered from
    shared memory a byte at a time (188 single-byte loads per thread per tile, Triton 3.9), a slot-major one is not:
    its kernel has no more single-byte shared loads than the bf16 cache's (whose are the visibility mask's), and no
    more direct global loads (its tiles stream through cp.async: a V load left unpipelined shows as ~130 more). The
    interpreter cannot see this; without it an edit could bring the byte gathers back unnoticed."""
    counts = {(kv, major == "True"): (int(b8), int(glob))
              for what, kv, major, b8, glob in (line for line in hopper_check() if line[0] == "ptx")}
    bf16, row_major, slot_major = counts[("bf16", False)], counts[("fp8e4nv", False)], counts[("fp8e4nv", True)]
    assert slot_major[0] <= bf16[0] < row_major[0] and slot_major[1] <= bf16[1], counts


ADA_SHARED_BYTES = 99 * 1024  # the most shared memory one block may take on sm_86 / sm_89 cards


def test_every_tile_class_fits_an_ada_cards_shared_memory():
    """A program's shared memory grows with its rows x head dim and the tile: GPU_TILES at a shared prefix's 64 rows x
    D 256 needed 296 KB, past an H100's 227 too, so bigger programs take smaller tiles (TILES_BY_SIZE; over an e4m3
    cache, half the bytes, GPU_TILES up to E4M3_GPU_TILES_UP_TO). Compiled for sm_90 on the CPU: the largest program of each class
    stays within an Ada card's 99 KB, with either of an e4m3 cache's dots."""
    shared = {(cache, int(r), int(d)): int(b)
              for what, cache, r, d, b in (line for line in hopper_check() if line[0] == "shared")}
    assert len(shared) == 10 and all(b <= ADA_SHARED_BYTES for b in shared.values()), shared


def test_fp8_dots_deep_tiles_fit_the_cards_that_take_them():
    """FP8_DOTS_DEEP_TILES (a third stage) need more shared memory than an Ada card has, and no more than
    FP8_DOTS_DEEP_SHARED, from which launch_tiles takes them; their dots stay e4m3 wgmma (sm_90 compile on the CPU)."""
    from fastgrpo.kernels.decode_attention import FP8_DOTS_DEEP_SHARED

    (deep,) = [tuple(int(x) for x in line[1:]) for line in hopper_check() if line[0] == "deep"]
    wgmma, cvt, shared = deep
    assert wgmma > 0 and cvt == 0 and ADA_SHARED_BYTES < shared <= FP8_DOTS_DEEP_SHARED, deep


@pytest.mark.parametrize(("rows", "D", "fp8", "fp8_dots", "shared", "deep"), [
    (16, 128, True, True, 227 * 1024, True),  # Hopper: the plain layout's fp8_dots programs
    (16, 128, True, True, 128 * 1024, True),  # the least that takes them
    (16, 128, True, True, 128 * 1024 - 1, False),
    (16, 128, True, True, 99 * 1024, False),  # an Ada card: no room
    (16, 128, True, True, 0, False),  # off a GPU
    (64, 128, True, True, 227 * 1024, False),  # a shared prefix's taller programs: not timed
    (16, 256, True, True, 227 * 1024, False),  # head dim 256: smaller tiles than GPU_TILES already, a third stage not
    (16, 128, True, False, 227 * 1024, False),  # the fp16 dots: not timed
    (16, 128, False, False, 227 * 1024, False),  # a bf16 cache
])
def test_launch_tiles_take_the_deep_pipeline_only_where_timed_and_room(rows, D, fp8, fp8_dots, shared, deep):
    from fastgrpo.kernels.decode_attention import FP8_DOTS_DEEP_TILES, launch_tiles, program_blocks, tiles_for

    blocks = program_blocks(rows, D, fp8_dots)
    got = launch_tiles(*blocks, fp8, fp8_dots, shared)
    assert got is (FP8_DOTS_DEEP_TILES if deep else tiles_for(*blocks, fp8)), got


def test_engine_triton_attention_gives_sdpa_tokens():
    # qwen2_sliding: masks by layer type, one layer windowed (8 slots < prompt + completion); llama's single mask
    # tensor runs in the GPU test. 5 tokens: the interpreter takes ~0.3-0.6 s per layer and step.
    tok, model = char_tokenizer(), tiny_model("qwen2_sliding")
    params = SamplingParams(max_new_tokens=5, temperature=0)
    out = {
        name: generate_with_config(model, tok, PROMPTS, 2, params, config=EngineConfig(attention=name))
        for name in ("sdpa", "triton")
    }
    assert completions(out["triton"]) == completions(out["sdpa"])
    torch.testing.assert_close(out["triton"].logprobs, out["sdpa"].logprobs, atol=1e-4, rtol=0)


def test_torch_path_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3, 16, generator=g)
    k, v, visible = make_cache(g, 2, 2, 9, 16, 7, torch.float32, float("nan"))
    L = torch.tensor([7])
    torch.testing.assert_close(decode_attention(q, k, v, visible, L), decode_attention_torch(q, k, v, visible, L))


def test_group_size_traces_to_a_constant_under_a_dynamic_batch():
    """Compaction marks the batch dynamic (rollout/compaction.py). With a shared prefix the kernel wrapper's group
    size N // B was then symbolic, and sympy spent minutes per layer on the launch arithmetic's floor divisions over
    it (the GPU compaction test never finished its trace). rows_per_group traces to a constant: no division in the
    graph, and one graph for every batch of the same group size."""
    from fastgrpo.kernels.decode_attention import rows_per_group

    graphs = []

    def keep_code(gm, example_inputs):
        graphs.append(gm.code)
        return gm

    torch._dynamo.reset()
    step = torch.compile(lambda q, pk: q * rows_per_group(q.shape[0], pk.shape[0]), backend=keep_code,
                         fullgraph=True, dynamic=False)
    for B in (8, 4, 3):
        q, pk = torch.ones(4 * B, 2), torch.ones(B, 2)
        for t in (q, pk):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        assert torch.equal(step(q, pk), q * 4)
    torch._dynamo.reset()
    assert len(graphs) == 1 and "//" not in graphs[0] and "floordiv" not in graphs[0], graphs


def test_bad_input():
    q, kv = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 9, 16)
    visible, L = torch.ones(2, 9, dtype=torch.bool), torch.tensor([3])
    with pytest.raises(ValueError, match="visible"):
        decode_attention(q, kv, kv, visible[:, :8], L)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(q, kv.half(), kv, visible, L)
    with pytest.raises(ValueError, match="groups"):
        pk = torch.randn(3, 2, 4, 16)
        decode_attention(q, kv, kv, visible, L, prefix_k=pk, prefix_v=pk, prefix_visible=torch.ones(3, 4).bool())
    with pytest.raises(ValueError, match="attention"):
        EngineConfig(attention="flash")
    kq, ks = quantize_kv(kv)
    with pytest.raises(ValueError, match="dtype"):  # e4m3 without its scales
        decode_attention(q, kq, kq, visible, L)
    with pytest.raises(ValueError, match="dtype"):  # scales for a cache in q's dtype
        decode_attention(q, kv, kv, visible, L, k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="v_scale"):
        decode_attention(q, kq, kq, visible, L, k_scale=ks, v_scale=ks[:, :, :8])
    with pytest.raises(ValueError, match="splits: expected at least 1"):
        decode_attention(q, kv, kv, visible, L, splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("H, G", [(2, 6), (8, 4)])  # Qwen2.5-1.5B, Llama-3.1-8B
def test_gpu_realistic_decode(H, G):
    """64 rows (8 prompts x 8 samples), 1280 slots, 768 filled, bf16: within the bound, and no worse than SDPA in
    bf16 over the same slots; the shared-prefix layout (256-slot prompt) agrees too."""
    g = torch.Generator().manual_seed(0)
    N, M, D, length, P, S = 64, 1280, 128, 768, 256, 8
    q = torch.randn(N, H, G, D, generator=g).bfloat16()
    k, v, visible = make_cache(g, N, H, M, D, length, torch.bfloat16, float("nan"))
    q, k, v, visible, L = (t.cuda() for t in (q, k, v, visible, torch.tensor([length])))
    got = decode_attention(q, k, v, visible, L)
    ref = decode_attention_torch(q.double(), k.double(), v.double(), visible, L)
    keep = visible & (torch.arange(M, device="cuda") < length)
    assert_within(got, ref, bound(ref, q, k, v, keep, D**-0.5, torch.bfloat16), f"gpu H{H} G{G}")
    # SDPA multiplies every key, masked or not: the NaN of the unwritten slots must not reach it
    k0, v0 = (torch.where(keep[:, None, :, None], t, 0.0)[:, :, :length] for t in (k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k0, v0, attn_mask=keep[:, None, None, :length])
    assert (got.double() - ref).abs().max() <= 1.5 * (sdpa.double() - ref).abs().max() + 1e-3
    # shared prefix: the first P slots of the rows of each group of S made identical, then split off
    for t in (k, v):
        t[:, :, :P] = t[::S, :, :P].repeat_interleave(S, 0)
    visible[:, :P] = visible[::S, :P].repeat_interleave(S, 0)
    keep = visible & (torch.arange(M, device="cuda") < length)
    plain = decode_attention(q, k, v, visible, L)
    shared = decode_attention(q, k[:, :, P:], v[:, :, P:], visible[:, P:], L - P, prefix_k=k[::S, :, :P],
                              prefix_v=v[::S, :, :P], prefix_visible=visible[::S, :P])
    ref = decode_attention_torch(q.double(), k.double(), v.double(), visible, L)
    assert_within(shared, ref, bound(ref, q, k, v, keep, D**-0.5, torch.bfloat16), "gpu shared")
    assert_within(plain, ref, bound(ref, q, k, v, keep, D**-0.5, torch.bfloat16), "gpu plain, prefix layout")


@pytest.mark.gpu
def test_gpu_engine_triton_gives_sdpa_tokens():
    """On CUDA the decode step is compiled and replayed as a CUDA graph: the kernel must survive both."""
    tok, model = char_tokenizer(), tiny_model("qwen2").cuda()
    params = SamplingParams(max_new_tokens=24, temperature=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = {
            name: generate_with_config(model, tok, PROMPTS, 2, params, config=EngineConfig(attention=name))
            for name in ("sdpa", "triton")
        }
    fallbacks = [str(w.message) for w in caught if "rollout:" in str(w.message)]
    assert not fallbacks, fallbacks  # compile or graph capture failed: the kernel would run eagerly
    assert completions(out["triton"]) == completions(out["sdpa"])


@pytest.mark.gpu
@pytest.mark.parametrize("H, G", [(2, 6), (8, 4)])  # Qwen2.5-1.5B, Llama-3.1-8B
def test_gpu_realistic_fp8_decode(H, G):
    """test_gpu_realistic_decode's shapes with an e4m3 cache: within the bound of the dequantized values, in the
    plain and the shared-prefix layouts. The bound is fp8_dots': with keys spread over orders of magnitude, scores
    reach hundreds, so rounding q to e4m3 may move them by units and the bound is loose (the CPU test above holds
    the tight check); the layouts, masks and v_finite are what this one checks. Before the bound's log form (a
    masked key's 0 x e^E gave NaN) it failed on an H100 with a NaN bound, max error 3.8 (the interpreter's: 3.95)."""
    g = torch.Generator().manual_seed(0)
    N, M, D, length, P, S = 64, 1280, 128, 768, 256, 8
    q = torch.randn(N, H, G, D, generator=g).bfloat16()
    k, v, visible = make_cache(g, N, H, M, D, length, torch.float32, float("nan"))
    k = k * spread(g, N, H, M, 1)
    # shared prefix: the first P slots of the rows of each group of S made identical, then split off
    for t in (k, v):
        t[:, :, :P] = t[::S, :, :P].repeat_interleave(S, 0)
    visible[:, :P] = visible[::S, :P].repeat_interleave(S, 0)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    q, kq, vq, ks, vs, visible, L = (t.cuda() for t in (q, kq, vq, ks, vs, visible, torch.tensor([length])))
    keep = visible & (torch.arange(M, device="cuda") < length)
    ref = decode_attention_torch(q.double(), kq, vq, visible, L, k_scale=ks, v_scale=vs)
    kd, vd = dequantize_kv(kq, ks, torch.float64), dequantize_kv(vq, vs, torch.float64)
    tol = e4m3_bound(ref, q, kd, vd, vq, vs, keep, D**-0.5, torch.bfloat16)
    assert_within(decode_attention(q, kq, vq, visible, L, k_scale=ks, v_scale=vs), ref, tol, f"gpu fp8 H{H} G{G}")
    got = decode_attention(q, kq, slot_major(vq), visible, L, k_scale=ks, v_scale=vs)
    assert_within(got, ref, tol, f"gpu fp8 slot-major V H{H} G{G}")
    # the engine's path (v_finite: hidden slots read as they are): the same bits where they hold zeros, NaN where
    # they hold the NaN codes make_cache put there (so the flag does skip the zeroing)
    zeroed = slot_major(torch.where(keep[:, None, :, None], vq.float(), 0.0).to(FP8))
    engine = decode_attention(q, kq, zeroed, visible, L, k_scale=ks, v_scale=vs, v_finite=True)
    assert torch.equal(engine, got)
    assert not torch.isfinite(decode_attention(q, kq, slot_major(vq), visible, L, k_scale=ks, v_scale=vs,
                                               v_finite=True)).all()
    shared = decode_attention(
        q, kq[:, :, P:], vq[:, :, P:], visible[:, P:], L - P, prefix_k=kq[::S, :, :P], prefix_v=vq[::S, :, :P],
        prefix_visible=visible[::S, :P], k_scale=ks[:, :, P:], v_scale=vs[:, :, P:], prefix_k_scale=ks[::S, :, :P],
        prefix_v_scale=vs[::S, :, :P])
    shared_tol = e4m3_bound(ref, q, kd, vd, vq, vs, keep, D**-0.5, torch.bfloat16, S)  # S x G rows: the fp16 dots
    assert_within(shared, ref, shared_tol, f"gpu fp8 shared H{H} G{G}")
