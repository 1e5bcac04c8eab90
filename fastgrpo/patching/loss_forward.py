"""The causal-LM forward bound by patch_model(fused_loss=True): with `labels`, the token cross-entropy comes from
the final hidden states through fastgrpo.fused_linear_logprobs, never materializing [B, T, V] logits."""
from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from fastgrpo._checks import check_integer_ids, check_shape, read_ints
from fastgrpo.hf.architectures import Architecture
from fastgrpo.hf.binding import signature_with_self
from fastgrpo.hf.models import adapters_active, head_bias
from fastgrpo.ops.fused_linear import fused_linear_logprobs_of_checked_values

IGNORE_INDEX = -100  # the labels value Hugging Face's loss skips
# transformers 5.17 names the outputs' cache past_key_values; later 5.x name it cache and warn on the old name
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def causal_lm_forward(previous: Callable, backbone_attr: str, arch: Architecture) -> Callable:
    """Without labels, in eval mode (unless skip_logits=True), with TRL's fused_lm_head keyword, with
    return_dict=False, with PEFT adapters on the lm_head (the fused loss reads its weight alone) or with its weight
    offloaded (on the meta device until the lm_head's own forward, which the fused loss does not call, has an
    accelerate hook load it): `previous` (the library forward). With labels in training mode (or skip_logits=True):
    HF's loss (shifted labels, or shift_labels as given, sum over the non-ignored tokens divided by their count or by
    num_items_in_batch, on logits soft-capped as the config says), returned with logits=None."""

    def forward(self, *args, **kwargs):
        if "fused_lm_head" in kwargs:
            # TRL's keyword (its trainers' add_fused_lm_head): the model was patched after TRL wrapped its forward,
            # and TRL's head gives the log_probs, entropy and is_top1 its trainer reads
            return previous(*args, **kwargs)
        loss_alone = _loss_alone(self, kwargs)
        # a tuple caller reads logits at [1]: the library's forward gives them (this one has none to give)
        tuple_out = kwargs.get("return_dict", getattr(self.config, "return_dict", True)) is False
        if not loss_alone or tuple_out or not _head_weight_usable(self.get_output_embeddings()):
            return previous(*args, **kwargs)
        labels = kwargs.pop("labels")
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)  # [B, T]: position t's target (HF's loss takes it as given)
        kwargs.pop("logits_to_keep", None)
        out = getattr(self, backbone_attr)(*args, **kwargs)
        hidden = out.last_hidden_state
        name, given = ("labels", labels) if shift_labels is None else ("shift_labels", shift_labels)
        check_shape(name, given, hidden.shape[:2])
        check_integer_ids(name, given)
        if shift_labels is None:  # position t predicts token t + 1
            given, hidden = labels[:, 1:], hidden[:, :-1]
        targets = given.to(hidden.device)  # as HF's loss: labels may come on another device
        valid = targets != IGNORE_INDEX
        hidden, targets = hidden[valid], targets[valid]  # hidden: [n, H], targets: [n]
        lm_head = self.get_output_embeddings()
        vocab = lm_head.weight.shape[0]
        if targets.numel():
            low, high = read_ints(*targets.aminmax())
            if low < 0 or high >= vocab:
                raise ValueError(f"{name}: expected ids in [0, {vocab}) or {IGNORE_INDEX} (ignored), got min {low} "
                                 f"max {high}")
        logps = fused_linear_logprobs_of_checked_values(
            hidden, lm_head.weight, targets, bias=head_bias(lm_head), softcap=arch.logit_softcap(self.config)
        )
        denom = valid.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        # (-logps).sum(): no ignored label at all gives loss 0.0, not -0.0 (HF's mean gives NaN, 0 / 0; with the
        # Trainer's num_items_in_batch, 0); the gradient is zero either way
        loss = (-logps).sum() / torch.as_tensor(denom, device=logps.device, dtype=logps.dtype)
        return CausalLMOutputWithPast(
            loss=loss, logits=None, hidden_states=out.hidden_states, attentions=out.attentions,
            **{_CACHE_FIELD: getattr(out, _CACHE_FIELD, None)},
        )

    # HF reads a forward's parameter names (signature_with_self); shown with `self`, which a bound method's
    # signature leaves out.
    forward.__signature__ = signature_with_self(previous)
    return forward


def _loss_alone(model, kwargs: dict) -> bool:
    """Whether the labels= forward gives the loss alone, popping Liger's `skip_logits` keyword (the Trainer passes it
    under use_liger_kernel for an evaluation that keeps the loss only). Its default, Liger's: in training mode. In
    eval mode the Trainer's evaluate / predict hand the logits to compute_metrics, as HF code reading out.logits
    does."""
    skip_logits = kwargs.pop("skip_logits", None)
    if not isinstance(skip_logits, (bool, type(None))):
        raise ValueError(f"skip_logits: expected True, False or None, got {skip_logits!r}")
    labelled = kwargs.get("labels") is not None
    if skip_logits and not labelled:
        raise ValueError("skip_logits: True gives the labels= loss without logits, and no labels were passed")
    return labelled and (model.training if skip_logits is None else skip_logits)


def _head_weight_usable(head) -> bool:
    """Whether head.weight (and head_bias) is what the lm_head's forward multiplies by: not with active PEFT adapters
    (their delta is not in it), nor on the meta device (device_map offload: the weight is loaded by the hook)."""
    return not adapters_active(head) and not head.weight.is_meta
