"""Fused lm_head + log-probs without ever holding [N, V] logits, and the chunk loop the fused GRPO loss runs on.

Rows are processed in chunks: one GEMM writes a chunk's logits into a [chunk, V] buffer, a row pass computes
logsumexp / log-prob / entropy, and where the gradient of the log-prob is already known (`grad_fn`, e.g. token-level
GRPO in fastgrpo.loss.fused) a second row pass turns the buffer in place into dL/dlogits, followed by the dH and dW
GEMMs. Masked rows cost no GEMM work (`rows`).

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

from fastgrpo._checks import check_choice, check_index_range, check_integer_ids, check_linear_args

BACKENDS = ("auto", "triton", "torch")
# 7/8 GiB of bf16 logits is 2944 rows at V=151936. Bigger chunks are faster (the fp32 dW accumulator is read and
# written by every chunk's dW GEMM) but cost memory; the measured trade-off is in benchmarks/NOTES_fused_linear.md.
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


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def as_float(softcap: float | None) -> float | None:
    """An int or numpy cap as a Python float: Triton would specialize an int 1 into a constant."""
    return None if softcap is None else float(softcap)


# --- Row passes over one chunk of logits (torch backend) -------------------------------------------------------


def _torch_row_stats(logits, bias, targets, inv_tau, softcap, with_entropy):
    """logits: [C, V] raw h W^T -> (lse [C], logp [C], entropy [C] or None) of z = (logits + bias) * inv_tau,
    soft-capped first when softcap is not None."""
    z, _ = _scaled_logits(logits, bias, inv_tau, softcap)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * _finite(z)).sum(-1) if with_entropy else None
    return lse, logp, entropy


def _finite(z):
    """z with its -inf (banned tokens: bias -inf, no soft-cap) at 0: their probability is 0, and 0 x -inf is NaN."""
    return z.masked_fill(z == float("-inf"), 0.0)


def _torch_row_grad(logits, bias, targets, lse, entropy, grad_logp, grad_entropy, inv_tau, softcap):
    """Overwrite logits [C, V] with dL/d(logits) for dL/dlogp = grad_logp [C] (and dL/dentropy = grad_entropy)."""
    z, slope = _scaled_logits(logits, bias, inv_tau, softcap)
    probs = torch.exp(z - lse.unsqueeze(-1))
    dz = -grad_logp.unsqueeze(-1) * probs
    dz.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
    if grad_entropy is not None:
        # d entropy / dz_j = -p_j (z_j - E_p[z]), and E_p[z] = lse - entropy.
        dz -= grad_entropy.unsqueeze(-1) * probs * (_finite(z) - (lse - entropy).unsqueeze(-1))
    if slope is not None:
        dz *= slope
    logits.copy_(dz * inv_tau)


def _scaled_logits(logits, bias, inv_tau, softcap):
    """(z, dz/d(logits) * tau): z = cap tanh((logits + bias) / cap) * inv_tau, the slope 1 - tanh^2 (None
    without a cap, where it is 1)."""
    z = logits.to(acc_dtype(logits.dtype))
    if bias is not None:
        z = z + bias.to(z.dtype)
    if softcap is None:
        return z * inv_tau, None
    t = torch.tanh(z / softcap)
    return t * (softcap * inv_tau), 1.0 - t * t


@dataclass(frozen=True)
class RowKernels:
    stats: Callable
    grad: Callable


def row_kernels(backend: str) -> RowKernels:
    if backend == "torch":
        return RowKernels(_torch_row_stats, _torch_row_grad)
    from fastgrpo.kernels import fused_linear as kernels

    return RowKernels(kernels.row_stats, kernels.row_grad)


def resolve_backend(backend: str, device: torch.device) -> str:
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


def chunk_loop(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    rows: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
    with_entropy: bool,
    kernels: RowKernels,
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
    acc = acc_dtype(hidden.dtype)
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


def finish_grads(grads: _Grads, weight: torch.Tensor, bias: torch.Tensor | None):
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
        logp, entropy, _ = chunk_loop(
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
        acc = acc_dtype(hidden.dtype)
        grad_logp = torch.zeros_like(targets, dtype=acc) if grad_logp is None else grad_logp.to(acc)
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(acc)

        def grad_fn(start, stop, _):
            return grad_logp[start:stop], None if grad_entropy is None else grad_entropy[start:stop]

        need = ctx.needs_input_grad
        _, _, grads = chunk_loop(
            hidden, weight, bias, targets, None, ctx.temperature, ctx.softcap, grad_entropy is not None,
            ctx.kernels, grad_fn, *need[:3],
        )
        return (*finish_grads(grads, weight, bias), None, None, None, None, None)


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
    _check_logprobs_args(hidden, weight, target_ids, bias, temperature, softcap)
    check_index_range("target_ids", target_ids, weight.shape[0])
    return _logprobs(hidden, weight, target_ids, temperature, bias, softcap, return_entropy, backend)


def fused_linear_logprobs_of_checked_values(
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
    """fused_linear_logprobs for a caller that has checked target_ids are in [0, V) already (fastgrpo.grpo_loss and
    sequence_logprobs do, with their other value checks, in one host read): no host sync of its own, which after the
    model's forward was queued made the host wait for all of it (once per micro-batch). Shapes and options are
    checked here."""
    _check_logprobs_args(hidden, weight, target_ids, bias, temperature, softcap)
    return _logprobs(hidden, weight, target_ids, temperature, bias, softcap, return_entropy, backend)


def _check_logprobs_args(hidden, weight, target_ids, bias, temperature, softcap) -> None:
    check_linear_args(hidden, weight, bias, temperature, softcap)
    if target_ids.shape != hidden.shape[:-1]:
        raise ValueError(f"target_ids: expected shape {list(hidden.shape[:-1])}, got {list(target_ids.shape)}")
    check_integer_ids("target_ids", target_ids)


def _logprobs(hidden, weight, target_ids, temperature, bias, softcap, return_entropy, backend):
    kernels = row_kernels(resolve_backend(backend, hidden.device))
    shape = target_ids.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # hidden2d: [N, H]
    targets = target_ids.reshape(-1).contiguous()
    logp, entropy = _LinearLogprobs.apply(
        hidden2d, weight.contiguous(), bias, targets, temperature, as_float(softcap), return_entropy, kernels
    )
    logp = logp.view(shape)
    return (logp, entropy.view(shape)) if return_entropy else logp


__all__ = ["fused_linear_logprobs", "fused_linear_logprobs_of_checked_values", "chunk_rows"]
