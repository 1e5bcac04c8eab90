"""The GRPO loss through the lm_head without [B, T, V] logits: fastgrpo.ops.fused_linear's chunk loop, with the
per-token loss of fastgrpo.loss.grpo.

Where the gradient of each log-prob is known once the log-prob is (token-level ratios: the aggregation is linear in
the per-token losses, with weights known up front from the mask), a chunk's logits buffer turns in place into
dL/dlogits, followed by the dH and dW GEMMs: 3 GEMMs in all (2 with a frozen lm_head), computed in the forward and
scaled by grad_output in the backward (Liger-style). The entropy bonus adds dL/dentropy to the same pass. Options
whose gradient needs every log-prob (or entropy) of a sequence or batch first (GRPOLossConfig.whole_sequence:
sequence-level ratios, VESPO's sequence sum, the off-policy mask, the entropy quantile) take a second pass (4 GEMMs).
"""
from __future__ import annotations

import torch

from fastgrpo.loss.config import (
    GRPOLossConfig,
    check_loss_inputs,
    check_loss_values,
    finite_where_completion,
    resolve,
)
from fastgrpo.loss.grpo import aggregation_weights, entropy_weights, grpo_objective, loss_metrics
from fastgrpo.ops.fused_linear import acc_dtype, chunk_loop, finish_grads, resolve_backend, row_kernels


def _objective_grads(cfg, logps, entropy, mask, advantages, extras, weights, bonus_weights):
    """(dL/dlogps, dL/dentropy or None) through fastgrpo.loss.grpo.grpo_objective (the single home of the
    formula): logps, entropy, mask, advantages and the `extras` (old, ref, token_weights, sampling_logps) [R, S]."""
    old, ref, token_weights, sampling_logps = extras
    with torch.enable_grad():
        logps = logps.detach().requires_grad_()
        leaves = [logps]
        if cfg.entropy_coef != 0:
            entropy = entropy.detach().requires_grad_()
            leaves.append(entropy)
        objective = grpo_objective(
            logps, mask, advantages, old, ref, cfg, entropy=entropy, token_weights=token_weights,
            sampling_logps=sampling_logps, weights=weights, bonus_weights=bonus_weights,
        )
        grads = torch.autograd.grad(objective.loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]
    return grads[0], grads[1] if len(grads) > 1 else None


def _grpo_forward(hidden, weight, bias, targets, mask, valid_tokens, advantages, per_token, cfg, entropy, logps_out,
                  kernels, need):
    """hidden [B, T, H] etc. -> (loss, metrics dict, (dhidden, dweight, dbias) or None). valid_tokens: the count of
    1s in mask. per_token: old_logps, ref_logps, token_weights, sampling_logps ([B, T] or None). logps_out: the
    metrics also hold "logps" [B, T]."""
    B, T, H = hidden.shape
    acc = acc_dtype(hidden.dtype)
    m = mask.to(acc)  # m: [B, T]
    keep = m.bool()
    # valid: [n] row ids (masked rows cost no GEMM work); of a known count: no host sync, unlike nonzero()
    valid = torch.nonzero_static(keep.reshape(-1), size=valid_tokens).squeeze(-1)
    # Masked positions get logp = old = ref = 0 and weight 1 (ratio 1, KL 0, aggregation weight 0): padding values
    # can't turn into inf * 0.
    advantages = (advantages if advantages.dim() == 2 else advantages[:, None]).to(acc)  # [B, 1] or [B, T]
    fills = (0.0, 0.0, 1.0, 0.0)
    extras = tuple(None if t is None else torch.where(keep, t.to(acc), fill) for t, fill in zip(per_token, fills))
    weights = aggregation_weights(m, cfg.loss_type, cfg.max_completion_length, cfg.num_items_in_batch).to(acc)
    hidden2d, flat_targets = hidden.reshape(B * T, H), targets.reshape(-1)[valid]
    rows = None if valid_tokens == B * T else valid  # no mask: slices, no gather/scatter of hidden rows
    with_entropy = entropy or cfg.needs_entropy
    any_grad = any(need)
    # One pass when each token's gradient is known from its own log-prob: formed chunk by chunk in the forward.
    one_pass = any_grad and not cfg.whole_sequence

    def valid_rows(t):  # [B, T] -> [1, n] over the valid rows
        return None if t is None else t.expand(B, T).reshape(-1)[valid][None]

    if one_pass:
        flat = [valid_rows(t) for t in (m, advantages, weights, *extras)]
        # Without the entropy mask, the bonus weights are known up front; the bonus is linear in the entropy, so
        # its gradient needs no entropy value (zeros stand in).
        bonus = valid_rows(entropy_weights(m)) if cfg.entropy_coef != 0 else None

    def token_grad_fn(start, stop, logp_c):
        sl = slice(start, stop)
        m_c, adv_c, w_c, *extras_c = (None if t is None else t[:, sl] for t in flat)
        zeros = torch.zeros_like(logp_c[None]) if bonus is not None else None
        grad_logp, grad_entropy = _objective_grads(
            cfg, logp_c[None], zeros, m_c, adv_c, extras_c, w_c, None if bonus is None else bonus[:, sl]
        )
        return grad_logp[0], None if grad_entropy is None else grad_entropy[0]

    logp_v, entropy_v, grads = chunk_loop(
        hidden2d, weight, bias, flat_targets, rows, cfg.temperature, cfg.softcap, with_entropy, kernels,
        token_grad_fn if one_pass else None, *need,
    )

    def full(values):  # [n] over the valid rows -> [B, T], 0 elsewhere
        return torch.zeros(B * T, dtype=acc, device=hidden.device).index_copy_(0, valid, values).view(B, T)

    logps = full(logp_v)
    ent = None if entropy_v is None else full(entropy_v)
    if any_grad and not one_pass:  # the second pass: every log-prob (and entropy) is known now
        grad_logp, grad_entropy = _objective_grads(cfg, logps, ent, m, advantages, extras, weights, None)
        grad_logp = grad_logp.reshape(-1)[valid]
        grad_entropy = None if grad_entropy is None else grad_entropy.reshape(-1)[valid]
        _, _, grads = chunk_loop(
            hidden2d, weight, bias, flat_targets, rows, cfg.temperature, cfg.softcap, grad_entropy is not None,
            kernels,
            lambda start, stop, _: (grad_logp[start:stop], None if grad_entropy is None else grad_entropy[start:stop]),
            *need,
        )
    old, ref, token_weights, sampling_logps = extras
    objective = grpo_objective(logps, m, advantages, old, ref, cfg, entropy=ent, token_weights=token_weights,
                               sampling_logps=sampling_logps, weights=weights)
    metrics = loss_metrics(m, objective, ent if entropy else None)
    if logps_out:
        metrics["logps"] = logps.detach()
    if grads is None:
        return objective.loss, metrics, None
    dhidden, dweight, dbias = finish_grads(grads, weight, bias)
    return objective.loss, metrics, (None if dhidden is None else dhidden.view(B, T, H), dweight, dbias)


