"""The GRPO loss through the lm_head without [B, T, V] logits: fastgrpo.ops.fused_linear's chunk loop, with the
per-token loss of fastgrpo.loss.grpo.

Where the gradient of each log-prob is known once the log-prob is (token-level ratios: the aggregation is linear in
the per-token losses, with weights known up front from the mask), a chunk's logits buffer turns in place into
dL/dlogits, followed by the dH and dW GEMMs: 3 GEMMs in all (2 with a frozen lm_head), computed in the forward and
scaled by grad_output in the backward (Liger-style). Sequence-level ratios need every log-prob of a sequence first:
a second pass (4 GEMMs).
"""
from __future__ import annotations

import torch

from fastgrpo.loss.config import GRPOLossConfig, check_loss_inputs, resolve
from fastgrpo.loss.grpo import aggregation_weights, grpo_per_token_loss, loss_metrics
from fastgrpo.ops.fused_linear import acc_dtype, chunk_loop, finish_grads, resolve_backend, row_kernels


def _grad_wrt_logps(cfg, logps, mask, advantages, old_logps, ref_logps, weights) -> torch.Tensor:
    """dL/dlogps through fastgrpo.loss.grpo (the single home of the formula): logps and the rest [R, S]."""
    with torch.enable_grad():
        logps = logps.detach().requires_grad_()
        per_token_loss = grpo_per_token_loss(logps, mask, advantages, old_logps, ref_logps, cfg).loss
        (grad,) = torch.autograd.grad((per_token_loss * weights).sum(), logps)
    return grad


def _grpo_forward(hidden, weight, bias, targets, mask, advantages, old_logps, ref_logps, cfg, entropy, kernels, need):
    """hidden [B, T, H] etc. -> (loss, metrics dict, (dhidden, dweight, dbias) or None)."""
    B, T, H = hidden.shape
    acc = acc_dtype(hidden.dtype)
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
    logp_v, entropy_v, grads = chunk_loop(
        hidden2d, weight, bias, flat_targets, rows, cfg.temperature, cfg.softcap, entropy, kernels,
        token_grad_fn if one_pass else None, *need,
    )
    logps = torch.zeros(B * T, dtype=acc, device=hidden.device).index_copy_(0, valid, logp_v).view(B, T)
    if any_grad and not token_level:
        grad_logps = _grad_wrt_logps(cfg, logps, m, advantages, old, ref, weights).reshape(-1)[valid]
        _, _, grads = chunk_loop(
            hidden2d, weight, bias, flat_targets, rows, cfg.temperature, cfg.softcap, False, kernels,
            lambda start, stop, _: (grad_logps[start:stop], None), *need,
        )
    terms = grpo_per_token_loss(logps, m, advantages, old, ref, cfg)
    loss = (terms.loss * weights).sum()
    entropy = None
    if entropy_v is not None:
        entropy = torch.zeros(B * T, dtype=acc, device=hidden.device).index_copy_(0, valid, entropy_v).view(B, T)
    metrics = loss_metrics(m, terms, entropy)
    if grads is None:
        return loss, metrics, None
    dhidden, dweight, dbias = finish_grads(grads, weight, bias)
    return loss, metrics, (None if dhidden is None else dhidden.view(B, T, H), dweight, dbias)


class _GRPOLoss(torch.autograd.Function):
    """The gradients are formed in the forward; the backward only scales them by grad_output. The metrics are
    written into the dict passed in (they carry no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, mask, advantages, old_logps, ref_logps, cfg, entropy, kernels,
                metrics):
        need = ctx.needs_input_grad[:3]  # hidden, weight, bias (False for a bias that is None)
        loss, values, grads = _grpo_forward(
            hidden, weight, bias, targets, mask, advantages, old_logps, ref_logps, cfg, entropy, kernels, need
        )
        metrics.update(values)
        ctx.grads = grads
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # Handed over, not kept: autograd can then take them as .grad without a copy (0.43 GiB of dW at H=1536).
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(
                "fused_linear_grpo_loss: a second backward through the same loss (retain_graph=True) is not "
                "supported; its gradients are formed in the forward and handed over once"
            )
        if bool(grad_loss != 1.0):
            grads = tuple(None if g is None else g * grad_loss.to(g.dtype) for g in grads)
        return (*grads, *([None] * 9))


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    config: GRPOLossConfig | None = None,
    bias: torch.Tensor | None = None,
    return_entropy: bool = False,
    backend: str = "auto",
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of hidden [B, T, H] through lm_head weight [V, H]; same arguments and results as
    fastgrpo.loss.reference.grpo_loss, in chunks of rows (see `chunk_rows`), never materializing [B, T, V].

    config: a GRPOLossConfig; keyword `options` (its field names: beta, epsilon_low, loss_type, softcap, ...) are
    applied on top of it. Returns (loss, metrics) with the metrics of fastgrpo.loss.grpo.loss_metrics.
    old_logps=None is on-policy. Gradients reach hidden, weight (skipped when frozen) and bias.
    """
    cfg = resolve(config, options)
    check_loss_inputs(cfg, hidden, weight, target_ids, completion_mask, advantages, old_logps, ref_logps, bias)
    kernels = row_kernels(resolve_backend(backend, hidden.device))
    args = (hidden.contiguous(), weight.contiguous(), bias, target_ids, completion_mask, advantages.detach())
    logps = tuple(None if t is None else t.detach() for t in (old_logps, ref_logps))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        metrics: dict[str, torch.Tensor] = {}
        loss = _GRPOLoss.apply(*args, *logps, cfg, return_entropy, kernels, metrics)
        return loss, metrics
    loss, metrics, _ = _grpo_forward(*args, *logps, cfg, return_entropy, kernels, (False, False, False))
    return loss, metrics


__all__ = ["fused_linear_grpo_loss"]
