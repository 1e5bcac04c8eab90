"""The eager PyTorch oracle that every fastgrpo kernel is tested against.

Obviously-correct and slow on purpose: logits are materialized, nothing is chunked or fused. Every function
computes in the inputs' dtype, or in `upcast` when given (tests pass torch.float64).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastgrpo._checks import check_linear_args
from fastgrpo.loss.config import (
    GRPOLossConfig,
    check_loss_inputs,
    check_loss_values,
    finite_where_completion,
    resolve,
)
from fastgrpo.loss.grpo import grpo_objective, loss_metrics


def _cast(upcast: torch.dtype | None, *tensors: torch.Tensor | None):
    if upcast is None:
        return tensors
    return tuple(t if t is None or not t.dtype.is_floating_point else t.to(upcast) for t in tensors)


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    return_entropy: bool = False,
    upcast: torch.dtype | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax((hidden @ weight.T + bias) / temperature)[target]: hidden [..., H], weight [V, H] -> [...].

    softcap: the logits become softcap * tanh(logits / softcap) first, as Hugging Face's Gemma-2 computes them.
    """
    check_linear_args(hidden, weight, bias, temperature, softcap)
    hidden, weight, bias = _cast(upcast, hidden, weight, bias)
    logits = F.linear(hidden, weight, bias)  # [..., V]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logps = log_probs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logps
    # a banned token (bias -inf, no soft-cap) has probability 0 and adds 0, not 0 x -inf = NaN
    entropy = -(log_probs.exp() * log_probs.masked_fill(log_probs == float("-inf"), 0.0)).sum(-1)
    return logps, entropy


def grpo_loss(
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
    upcast: torch.dtype | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of hidden [B, T, H] through lm_head weight [V, H]; the oracle of fused_linear_grpo_loss.

    config / options: a GRPOLossConfig and keyword fields on top of it. token_weights [B, T]: per-token weights of
    the policy term (e.g. a rollout importance-sampling correction); sampling_logps [B, T]: the rollout engine's
    log-probs for the off-policy mask (fastgrpo.loss.grpo.grpo_terms). Returns (loss, metrics) with the metrics of
    fastgrpo.loss.grpo.loss_metrics; return_logps: also "logps", the per-token log-probs [B, T] the loss was computed
    from (detached, in the computation's dtype, 0 where completion_mask is 0).
    """
    cfg = resolve(config, options)
    check_loss_inputs(cfg, hidden, weight, target_ids, completion_mask, advantages, old_logps, ref_logps, bias,
                      token_weights, sampling_logps)
    check_loss_values(completion_mask, target_ids, weight.shape[0], advantages,
                      finite_where_completion(old_logps, ref_logps, token_weights, sampling_logps))
    hidden, weight, bias, advantages, old_logps, ref_logps, token_weights, sampling_logps = _cast(
        upcast, hidden, weight, bias, advantages, old_logps, ref_logps, token_weights, sampling_logps
    )
    with_entropy = return_entropy or cfg.needs_entropy
    out = linear_logprobs(hidden, weight, target_ids, cfg.temperature, bias, with_entropy, softcap=cfg.softcap)
    logps, entropy = out if with_entropy else (out, None)
    mask = completion_mask.to(logps.dtype)
    # Masked positions are padding, filled as the fused loss fills them: a NaN old / ref log-prob there made the
    # gradients NaN (exp's backward of its NaN ratio times the mask's 0), though not the loss.
    old_logps, ref_logps = (None if t is None else torch.where(mask.bool(), t, 0.0) for t in (old_logps, ref_logps))
    objective = grpo_objective(
        logps, mask, advantages.to(logps.dtype), old_logps, ref_logps, cfg, entropy=entropy,
        token_weights=token_weights, sampling_logps=sampling_logps,
    )
    metrics = loss_metrics(mask, objective, entropy if return_entropy else None)
    if return_logps:
        metrics["logps"] = torch.where(mask.bool(), logps, 0.0).detach()
    return objective.loss, metrics


# --- Layers fused by patch_model -------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (offset + weight); offset=1 is Gemma's (1 + w) scaling."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * (offset + weight)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF rotary embedding: q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B, T, D] (rotate-half convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the Llama / Qwen / Mistral / Phi-3 MLP activation."""
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up: the Gemma MLP activation."""
    return F.gelu(gate, approximate="tanh") * up


__all__ = ["linear_logprobs", "grpo_loss", "rms_norm", "apply_rotary", "swiglu", "geglu"]
