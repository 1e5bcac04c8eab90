"""The GRPO loss and sequence log-probs of a Hugging Face causal LM, from hidden states, without logits.

Alignment, for every [B, T] tensor here: position t is about token input_ids[:, t] predicted from
input_ids[:, :t]; only positions where completion_mask is 1 count (log-probs elsewhere are 0). The backbone runs
on all T positions (padded rows without their mask where that changes nothing read: fastgrpo.loss.row_layout;
adjacent rows of one prompt with the prompt once: fastgrpo.loss.shared_prompts); the fused lm_head + loss runs on
the columns that hold completion tokens only.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from fastgrpo._checks import (
    Masked,
    check_integer_ids,
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
from fastgrpo._device import on_model_device
from fastgrpo.hf.models import (
    backbone_and_head,
    check_inputs_on_head_device,
    check_on_head_device,
    head_bias,
    logit_softcap,
)
from fastgrpo.loss import shared_prompts
from fastgrpo.loss.config import (
    GRPOLossConfig,
    check_extra_inputs,
    check_floating,
    check_temperature,
    finite_where_completion,
    resolve,
)
from fastgrpo.loss.correction import (
    RolloutCorrection,
    check_rollout_correction,
    correction_weights,
    engine_logps,
    raise_if_overflowed,
)
from fastgrpo.loss.fused import fused_linear_grpo_loss_of_checked_values
from fastgrpo.loss.row_layout import Unpadded, padding_facts, run_backbone, take_columns, unpadded
from fastgrpo.ops.fused_linear import fused_linear_logprobs_of_checked_values


class _Batch(NamedTuple):
    """What _inspect reads of a batch's values."""

    window: slice  # the input_ids columns from the first to the last that hold a completion token
    completion_tokens: int  # completion_mask's 1s
    layout: Unpadded  # how the backbone runs the rows
    packing: shared_prompts.Packing | None  # rows of one prompt run it once (loss.shared_prompts); None: unpacked


def _inspect(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
             vocab_size: int, advantages: torch.Tensor | None = None,
             per_token: dict[str, torch.Tensor | Masked | None] | None = None,
             correction: tuple[torch.Tensor, str] | None = None, may_pack: bool = False) -> _Batch:
    """Check the inputs (and that advantages, when given, are finite, and the per_token tensors where
    completion_mask is 1; correction: (token_weights [B, T], level) of a rollout correction, for an overflow there)
    and find the completion window, reading their values in one host sync (not one per check: each sync stops the
    host from queueing work while the GPU finishes the previous micro-batch). may_pack: also plan the packing of rows
    that share a prompt (shared_prompts.plan), from values read in the same sync."""
    per_token = per_token or {}
    check_shape("input_ids", input_ids, (None, None))
    B, T = input_ids.shape
    if B == 0:
        raise ValueError(f"input_ids: expected at least one sequence [B>=1, T], got {list(input_ids.shape)}")
    check_mask("attention_mask", attention_mask, "input_ids", input_ids)
    check_mask("completion_mask", completion_mask, "input_ids", input_ids)
    if T < 2:
        raise ValueError(f"input_ids: expected at least 2 positions [B, T>=2], got {list(input_ids.shape)}")
    check_integer_ids("input_ids", input_ids)
    completion = completion_mask.bool()
    columns = completion.any(0)  # columns: [T]
    positions = torch.arange(T, device=columns.device)
    first_completion = torch.where(columns, positions, T).min()
    facts = shared_prompts.device_facts(input_ids, attention_mask, first_completion) if may_pack else []
    (attention_flag, completion_flag, first_column, on_padding, low, high, first, last, tokens, droppable, left,
     longest, *bad) = read_ints(
        nonbinary(attention_mask), nonbinary(completion_mask), completion[:, 0].any(),
        _first_flat_index(completion & ~attention_mask.bool()), *input_ids.aminmax(),
        first_completion, torch.where(columns, positions, -1).max(), completion.sum(),
        *padding_facts(attention_mask, completion_mask), *facts,
        *(() if advantages is None else first_nonfinite(advantages)), *masked_nonfinite(completion_mask, per_token),
        *(() if correction is None else first_nonfinite(correction[0], completion_mask)[:1]),
    )
    raise_if_nonbinary("attention_mask", attention_flag)
    raise_if_nonbinary("completion_mask", completion_flag)
    if first_column:
        raise ValueError("completion_mask: column 0 must be 0 (no earlier token predicts input_ids[:, 0])")
    if on_padding < B * T:
        raise ValueError("completion_mask: is 1 where attention_mask is 0 (row {}, column {}): a padding position "
                         "cannot be a completion token".format(*divmod(on_padding, T)))
    raise_unless_in_range("input_ids", low, high, vocab_size)
    sharing, bad = (bad[:3 + B - 1], bad[3 + B - 1:]) if facts else ([], bad)
    if advantages is not None:
        raise_if_nonfinite("advantages", advantages.shape, *bad[:2])
        bad = bad[2:]
    if correction is not None:
        bad, overflow = bad[:-1], bad[-1]
    raise_if_masked_nonfinite("completion_mask", per_token, bad)
    if correction is not None:
        raise_if_overflowed(correction[1], input_ids.shape, overflow)
    window = slice(1, 2) if tokens == 0 else slice(first, last + 1)
    layout = unpadded(attention_mask, droppable, left, longest)
    packing = None
    if sharing and tokens and layout.mask is None:
        packing = shared_prompts.plan(sharing, facts[-1], T, first, longest, layout.length)
    return _Batch(window, tokens, layout, packing)


