"""The course-style helper API (tokenization, eager per-token log-probs, group-normalized rewards, policy-gradient
losses, micro-batch train steps) on [B, T] tensors, built on fastgrpo.loss.grpo's formulas.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from fastgrpo._checks import check_binary_mask, check_choice, check_floating, check_index_range, check_same_shape, check_shape
from fastgrpo.loss.grpo import aggregate_loss, grpo_per_token_loss, masked_normalize

# --- Tokenization and per-token log-probs of a causal LM ---------------------------------------------------------


def tokenize_prompt_and_output(
    prompt_strs: Sequence[str], output_strs: Sequence[str], tokenizer
) -> dict[str, torch.Tensor]:
    """Prompt ids then output ids (tokenized separately, no special tokens), right-padded to the longest pair.

    Returns `input_ids` and `labels` (the sequence without its last / first position) and `response_mask` (True
    where `labels` holds an output token), each [B, L - 1]. Pads with the tokenizer's pad id, else its eos id.
    """
    if len(prompt_strs) == 0:
        raise ValueError("prompt_strs: expected at least one string, got none")
    if len(output_strs) != len(prompt_strs):
        raise ValueError(f"output_strs: expected {len(prompt_strs)} strings (one per prompt), got {len(output_strs)}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("tokenizer: expected a pad_token_id or an eos_token_id, got neither")
    prompt_ids = tokenizer(list(prompt_strs), add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(list(output_strs), add_special_tokens=False)["input_ids"]
    length = max(len(p) + len(o) for p, o in zip(prompt_ids, output_ids))
    ids = torch.full((len(prompt_ids), length), pad_id, dtype=torch.long)  # ids: [B, L]
    is_output = torch.zeros((len(prompt_ids), length), dtype=torch.bool)
    for row, (prompt, output) in enumerate(zip(prompt_ids, output_ids)):
        ids[row, : len(prompt) + len(output)] = torch.tensor(prompt + output, dtype=torch.long)
        is_output[row, len(prompt) : len(prompt) + len(output)] = True
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "response_mask": is_output[:, 1:]}


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...], in fp32 at least.

    From log_softmax (no exp overflow for logits of 1e4); -inf logits (banned tokens) contribute 0, not nan.
    """
    check_floating("logits", logits)
    log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    probs = log_probs.exp()
    return -(probs * log_probs.masked_fill(probs == 0, 0.0)).sum(-1)


def get_response_log_probs(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, return_token_entropy: bool = False
) -> dict[str, torch.Tensor]:
    """log p(labels | prefix) under a causal LM: `log_probs` [B, T] (fp32) and, if asked, `token_entropy` [B, T].

    Materializes the [B, T, V] logits: this is the eager path that the fused kernels replace.
    """
    check_shape("input_ids", input_ids, (None, None))
    check_same_shape("labels", labels, "input_ids", input_ids)
    logits = model(input_ids).logits  # logits: [B, T, V]
    check_index_range("labels", labels, logits.shape[-1])
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    out = {"log_probs": log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)}
    if return_token_entropy:
        out["token_entropy"] = compute_entropy(logits)
    return out


# --- Group-normalized rewards and policy-gradient losses -------------------------------------------------------

PG_LOSS_TYPES = ("no_baseline", "reinforce_with_baseline", "grpo_clip")