class _GRPOLoss(torch.autograd.Function):
    """The gradients are formed in the forward; the backward only scales them by grad_output. The metrics are
    written into the dict passed in (they carry no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, mask, valid_tokens, advantages, per_token, cfg, entropy,
                logps_out, kernels, metrics):
        need = ctx.needs_input_grad[:3]  # hidden, weight, bias (False for a bias that is None)
        loss, values, grads = _grpo_forward(
            hidden, weight, bias, targets, mask, valid_tokens, advantages, per_token, cfg, entropy, logps_out,
            kernels, need,
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
        # Scaled in place whatever grad_loss is: testing it for 1 would read it on the host, a sync per micro-batch.
        for g in grads:
            if g is not None:
                g.mul_(grad_loss.to(g.dtype))
        return (*grads, *([None] * 10))


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
    token_weights: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    return_logps: bool = False,
    backend: str = "auto",
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of hidden [B, T, H] through lm_head weight [V, H]; same arguments and results as
    fastgrpo.loss.reference.grpo_loss, in chunks of rows (see `chunk_rows`), never materializing [B, T, V].

    config: a GRPOLossConfig; keyword `options` (its field names: beta, epsilon_low, loss_type, softcap, ...) are
    applied on top of it. Returns (loss, metrics) with the metrics of fastgrpo.loss.grpo.loss_metrics.
    old_logps=None is on-policy. token_weights [B, T]: per-token weights of the policy term (a rollout
    importance-sampling correction); sampling_logps [B, T]: the rollout engine's log-probs for the off-policy mask.
    return_logps: the metrics also hold "logps", the per-token log-probs [B, T] the loss was computed from (detached,
    fp32 for fp32 / bf16 / fp16 inputs, 0 where completion_mask is 0): the policy's log-probs of the batch without
    another forward. Gradients reach hidden, weight (skipped when frozen) and bias.
    """
    cfg = resolve(config, options)
    check_loss_inputs(cfg, hidden, weight, target_ids, completion_mask, advantages, old_logps, ref_logps, bias,
                      token_weights, sampling_logps)
    valid_tokens = check_loss_values(completion_mask, target_ids, weight.shape[0], advantages,
                                     finite_where_completion(old_logps, ref_logps, token_weights, sampling_logps))
    return _run(cfg, valid_tokens, hidden, weight, bias, target_ids, completion_mask, advantages,
                (old_logps, ref_logps, token_weights, sampling_logps), return_entropy, return_logps, backend)


def fused_linear_grpo_loss_of_checked_values(
    valid_tokens: int,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    config: GRPOLossConfig,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    return_entropy: bool = False,
    token_weights: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    return_logps: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """fused_linear_grpo_loss for a caller that has checked the values already (completion_mask 0/1, target_ids
    in [0, V): fastgrpo.grpo_loss does, with its other checks, in one host read) and counted the mask's 1s
    (valid_tokens): no host sync, so the host can queue the loss and the backward while the GPU runs the forward.
    Shapes and options are checked here; the count is trusted and must be exact (a larger one would read the last
    row again in the padding of torch.nonzero_static, silently)."""
    check_loss_inputs(config, hidden, weight, target_ids, completion_mask, advantages, old_logps, ref_logps, bias,
                      token_weights, sampling_logps)
    return _run(config, valid_tokens, hidden, weight, bias, target_ids, completion_mask, advantages,
                (old_logps, ref_logps, token_weights, sampling_logps), return_entropy, return_logps, backend)


def _run(cfg, valid_tokens, hidden, weight, bias, target_ids, completion_mask, advantages, per_token, return_entropy,
         return_logps, backend):
    kernels = row_kernels(resolve_backend(backend, hidden.device))
    args = (hidden.contiguous(), weight.contiguous(), bias, target_ids, completion_mask, valid_tokens,
            advantages.detach())
    per_token = tuple(None if t is None else t.detach() for t in per_token)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        metrics: dict[str, torch.Tensor] = {}
        loss = _GRPOLoss.apply(*args, per_token, cfg, return_entropy, return_logps, kernels, metrics)
        return loss, metrics
    no_grads = (False, False, False)
    loss, metrics, _ = _grpo_forward(*args, per_token, cfg, return_entropy, return_logps, kernels, no_grads)
    return loss, metrics


__all__ = ["fused_linear_grpo_loss"]