def _first_flat_index(flags: torch.Tensor) -> torch.Tensor:
    """0-dim: the flat index of the first True in flags, flags.numel() when none is."""
    flat = flags.reshape(-1)
    return torch.where(flat, torch.arange(flat.numel(), device=flat.device), flat.numel()).min()


def _unwindow(values: torch.Tensor, shape: torch.Size, cols: slice) -> torch.Tensor:
    """values [B, W] of the window's columns -> [B, T], 0 outside the window."""
    full = torch.zeros(shape, dtype=values.dtype, device=values.device)
    full[:, cols] = values
    return full


def _hidden_and_window(model, input_ids, attention_mask, completion_mask, advantages=None, per_token=None,
                       correction=None):
    """hidden [B, W, H] of the positions that predict the window's tokens, the lm_head, and what _inspect read."""
    backbone, head = backbone_and_head(model)
    check_inputs_on_head_device(model, head, input_ids)
    batch = _inspect(input_ids, attention_mask, completion_mask, head.weight.shape[0], advantages, per_token,
                     correction, may_pack=shared_prompts.supports(backbone.config))
    cols = batch.window
    predicting = slice(cols.start - 1, cols.stop - 1)  # the columns whose hidden states predict the window's tokens
    if batch.packing is None:
        hidden = run_backbone(backbone, input_ids, batch.layout)
        check_on_head_device(head, "the base model's hidden states", hidden)
        return take_columns(hidden, batch.layout, predicting), head, batch  # [B, W, H]
    shared_prompts.use_packed_attention(backbone.config)
    packed_ids, positions = shared_prompts.packed_inputs(input_ids, batch.packing)
    hidden = backbone(input_ids=packed_ids, position_ids=positions,
                      attention_mask=shared_prompts.placeholder_mask(packed_ids), use_cache=False,
                      **{shared_prompts.PACKING_KWARG: shared_prompts.layout(batch.packing)}).last_hidden_state
    check_on_head_device(head, "the base model's hidden states", hidden)
    return shared_prompts.take_columns(hidden, batch.packing, predicting), head, batch  # [B, W, H]


