"""Fused lm_head + log-probs and the GRPO loss through it, without ever holding [N, V] logits.

Rows are processed in chunks: one GEMM writes a chunk's logits into a [chunk, V] buffer, a row pass computes
logsumexp / log-prob / entropy, and where the gradient of the log-prob is already known (token-level GRPO: the
aggregation is linear in per-token losses, with weights known up front from the mask) a second row pass turns the
buffer in place into dL/dlogits, followed by the dH and dW GEMMs. Token-level GRPO is then 3 GEMMs in all (2 with a
frozen lm_head), computed in the forward and scaled by grad_output in the backward (Liger-style). Sequence-level
ratios need every log-prob of a sequence first: that costs a second pass (4 GEMMs). Masked rows cost no GEMM work.

The row passes are Triton kernels (backend "triton", fastgrpo.kernels.fused_linear) or eager PyTorch on one chunk
(backend "torch"); the chunk loop, the GEMMs and the autograd below are shared by both.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from fastgrpo._checks import check_choice, check_grpo_loss_args, check_index_range, check_linear_args
from fastgrpo.algorithms import aggregation_weights, grpo_per_token_loss

BACKENDS = ("auto", "triton", "torch")
# 7/8 GiB of bf16 logits is 2944 rows at V=151936. Bigger chunks are faster (the fp32 dW accumulator is read and
# written by every chunk's dW GEMM: ~1053 / rows of the dW GEMM's time on an H200) but cost memory: with 1 GiB the
# peak at H=1536 with a trained lm_head passed Liger's by 3-5 % from 16K tokens on (NOTES_fused_linear.md).
DEFAULT_CHUNK_BYTES = 7 << 27
_CHUNK_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("fastgrpo_chunk_rows", default=None)


@contextlib.contextmanager
def chunk_rows(rows: int | None) -> Iterator[None]:
    """Within the block, process `rows` rows per chunk (None: the default, DEFAULT_CHUNK_BYTES of logits).

    Memory beyond inputs and gradients is about rows * V * (2 bytes for bf16) plus the fp32 dW accumulator.
    """
    if rows is not None and (not isinstance(rows, int) or rows < 1):
        raise ValueError(f"rows: expected a positive int or None, got {rows!r}")
    token = _CHUNK_ROWS.set(rows)
    try:
        yield
    finally:
        _CHUNK_ROWS.reset(token)


def _rows_per_chunk(vocab: int, dtype: torch.dtype) -> int:
    rows = _CHUNK_ROWS.get()
    if rows is not None:
        return rows
    rows = DEFAULT_CHUNK_BYTES // (vocab * torch.tensor([], dtype=dtype).element_size())
    return max(128, rows // 128 * 128)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _as_float(softcap: float | None) -> float | None:
    """An int or numpy cap as a Python float: Triton would specialize an int 1 into a constant."""
    return None if softcap is None else float(softcap)


# --- Row passes over one chunk of logits (torch backend) -------------------------------------------------------


def _torch_row_stats(logits, bias, targets, inv_tau, softcap, with_entropy):
    """logits: [C, V] raw h W^T -> (lse [C], logp [C], entropy [C] or None) of z = (logits + bias) * inv_tau,
    soft-capped first when softcap is not None."""
    z, _ = _scaled_logits(logits, bias, inv_tau, softcap)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
    return lse, logp, entropy


def _torch_row_grad(logits, bias, targets, lse, entropy, grad_logp, grad_entropy, inv_tau, softcap):
    """Overwrite logits [C, V] with dL/d(logits) for dL/dlogp = grad_logp [C] (and dL/dentropy = grad_entropy)."""
    z, slope = _scaled_logits(logits, bias, inv_tau, softcap)
    probs = torch.exp(z - lse.unsqueeze(-1))
    dz = -grad_logp.unsqueeze(-1) * probs
    dz.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
    if grad_entropy is not None:
        # d entropy / dz_j = -p_j (z_j - E_p[z]), and E_p[z] = lse - entropy.
        dz -= grad_entropy.unsqueeze(-1) * probs * (z - (lse - entropy).unsqueeze(-1))
    if slope is not None:
        dz *= slope
    logits.copy_(dz * inv_tau)


def _scaled_logits(logits, bias, inv_tau, softcap):
    """(z, dz/d(logits) * tau): z = cap tanh((logits + bias) / cap) * inv_tau, the slope 1 - tanh^2 (None
    without a cap, where it is 1)."""
    z = logits.to(_acc_dtype(logits.dtype))
    if bias is not None:
        z = z + bias.to(z.dtype)
    if softcap is None:
        return z * inv_tau, None
    t = torch.tanh(z / softcap)
    return t * (softcap * inv_tau), 1.0 - t * t


@dataclass(frozen=True)
class _RowKernels:
    stats: Callable
    grad: Callable


def _row_kernels(backend: str) -> _RowKernels:
    if backend == "torch":
        return _RowKernels(_torch_row_stats, _torch_row_grad)
    from fastgrpo.kernels import fused_linear as kernels

    return _RowKernels(kernels.row_stats, kernels.row_grad)


def _resolve_backend(backend: str, device: torch.device) -> str:
    check_choice("backend", backend, BACKENDS)
    if backend == "auto":
        return "triton" if device.type == "cuda" and _has_triton() else "torch"
    if backend == "triton":
        if not _has_triton():
            raise ValueError("backend: 'triton' needs the triton package, which is not installed; use 'torch'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got device "
                f"{device.type}; use backend='torch' or 'auto'"
            )
    return backend


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


# --- The chunk loop shared by both backends ---------------------------------------------------------------------


@dataclass
class _Grads:
    """Gradients with respect to hidden [N, H], weight [V, H] (fp32 accumulator) and bias [V] (fp32), or None."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