def _is_finite_number(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: Sequence[str],
    repeated_ground_truths: Sequence[str],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score every response; advantage = reward - mean of its group (consecutive blocks of group_size).

    With normalize_by_std the advantage is divided by (group std + advantage_eps), std with Bessel's correction
    as torch.std. Returns (advantages [N], raw_rewards [N], metadata) in fp32; metadata holds the mean / std /
    max / min reward, the mean of every other numeric key reward_fn returns (`format_reward`, ...) and
    `frac_zero_std_groups`, the fraction of groups whose rewards are all equal (they carry no signal).
    """
    n = len(rollout_responses)
    if n == 0:
        raise ValueError("rollout_responses: expected at least one response, got none")
    if len(repeated_ground_truths) != n:
        raise ValueError(
            f"repeated_ground_truths: expected {n} entries (one per response), got {len(repeated_ground_truths)}"
        )
    if not isinstance(group_size, int) or group_size < 1 or n % group_size:
        raise ValueError(f"group_size: expected a positive integer dividing the {n} responses, got {group_size!r}")
    if normalize_by_std and group_size < 2:
        raise ValueError("group_size: expected >= 2 with normalize_by_std (the std of one sample is undefined)")
    scores = [reward_fn(response, truth) for response, truth in zip(rollout_responses, repeated_ground_truths)]
    for i, score in enumerate(scores):
        if not isinstance(score, dict) or "reward" not in score:
            raise ValueError(f"reward_fn: expected a dict with key 'reward', got {score!r}")
        if not _is_finite_number(score["reward"]):  # a NaN would make its whole group's advantages NaN, silently
            raise ValueError(f"reward_fn: expected a finite number as 'reward', got {score['reward']!r} for "
                             f"response {i}: {rollout_responses[i][:40]!r}")
    raw_rewards = torch.tensor([float(s["reward"]) for s in scores], dtype=torch.float32)  # raw_rewards: [N]
    grouped = raw_rewards.view(-1, group_size)  # grouped: [N / G, G]
    advantages = grouped - grouped.mean(-1, keepdim=True)
    if normalize_by_std:
        advantages = advantages / (grouped.std(-1, keepdim=True) + advantage_eps)
    metadata = {
        "reward_mean": raw_rewards.mean().item(),
        "reward_std": raw_rewards.std().item() if n > 1 else 0.0,
        "reward_max": raw_rewards.max().item(),
        "reward_min": raw_rewards.min().item(),
        "frac_zero_std_groups": (grouped.amax(-1) == grouped.amin(-1)).float().mean().item(),
    }
    shared_keys = set.intersection(*(set(s) for s in scores)) - {"reward"}
    for key in sorted(shared_keys):
        if all(isinstance(s[key], (int, float)) for s in scores):
            metadata[f"{key}_mean"] = sum(float(s[key]) for s in scores) / n
    return advantages.reshape(-1), raw_rewards, metadata


def _column(name: str, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-sequence value [B] or [B, 1] of a [B, T] tensor as [B, 1]."""
    check_floating(name, values)
    batch = like.shape[0]
    if values.shape not in (torch.Size([batch]), torch.Size([batch, 1])):
        raise ValueError(f"{name}: expected shape [{batch}, 1] or [{batch}], got {list(values.shape)}")
    return values.reshape(batch, 1)


def compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor, policy_log_probs: torch.Tensor
) -> torch.Tensor:
    """REINFORCE per-token loss -A * logp: A [B, 1], policy_log_probs [B, T] -> [B, T]."""
    return _naive_loss("raw_rewards_or_advantages", raw_rewards_or_advantages, policy_log_probs)


def _naive_loss(name: str, advantages: torch.Tensor, policy_log_probs: torch.Tensor) -> torch.Tensor:
    check_shape("policy_log_probs", policy_log_probs, (None, None))
    check_floating("policy_log_probs", policy_log_probs)
    return -_column(name, advantages, policy_log_probs) * policy_log_probs