@on_model_device
def grpo_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    config: GRPOLossConfig | None = None,
    return_entropy: bool = False,
    token_weights: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    return_logps: bool = False,
    rollout_logps: torch.Tensor | None = None,
    rollout_correction: RolloutCorrection | None = None,
    backend: str = "auto",
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of `model` on input_ids [B, T] through fastgrpo.fused_linear_grpo_loss (no [B, T, V] logits).

    model: any transformers causal LM (or PEFT wrapper) whose get_output_embeddings() has a [V, H] weight and whose
    base model returns last_hidden_state, patched or not. attention_mask, completion_mask [B, T]; advantages [B] or
    [B, T]; old_logps / ref_logps [B, T] as returned by sequence_logprobs; token_weights [B, T] (per-token weights
    of the policy term, e.g. a rollout importance-sampling correction) and sampling_logps [B, T] (the rollout
    engine's log-probs, for the off-policy mask) aligned the same way. config / options: a GRPOLossConfig and
    keyword fields on top (softcap defaults to the model's own). Returns (loss, metrics). return_logps: the metrics
    also hold "logps", the per-token log-probs [B, T] the loss was computed from, laid out as sequence_logprobs
    returns them (detached, fp32 for a bf16 / fp32 model, 0 where completion_mask is 0): with one optimizer step per
    batch these are its old log-probs, without a no-grad pass of their own. rollout_correction (with rollout_logps
    [B, T], the engine's log-probs): the loss weights its policy term by fastgrpo.loss.correction's weights of
    rollout_logps towards old_logps, or, without old_logps (one optimizer step per batch), towards the log-probs of
    this forward (the lm_head run once more without grad: no separate pass of the model), in place of token_weights.
    Where completion_mask is 1, a NaN / inf or positive old or ref log-prob, a negative token weight and an inf or
    positive rollout or sampling log-prob (NaN: a token the engine could not score, counted 0) are refused in the one
    value read, as is, with old_logps, a weight that overflowed to inf (clip_max None); without old_logps such a
    weight is refused in a second read, and so is a completion token where attention_mask is 0 (padding).
    Adjacent rows that hold the same prompt run it once (fastgrpo.loss.shared_prompts).
    """
    check_shape("input_ids", input_ids, (None, None))
    check_per_token_inputs(*input_ids.shape, advantages, old_logps, ref_logps)
    check_floating(old_logps=old_logps, ref_logps=ref_logps)
    check_extra_inputs(*input_ids.shape, token_weights, sampling_logps)
    per_token = finite_where_completion(old_logps, ref_logps, token_weights, sampling_logps)
    weights = None  # the rollout correction's token_weights, when known before the forward (from old_logps)
    if rollout_correction is not None:
        _check_correction(rollout_correction, rollout_logps, token_weights, input_ids.shape)
        per_token["rollout_logps"] = engine_logps(rollout_logps)
        if old_logps is not None:
            check_mask("completion_mask", completion_mask, "input_ids", input_ids)
            weights = _correction_weights(rollout_correction, old_logps, rollout_logps, completion_mask)
    if "softcap" not in options and (config is None or config.softcap is None):
        options["softcap"] = logit_softcap(model)
    cfg = resolve(config, options)
    checked = None if weights is None else (weights, rollout_correction.level)
    hidden, head, batch = _hidden_and_window(model, input_ids, attention_mask, completion_mask, advantages,
                                             per_token, checked)
    cols = batch.window

    def window(t):
        return None if t is None else t[:, cols]

    self_weighted = rollout_correction is not None and weights is None
    if self_weighted:  # from this forward's log-probs
        own = _own_logps(hidden, head, input_ids, cols, cfg, backend)
        weights = _correction_weights(rollout_correction, own, rollout_logps, completion_mask)
    if rollout_correction is not None:
        token_weights = weights
    loss, metrics = fused_linear_grpo_loss_of_checked_values(
        batch.completion_tokens, hidden, head.weight, input_ids[:, cols], completion_mask[:, cols],
        advantages if advantages.dim() == 1 else window(advantages),
        old_logps=window(old_logps), ref_logps=window(ref_logps), config=cfg, bias=head_bias(head),
        return_entropy=return_entropy, token_weights=window(token_weights), sampling_logps=window(sampling_logps),
        return_logps=return_logps, backend=backend,
    )
    if self_weighted and rollout_correction.clip_max is None:
        # Only unbounded weights can overflow: a host read of its own (the default bound, 3.0, never pays it), after
        # the loss is queued so that the GPU runs it while the host waits.
        overflow = read_ints(first_nonfinite(weights, completion_mask)[0])[0]
        raise_if_overflowed(rollout_correction.level, input_ids.shape, overflow)
    if return_logps:
        metrics["logps"] = _unwindow(metrics["logps"], input_ids.shape, cols)
    return loss, metrics


def _check_correction(correction, rollout_logps, token_weights, shape) -> None:
    if not isinstance(correction, RolloutCorrection):
        raise ValueError(f"rollout_correction: expected a fastgrpo.loss.correction.RolloutCorrection, got "
                         f"{type(correction).__name__}")
    check_rollout_correction(*correction)
    if correction.mode == "none":
        raise ValueError("rollout_correction: expected mode 'truncate' or 'mask' (None for no correction), got 'none'")
    if token_weights is not None:
        raise ValueError("token_weights: the rollout correction computes them; pass one or the other")
    if rollout_logps is None:
        raise ValueError("rollout_logps: the rollout correction needs the engine's log-probs [B, T], got None")
    check_shape("rollout_logps", rollout_logps, tuple(shape))


@torch.no_grad()
def _correction_weights(correction, old_logps, rollout_logps, completion_mask) -> torch.Tensor:
    """token_weights [B, T] of the correction of rollout_logps towards old_logps [B, T], in fp32."""
    return correction_weights(old_logps.float(), rollout_logps.float(), completion_mask, correction)


@torch.no_grad()
def _own_logps(hidden, head, input_ids, cols, cfg, backend) -> torch.Tensor:
    """This forward's log-probs [B, T] fp32, 0 outside the window: the lm_head once more on the detached hidden
    states, as sequence_logprobs computes them."""
    # input_ids were checked by _inspect: no second host sync, which here would wait for the whole forward
    own = fused_linear_logprobs_of_checked_values(hidden.detach(), head.weight, input_ids[:, cols],
                                                  temperature=cfg.temperature, bias=head_bias(head),
                                                  softcap=cfg.softcap, backend=backend)
    return _unwindow(own.float(), input_ids.shape, cols)


@torch.no_grad()
@on_model_device
def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    disable_adapter: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs [B, T] (and entropy [B, T]) of input_ids under `model` at `temperature`, 0 where
    completion_mask is 0; fp32 for an fp16 / bf16 / fp32 model, fp64 for an fp64 one; for old / reference
    log-probs (pass the temperature the completions were sampled at). disable_adapter=True runs a PEFT model with its
    adapter disabled (the reference policy, without a second copy of the weights)."""
    check_temperature(temperature)
    if disable_adapter and not callable(getattr(model, "disable_adapter", None)):
        raise ValueError(f"disable_adapter: needs a PEFT model, got {type(model).__name__}")
    # The head too runs with the adapter off: modules_to_save=["lm_head"] swaps in a trained copy of it.
    with model.disable_adapter() if disable_adapter else contextlib.nullcontext():
        hidden, head, batch = _hidden_and_window(model, input_ids, attention_mask, completion_mask)
        cols = batch.window
        out = fused_linear_logprobs_of_checked_values(  # input_ids checked by _inspect, in its one host read
            hidden, head.weight, input_ids[:, cols], temperature=temperature, bias=head_bias(head),
            softcap=logit_softcap(model), return_entropy=return_entropy, backend=backend,
        )
    mask = completion_mask[:, cols].bool()
    full = [_unwindow(torch.where(mask, values, 0.0), input_ids.shape, cols)
            for values in (out if return_entropy else (out,))]
    return tuple(full) if return_entropy else full[0]