def _addmm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc in fp32 (fp64) and a, b in the input dtype: no per-chunk [V, H] temporary."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)  # cuBLAS bf16 x bf16 -> fp32 C, beta = 1
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _chunk_loop(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    rows: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
    with_entropy: bool,
    kernels: _RowKernels,
    grad_fn: Callable | None = None,
    need_dhidden: bool = False,
    need_dweight: bool = False,
    need_dbias: bool = False,
):
    """Log-probs of the selected rows of hidden [N, H] (all rows when `rows` is None), chunk by chunk.

    targets: [n] ids of the selected rows. grad_fn(start, stop, logp [c]) -> (dL/dlogp [c], dL/dentropy [c] or
    None) for rows[start:stop]; when given, also returns the gradients of L.
    Returns (logp [n], entropy [n] or None, _Grads or None), logp/entropy in fp32 (fp64 for fp64 inputs).
    """
    N, H = hidden.shape
    V = weight.shape[0]
    n = N if rows is None else rows.numel()
    acc = _acc_dtype(hidden.dtype)
    inv_tau = 1.0 / temperature
    logp = torch.empty(n, dtype=acc, device=hidden.device)
    entropy = torch.empty(n, dtype=acc, device=hidden.device) if with_entropy else None
    grads = None
    if grad_fn is not None:
        grads = _Grads(
            hidden=torch.zeros_like(hidden) if need_dhidden else None,
            weight=torch.zeros(V, H, dtype=acc, device=hidden.device) if need_dweight else None,
            bias=torch.zeros(V, dtype=acc, device=hidden.device) if need_dbias else None,
        )
    chunk = min(_rows_per_chunk(V, hidden.dtype), max(n, 1))
    chunk = -(-n // -(-n // chunk)) if n else 1  # equal chunks: 8192 rows by <= 3456 -> 3 x 2731, not 2 x 3456 + 1280
    buffer = torch.empty(chunk, V, dtype=hidden.dtype, device=hidden.device)  # buffer: [chunk, V]
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        h = hidden[start:stop] if rows is None else hidden.index_select(0, rows[start:stop])  # h: [c, H]
        logits = buffer[: stop - start]
        torch.mm(h, weight.t(), out=logits)
        tgt = targets[start:stop]
        lse_c, logp_c, ent_c = kernels.stats(logits, bias, tgt, inv_tau, softcap, with_entropy)
        logp[start:stop] = logp_c
        if with_entropy:
            entropy[start:stop] = ent_c
        if grad_fn is None:
            continue
        grad_logp, grad_entropy = grad_fn(start, stop, logp_c)
        kernels.grad(logits, bias, tgt, lse_c, ent_c, grad_logp, grad_entropy, inv_tau, softcap)  # := dL/dlogits
        if grads.hidden is not None:
            if rows is None:
                torch.mm(logits, weight, out=grads.hidden[start:stop])
            else:
                grads.hidden.index_copy_(0, rows[start:stop], logits @ weight)
        if grads.weight is not None:
            _addmm_acc(grads.weight, logits.t(), h)
        if grads.bias is not None:
            grads.bias += logits.sum(0, dtype=acc)
    return logp, entropy, grads


def _finish_grads(grads: _Grads, weight: torch.Tensor, bias: torch.Tensor | None):
    """Cast the fp32 accumulators to the parameters' dtypes once, at the end."""
    dweight = None if grads.weight is None else grads.weight.to(weight.dtype)
    dbias = None if grads.bias is None else grads.bias.to(bias.dtype)
    return grads.hidden, dweight, dbias


# --- Log-probs --------------------------------------------------------------------------------------------------


class _LinearLogprobs(torch.autograd.Function):
    """hidden [N, H] -> (logp [N], entropy [N]); the backward recomputes each chunk's logits (3 GEMMs)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, with_entropy, kernels):
        ctx.set_materialize_grads(False)
        logp, entropy, _ = _chunk_loop(
            hidden, weight, bias, targets, None, temperature, softcap, with_entropy, kernels
        )
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.softcap, ctx.kernels = temperature, softcap, kernels
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return (None,) * 8
        acc = _acc_dtype(hidden.dtype)
        grad_logp = torch.zeros_like(targets, dtype=acc) if grad_logp is None else grad_logp.to(acc)
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(acc)

        def grad_fn(start, stop, _):
            return grad_logp[start:stop], None if grad_entropy is None else grad_entropy[start:stop]

        need = ctx.needs_input_grad
        _, _, grads = _chunk_loop(
            hidden, weight, bias, targets, None, ctx.temperature, ctx.softcap, grad_entropy is not None,
            ctx.kernels, grad_fn, *need[:3],
        )
        return (*_finish_grads(grads, weight, bias), None, None, None, None, None)


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    return_entropy: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax((hidden @ weight.T + bias) / temperature)[target_ids] without materializing the logits.

    hidden [..., H], weight [V, H], target_ids [...] -> fp32 log-probs [...] (and entropy [...] when asked),
    differentiable with respect to hidden, weight and bias (entropy too). softcap: the logits become
    softcap * tanh(logits / softcap) before the temperature (Gemma-2's final_logit_softcapping); None: no cap.
    backend: "auto" | "triton" | "torch".
    """
    check_linear_args(hidden, weight, bias, temperature, softcap)
    if target_ids.shape != hidden.shape[:-1]:
        raise ValueError(f"target_ids: expected shape {list(hidden.shape[:-1])}, got {list(target_ids.shape)}")
    check_index_range("target_ids", target_ids, weight.shape[0])
    kernels = _row_kernels(_resolve_backend(backend, hidden.device))
    shape = target_ids.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # hidden2d: [N, H]
    targets = target_ids.reshape(-1).contiguous()
    logp, entropy = _LinearLogprobs.apply(
        hidden2d, weight.contiguous(), bias, targets, temperature, _as_float(softcap), return_entropy, kernels
    )
    logp = logp.view(shape)
    return (logp, entropy.view(shape)) if return_entropy else logp


# --- GRPO loss --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LossConfig:
    beta: float
    epsilon_low: float
    epsilon_high: float | None
    delta: float | None
    loss_type: str
    importance_sampling_level: str
    temperature: float
    softcap: float | None
    max_completion_length: int | None
    num_items_in_batch: float | torch.Tensor | None
    return_entropy: bool


def _per_token_loss(cfg: _LossConfig, logps, mask, advantages, old_logps, ref_logps):
    return grpo_per_token_loss(
        logps, mask, advantages, old_logps, ref_logps, cfg.beta, cfg.epsilon_low, cfg.epsilon_high, cfg.delta,
        cfg.importance_sampling_level,
    )


def _grad_wrt_logps(cfg, logps, mask, advantages, old_logps, ref_logps, weights) -> torch.Tensor:
    """dL/dlogps through fastgrpo.algorithms (the single home of the formula): logps and the rest [R, S]."""
    with torch.enable_grad():
        logps = logps.detach().requires_grad_()
        per_token_loss = _per_token_loss(cfg, logps, mask, advantages, old_logps, ref_logps)[0]
        (grad,) = torch.autograd.grad((per_token_loss * weights).sum(), logps)
    return grad


def _grpo_forward(hidden, weight, bias, targets, mask, advantages, old_logps, ref_logps, cfg, kernels, need):
    """hidden [B, T, H] etc. -> (loss, metrics dict, (dhidden, dweight, dbias) or None)."""
    B, T, H = hidden.shape
    acc = _acc_dtype(hidden.dtype)
    m = mask.to(acc)  # m: [B, T]
    valid = m.reshape(-1).nonzero().squeeze(-1)  # valid: [n] row ids; masked rows cost no GEMM work
    # Masked positions get logp = old = ref = 0 (ratio 1, KL 0, weight 0): padding values can't turn into inf * 0.
    advantages = (advantages if advantages.dim() == 2 else advantages[:, None]).to(acc).expand(B, T)
    old = None if old_logps is None else torch.where(m.bool(), old_logps.to(acc), 0.0)
    ref = None if ref_logps is None else torch.where(m.bool(), ref_logps.to(acc), 0.0)
    weights = aggregation_weights(m, cfg.loss_type, cfg.max_completion_length, cfg.num_items_in_batch).to(acc)
    hidden2d, flat_targets = hidden.reshape(B * T, H), targets.reshape(-1)[valid]
    rows = None if valid.numel() == B * T else valid  # no mask: slices, no gather/scatter of hidden rows
    token_level = cfg.importance_sampling_level == "token"

    def valid_rows(t):  # [B, T] -> [1, n] over the valid rows
        return None if t is None else t.reshape(-1)[valid][None]

    adv_v, old_v, ref_v, w_v, m_v = (valid_rows(t) for t in (advantages, old, ref, weights, m))

    def token_grad_fn(start, stop, logp_c):
        sl = slice(start, stop)
        grad = _grad_wrt_logps(
            cfg, logp_c[None], m_v[:, sl], adv_v[:, sl], None if old_v is None else old_v[:, sl],
            None if ref_v is None else ref_v[:, sl], w_v[:, sl],
        )
        return grad[0], None

    any_grad = any(need)
    one_pass = token_level and any_grad
    logp_v, entropy_v, grads = _chunk_loop(
        hidden2d, weight, bias, flat_targets, rows, cfg.temperature, cfg.softcap, cfg.return_entropy, kernels,
        token_grad_fn if one_pass else None, *need,
    )
    logps = torch.zeros(B * T, dtype=acc, device=hidden.device).index_copy_(0, valid, logp_v).view(B, T)
    if any_grad and not token_level:
        grad_logps = _grad_wrt_logps(cfg, logps, m, advantages, old, ref, weights).reshape(-1)[valid]
        _, _, grads = _chunk_loop(
            hidden2d, weight, bias, flat_targets, rows, cfg.temperature, cfg.softcap, False, kernels,
            lambda start, stop, _: (grad_logps[start:stop], None), *need,
        )
    per_token_loss, per_token_kl, low, high = _per_token_loss(cfg, logps, m, advantages, old, ref)
    loss = (per_token_loss * weights).sum()
    count = m.sum().clamp(min=1.0)
    metrics = {"clip_ratio_low": (low * m).sum() / count, "clip_ratio_high": (high * m).sum() / count}
    metrics["clip_ratio"] = metrics["clip_ratio_low"] + metrics["clip_ratio_high"]
    if per_token_kl is not None:
        metrics["kl"] = (per_token_kl * m).sum() / count
    if entropy_v is not None:
        metrics["entropy"] = entropy_v.sum() / count
    if grads is None:
        return loss, metrics, None
    dhidden, dweight, dbias = _finish_grads(grads, weight, bias)
    return loss, metrics, (None if dhidden is None else dhidden.view(B, T, H), dweight, dbias)


class _GRPOLoss(torch.autograd.Function):
    """The gradients are formed in the forward; the backward only scales them by grad_output."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, mask, advantages, old_logps, ref_logps, cfg, kernels):
        need = ctx.needs_input_grad[:3]  # hidden, weight, bias (False for a bias that is None)
        loss, metrics, grads = _grpo_forward(
            hidden, weight, bias, targets, mask, advantages, old_logps, ref_logps, cfg, kernels, need
        )
        ctx.grads = grads
        values = [metrics[k] for k in sorted(metrics)]  # the order of _metric_names
        ctx.mark_non_differentiable(*values)
        return (loss, *values)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        # Handed over, not kept: autograd can then take them as .grad without a copy (0.43 GiB of dW at H=1536).
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(
                "fused_linear_grpo_loss: a second backward through the same loss (retain_graph=True) is not "
                "supported; its gradients are formed in the forward and handed over once"
            )
        if bool(grad_loss != 1.0):
            grads = tuple(None if g is None else g * grad_loss.to(g.dtype) for g in grads)
        return (*grads, *([None] * 7))


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    loss_type: str = "bnpo",
    importance_sampling_level: str = "token",
    temperature: float = 1.0,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    return_entropy: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of hidden [B, T, H] through lm_head weight [V, H]; same arguments and results as
    fastgrpo.reference.grpo_loss, in chunks of rows (see `chunk_rows`), never materializing [B, T, V].

    Returns (loss, metrics): `clip_ratio`, `clip_ratio_low`, `clip_ratio_high`, `kl` (beta > 0), `entropy` (when
    asked). old_logps=None is on-policy. Gradients reach hidden, weight (skipped when frozen) and bias.
    softcap: soft-cap the logits before the temperature, as fused_linear_logprobs.
    """
    check_grpo_loss_args(
        hidden, weight, target_ids, completion_mask, advantages, old_logps, ref_logps, beta, loss_type,
        importance_sampling_level, max_completion_length, temperature, bias, softcap,
    )
    kernels = _row_kernels(_resolve_backend(backend, hidden.device))
    cfg = _LossConfig(
        beta, epsilon_low, epsilon_high, delta, loss_type, importance_sampling_level, temperature, _as_float(softcap),
        max_completion_length, num_items_in_batch, return_entropy,
    )
    args = (hidden.contiguous(), weight.contiguous(), bias, target_ids, completion_mask, advantages.detach())
    logps = tuple(None if t is None else t.detach() for t in (old_logps, ref_logps))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        loss, *values = _GRPOLoss.apply(*args, *logps, cfg, kernels)
        names = _metric_names(beta, return_entropy)
        return loss, dict(zip(names, values))
    loss, metrics, _ = _grpo_forward(*args, *logps, cfg, kernels, (False, False, False))
    return loss, metrics


def _metric_names(beta: float, return_entropy: bool) -> list[str]:
    names = ["clip_ratio", "clip_ratio_high", "clip_ratio_low"]
    if beta != 0.0:
        names.append("kl")
    if return_entropy:
        names.append("entropy")
    return sorted(names)


__all__ = ["fused_linear_logprobs", "fused_linear_grpo_loss", "chunk_rows"]