def compute_grpo_clip_loss(
    advantages: torch.Tensor, policy_log_probs: torch.Tensor, old_log_probs: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-min(r A, clip(r, 1 - cliprange, 1 + cliprange) A) with r = exp(logp - old), per token [B, T]; cliprange in
    [0, 1).

    metadata: `clipped` [B, T] bool (the clipped branch is the minimum, so the token has no gradient),
    `clipped_low` / `clipped_high` (r below 1 - cliprange with A < 0 / above 1 + cliprange with A > 0), `ratio`.
    """
    check_shape("policy_log_probs", policy_log_probs, (None, None))
    check_floating("policy_log_probs", policy_log_probs)
    check_same_shape("old_log_probs", old_log_probs, "policy_log_probs", policy_log_probs)
    advantages = _column("advantages", advantages, policy_log_probs)
    if not 0 <= cliprange < 1:  # GRPOLossConfig's epsilon_low range: 1 - cliprange stays a positive ratio
        raise ValueError(f"cliprange: expected a float in [0, 1), got {cliprange}")
    # The mask only matters at sequence level; at token level every position is computed.
    everywhere = torch.ones_like(policy_log_probs, dtype=torch.bool)
    loss, _, low, high = grpo_per_token_loss(
        policy_log_probs, everywhere, advantages, old_log_probs, epsilon_low=cliprange
    )
    ratio = torch.exp(policy_log_probs - old_log_probs).detach()
    return loss, {"clipped": low | high, "clipped_low": low, "clipped_high": high, "ratio": ratio}


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [B, T] for loss_type `no_baseline` (raw_rewards), `reinforce_with_baseline` (advantages)
    or `grpo_clip` (advantages, old_log_probs, cliprange)."""
    check_choice("loss_type", loss_type, PG_LOSS_TYPES)
    if loss_type == "no_baseline":
        if raw_rewards is None:
            raise ValueError("raw_rewards: required for loss_type='no_baseline', got None")
        return _naive_loss("raw_rewards", raw_rewards, policy_log_probs), {}
    if advantages is None:
        raise ValueError(f"advantages: required for loss_type={loss_type!r}, got None")
    if loss_type == "reinforce_with_baseline":
        return _naive_loss("advantages", advantages, policy_log_probs), {}
    if old_log_probs is None:
        raise ValueError("old_log_probs: required for loss_type='grpo_clip', got None")
    if cliprange is None:
        raise ValueError("cliprange: required for loss_type='grpo_clip', got None")
    return compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange)


# --- Microbatch train steps ------------------------------------------------------------------------------------


def _check_step_args(policy_log_probs: torch.Tensor, response_mask: torch.Tensor, steps: int) -> None:
    check_shape("policy_log_probs", policy_log_probs, (None, None))
    check_floating("policy_log_probs", policy_log_probs)
    check_binary_mask("response_mask", response_mask, "policy_log_probs", policy_log_probs)
    if not policy_log_probs.requires_grad:  # else torch's "element 0 of tensors does not require grad" at backward
        raise ValueError("policy_log_probs: expected a tensor that requires grad (the step calls backward on it), "
                         "got one without a graph: computed under torch.no_grad() or detached?")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps: expected a positive integer, got {steps!r}")


def sft_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Backward of mean_b(masked_normalize(-logp, mask, dim=-1, normalize_constant)) / gradient_accumulation_steps.

    Gradients add up in `.grad` across calls, as plain autograd does. Returns the (detached) scaled loss.
    """
    _check_step_args(policy_log_probs, response_mask, gradient_accumulation_steps)
    if not normalize_constant > 0:
        raise ValueError(f"normalize_constant: expected > 0, got {normalize_constant}")
    per_sequence = masked_normalize(-policy_log_probs, response_mask, dim=-1, normalize_constant=normalize_constant)
    loss = per_sequence.mean() / gradient_accumulation_steps
    loss.backward()
    return loss.detach(), {"response_tokens": response_mask.sum().detach()}


def grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Backward of mean_b(masked_mean(per-token PG loss, mask, dim=-1)) / gradient_accumulation_steps.

    A sequence without response tokens adds 0 (masked_mean would give 0/0 = nan and poison the step).
    Gradients add up in `.grad` across calls. Returns the (detached) scaled loss and the loss metadata, with
    `clip_fraction` (clipped response tokens / response tokens) for grpo_clip.
    """
    _check_step_args(policy_log_probs, response_mask, gradient_accumulation_steps)
    per_token, metadata = compute_policy_gradient_loss(
        policy_log_probs, loss_type, raw_rewards, advantages, old_log_probs, cliprange
    )
    loss = aggregate_loss(per_token, response_mask, "grpo") / gradient_accumulation_steps
    loss.backward()
    if "clipped" in metadata:
        count = response_mask.sum().clamp(min=1)
        metadata["clip_fraction"] = (metadata["clipped"] & response_mask.bool()).sum() / count
    return loss.detach(), metadata
