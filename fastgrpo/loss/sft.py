"""The SFT loss of a Hugging Face causal LM: cross-entropy of the response tokens through the fused lm_head.

The backbone runs on every position (without the mask where that changes nothing read:
fastgrpo.loss.row_layout); only the hidden states that predict a response token go through
fastgrpo.fused_linear_logprobs (its chunked lm_head + log-softmax), so neither [B, T, V] logits nor logits of the
prompt positions ever exist. The fused cross-entropy is -logp of the labels.

Normalisation: the loss is the SUM of -log p(response token) divided by `num_items_in_batch`, the response-token
count of the whole optimizer step (as HF's Trainer and TRL pass it): micro-batches of a gradient-accumulation
window then add up to the step's per-token mean, however the rows were split. Without it the divisor is this
call's own response-token count (a per-token mean of the micro-batch).
"""
from __future__ import annotations

import math
import numbers

import torch

from fastgrpo._checks import check_binary_mask, check_integer_ids, check_shape, raise_unless_in_range, read_ints
from fastgrpo._device import on_model_device
from fastgrpo.hf.models import (
    backbone_and_head,
    check_inputs_on_head_device,
    check_on_head_device,
    head_bias,
    logit_softcap,
)
from fastgrpo.loss.row_layout import padding_facts, run_backbone, take_positions, unpadded
from fastgrpo.ops.fused_linear import fused_linear_logprobs_of_checked_values


def _check_inputs(input_ids, attention_mask, response_mask, num_items_in_batch) -> None:
    check_shape("input_ids", input_ids, (None, None))
    if input_ids.shape[0] == 0 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids: expected [B>=1, T>=2], got {list(input_ids.shape)}")
    check_binary_mask("attention_mask", attention_mask, "input_ids", input_ids)
    check_binary_mask("response_mask", response_mask, "input_ids", input_ids)
    if response_mask[:, 0].any():
        raise ValueError("response_mask: column 0 must be 0 (no earlier token predicts input_ids[:, 0])")
    if (response_mask.bool() & ~attention_mask.bool()).any():
        raise ValueError("response_mask: is 1 where attention_mask is 0 (a padding position cannot be a label)")
    if num_items_in_batch is not None and not _positive_count(num_items_in_batch):
        raise ValueError(f"num_items_in_batch: expected > 0 (response tokens of the step) or None, "
                         f"got {num_items_in_batch!r}")


def _positive_count(value) -> bool:
    """A finite number > 0, or a one-element tensor of one (inf made the loss 0 silently)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(value.isfinite() & (value > 0))
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf


@on_model_device
def sft_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum of -log p(input_ids[:, t] | input_ids[:, :t]) over the positions where response_mask is 1, divided by
    num_items_in_batch (None: the number of those positions). input_ids, attention_mask, response_mask: [B, T]
    (right or left padding; response_mask has the alignment of grpo_loss's completion_mask).

    model: any transformers causal LM or PEFT wrapper whose get_output_embeddings() has a [V, H] weight, patched
    or not (a soft-capped head is capped as in the model). Returns (loss, metrics) with metrics `nll_sum` (the
    detached sum) and `response_tokens`; a batch without response tokens gives a zero loss that still has a grad.
    """
    _check_inputs(input_ids, attention_mask, response_mask, num_items_in_batch)
    backbone, head = backbone_and_head(model)
    check_inputs_on_head_device(model, head, input_ids)
    check_integer_ids("input_ids", input_ids)
    # The ids' range and the row layout's facts in one host read (each read waits for the GPU's queue)
    low, high, *facts = read_ints(*input_ids.aminmax(), *padding_facts(attention_mask, response_mask))
    raise_unless_in_range("input_ids", low, high, head.weight.shape[0])
    layout = unpadded(attention_mask, *facts)
    hidden = run_backbone(backbone, input_ids, layout)
    check_on_head_device(head, "the base model's hidden states", hidden)
    labels = response_mask[:, 1:].bool()  # labels: [B, T-1], position t-1 predicts token t
    # Only the response positions are kept: the fused head does no work for prompt or padding positions.
    selected = take_positions(hidden, layout, *labels.nonzero(as_tuple=True))  # selected: [n, H]
    logp = fused_linear_logprobs_of_checked_values(  # the ids were checked above: no second range read
        selected, head.weight, input_ids[:, 1:][labels], bias=head_bias(head), softcap=logit_softcap(model),
        backend=backend,
    )  # logp: [n] fp32
    nll_sum = (-logp).sum()  # no response token: 0.0, not -0.0
    count = labels.sum()
    divisor = count.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.reshape(())  # a [1] count would make the loss [1]
    return nll_sum / divisor, {"nll_sum": nll_sum.detach(), "response_tokens": count}
