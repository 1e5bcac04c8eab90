"""GRPOLossConfig: every option of the GRPO loss, held once and validated once.

fastgrpo.loss.reference.grpo_loss, fastgrpo.fused_linear_grpo_loss, fastgrpo.grpo_loss and the trainer take one
of these (`config=`), or the same options as keywords, folded into one here (`resolve`).
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from fastgrpo._checks import (
    Masked,
    check_choice,
    check_integer_ids,
    check_linear_args,
    check_mask,
    check_per_token_inputs,
    check_shape,
    first_nonfinite,
    masked_nonfinite,
    nonbinary,
    raise_if_masked_nonfinite,
    raise_if_nonbinary,
    raise_if_nonfinite,
    raise_unless_in_range,
    read_ints,
)
from fastgrpo.loss.correction import engine_logps

# The first four are aggregations of the PPO-clipped objective; cispo, sapo, luspo and vespo are TRL 1.15 / 1.16's
# other loss types (formulas in fastgrpo.loss.grpo, each cited to TRL's code).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    """Options of the GRPO loss (see DESIGN: the loss math).

    beta: weight of the k3 KL to the reference (0: none, no ref_logps needed). epsilon_low / epsilon_high: the
    ratio is clipped to [1 - epsilon_low, 1 + epsilon_high] (epsilon_high None: epsilon_low). delta: cap on the
    unclipped ratio (two-sided clipping, TRL's), None: off. loss_type: the aggregation (grpo, bnpo, dr_grpo, dapo).
    importance_sampling_level: "token" ratios, or "sequence" (the mean log-ratio of a sequence's tokens).
    temperature: divides the logits. max_completion_length: dr_grpo's normalizer. num_items_in_batch: dapo's
    normalizer (the active tokens of the whole accumulation window; None: this call's). softcap: the logits become
    softcap * tanh(logits / softcap) before the temperature (Gemma-2's final_logit_softcapping).

    The options of TRL's GRPOConfig with TRL's names and defaults (except use_bias_correction_kl, see there):
    sapo_temperature_pos / _neg: SAPO's gate temperatures for A > 0 / A <= 0. vespo_k_pos / _neg, vespo_lambda_pos /
    _neg: VESPO's gamma weight phi(w) = e^lambda w^k e^(-lambda w) for A >= 0 / A < 0. top_entropy_quantile: the
    policy term keeps only the tokens whose entropy is at or above the (1 - q) quantile of the batch's valid
    tokens (1: all). off_policy_mask_threshold: drop the sequences with A < 0 whose mean log(pi_sampler / pi) is
    above this (DeepSeek-V3.2's off-policy sequence mask), None: off. use_bias_correction_kl: multiply the KL term
    by the importance ratio (TRL's default True; False here, the plain k3 KL of fastgrpo's earlier releases).
    entropy_coef: subtract entropy_coef x the mean entropy of the tokens the policy term acts on (0: off).
    """

    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    loss_type: str = "bnpo"
    importance_sampling_level: str = "token"
    temperature: float = 1.0
    max_completion_length: int | None = None
    num_items_in_batch: float | torch.Tensor | None = None
    softcap: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = False
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        _check_real("beta", self.beta, "a finite float >= 0", lambda v: 0 <= v < math.inf)
        _check_real("epsilon_low", self.epsilon_low, "a float in [0, 1)", lambda v: 0 <= v < 1)
        _check_optional_real("epsilon_high", self.epsilon_high, "None or a finite float >= 0",
                             lambda v: 0 <= v < math.inf)
        _check_optional_real("delta", self.delta, "None or a float >= 1", lambda v: 1 <= v < math.inf)
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        check_temperature(self.temperature)
        _check_optional_real("softcap", self.softcap, "None or a positive finite float", lambda v: 0 < v < math.inf)
        if self.softcap is not None:  # an int cap would be specialized by Triton into a constant
            object.__setattr__(self, "softcap", float(self.softcap))
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            _check_real(name, getattr(self, name), "a finite float > 0", lambda v: 0 < v < math.inf)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            _check_real(name, getattr(self, name), "a finite float >= 0", lambda v: 0 <= v < math.inf)
        _check_real("top_entropy_quantile", self.top_entropy_quantile, "a float in (0, 1]", lambda v: 0 < v <= 1)
        _check_optional_real("off_policy_mask_threshold", self.off_policy_mask_threshold, "None or a finite float",
                             math.isfinite)
        if not isinstance(self.use_bias_correction_kl, bool):
            raise ValueError(f"use_bias_correction_kl: expected True or False, got {self.use_bias_correction_kl!r}")
        _check_real("entropy_coef", self.entropy_coef, "a finite float", math.isfinite)
        length = self.max_completion_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1):
            raise ValueError(f"max_completion_length: expected None or an int >= 1, got {length!r}")
        if self.loss_type == "dr_grpo" and length is None:
            raise ValueError("max_completion_length: required for loss_type='dr_grpo', got None")
        items = self.num_items_in_batch
        if items is not None:
            if isinstance(items, torch.Tensor):
                if items.numel() != 1:
                    raise ValueError(f"num_items_in_batch: expected a number or a one-element tensor, got shape "
                                     f"{list(items.shape)}")
                value = float(items)  # one host sync: a wrong normalizer must not pass silently
            elif isinstance(items, numbers.Real) and not isinstance(items, bool):
                value = float(items)
            else:
                raise ValueError(f"num_items_in_batch: expected None or a number > 0, got {items!r}")
            if not 0 < value < math.inf:
                raise ValueError(f"num_items_in_batch: expected None or a number > 0, got {value}")

    @property
    def clip_high(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_entropy(self) -> bool:
        """The loss reads per-token entropies: the top-entropy mask or the entropy bonus."""
        return self.top_entropy_quantile < 1 or self.entropy_coef != 0

    @property
    def whole_sequence(self) -> bool:
        """A token's dL/dlogp needs other tokens' log-probs (or entropies) first: sequence-level ratios, VESPO's
        sequence sum, the off-policy mask's sequence mean, the entropy quantile (the fused loss's two passes)."""
        return (self.importance_sampling_level == "sequence" or self.loss_type == "vespo"
                or self.off_policy_mask_threshold is not None or self.top_entropy_quantile < 1)


def resolve(config: GRPOLossConfig | None, options: dict) -> GRPOLossConfig:
    """`config` with the keyword `options` on top (either may be absent); unknown option names are an error."""
    if config is not None and not isinstance(config, GRPOLossConfig):
        raise ValueError(f"config: expected a fastgrpo.GRPOLossConfig or None, got {type(config).__name__}")
    names = {f.name for f in dataclasses.fields(GRPOLossConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"unknown loss option {unknown}: expected fields of GRPOLossConfig {sorted(names)}")
    if config is None:
        return GRPOLossConfig(**options)
    return dataclasses.replace(config, **options) if options else config


def check_loss_inputs(
    cfg: GRPOLossConfig,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    bias: torch.Tensor | None,
    token_weights: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
) -> None:
    """The tensor checks shared by fastgrpo.loss.reference.grpo_loss and fastgrpo.fused_linear_grpo_loss: shapes,
    dtypes and the options here; the values (one host read) in check_loss_values."""
    check_shape("hidden", hidden, (None, None, None))
    B, T, _ = hidden.shape
    check_linear_args(hidden, weight, bias, cfg.temperature, cfg.softcap)
    check_shape("target_ids", target_ids, (B, T))
    check_integer_ids("target_ids", target_ids)
    check_mask("completion_mask", completion_mask, "target_ids", target_ids)
    check_per_token_inputs(B, T, advantages, old_logps, ref_logps)
    check_floating(old_logps=old_logps, ref_logps=ref_logps)
    check_extra_inputs(B, T, token_weights, sampling_logps)
    if cfg.beta > 0 and ref_logps is None:
        raise ValueError("ref_logps: required when beta > 0, got None")


def check_loss_values(completion_mask: torch.Tensor, target_ids: torch.Tensor, vocab_size: int,
                      advantages: torch.Tensor, per_token: dict[str, torch.Tensor | Masked | None]) -> int:
    """completion_mask holds only 0 and 1, target_ids are in [0, vocab_size), advantages are finite and so are the
    per_token inputs (finite_where_completion, with their Masked options) where completion_mask is 1, read in one
    host sync; returns the count of completion tokens (the mask's 1s). After check_loss_inputs."""
    if target_ids.numel() == 0:
        return 0
    flag, low, high, count, *bad = read_ints(nonbinary(completion_mask), *target_ids.aminmax(),
                                             completion_mask.bool().sum(), *first_nonfinite(advantages),
                                             *masked_nonfinite(completion_mask, per_token))
    raise_if_nonbinary("completion_mask", flag)
    raise_unless_in_range("target_ids", low, high, vocab_size)
    raise_if_nonfinite("advantages", advantages.shape, *bad[:2])
    raise_if_masked_nonfinite("completion_mask", per_token, bad[2:])
    return count


def finite_where_completion(old_logps, ref_logps, token_weights,
                            sampling_logps) -> dict[str, torch.Tensor | Masked | None]:
    """The per-token inputs that must be finite where completion_mask is 1 (a NaN / inf there made the loss NaN or
    inf silently), token_weights also >= 0 (a negative weight flipped its token's policy gradient silently);
    elsewhere they are padding, which the loss fills. old_logps and ref_logps are log-probs, <= 0 up to rounding (a
    positive one, a negative log-likelihood or a probability passed by mistake, moved the ratio and the KL term
    silently); NaN fails for them: they are the trainer's own, and the loss has no use for a token it could not
    score. sampling_logps are an engine's log-probs (engine_logps): <= 0, and NaN passes, which the off-policy mask
    counts 0, as TRL 1.16's get_off_policy_mask does ('tokens vLLM could not score')."""
    return {"old_logps": Masked(old_logps, logprob=True), "ref_logps": Masked(ref_logps, logprob=True),
            "token_weights": Masked(token_weights, nonnegative=True), "sampling_logps": engine_logps(sampling_logps)}


def check_extra_inputs(B: int, T: int, token_weights, sampling_logps) -> None:
    """token_weights (per-token weights of the policy term, e.g. a rollout importance-sampling correction) and
    sampling_logps (the rollout engine's log-probs, for the off-policy mask): floating [B, T] when given."""
    for name, tensor in (("token_weights", token_weights), ("sampling_logps", sampling_logps)):
        if tensor is not None:
            check_shape(name, tensor, (B, T))
    check_floating(token_weights=token_weights, sampling_logps=sampling_logps)


def check_floating(**tensors: torch.Tensor | None) -> None:
    """Each given tensor has a floating dtype: integer log-probs (torch.zeros_like(input_ids), say) would truncate
    every value silently."""
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a floating dtype, got {str(tensor.dtype).removeprefix('torch.')}")


def check_temperature(value: object) -> None:
    """temperature: a finite real > 0 (inf made every log-prob log(1 / V) silently)."""
    _check_real("temperature", value, "a finite float > 0", lambda v: 0 < v < math.inf)


def _check_real(name: str, value: object, expected: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(float(value)):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _check_optional_real(name: str, value: object, expected: str, ok) -> None:
    if value is not None:
        _check_real(name, value, expected, ok)
