"""Lookups on a Hugging Face causal LM (or a PEFT wrapper of one): the transformers internals the rest of fastgrpo
needs, in one place.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn

from fastgrpo.hf.architectures import ARCHITECTURES, Architecture
from fastgrpo.hf.peft import check_layer_adapters, check_not_mixed


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper, or the model itself; a PeftMixedModel is refused
    (check_not_mixed)."""
    check_not_mixed(model)
    if is_peft_model(model):
        return model.get_base_model()
    return model


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def lora_rank(model: nn.Module) -> int | None:
    """The rank of a PEFT model's active LoRA adapter; None for another model or tuner."""
    config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", "default"))
    return getattr(config, "r", None)


def values_held(param: torch.Tensor) -> int:
    """The values a parameter holds: a bitsandbytes 4-bit weight (Params4bit) packs two in a byte of its storage
    dtype, so its numel() counts the storage, not the values."""
    packed = 2 * param.element_size() if type(param).__name__ == "Params4bit" else 1
    return param.numel() * packed


def adapters_active(module: nn.Module) -> bool:
    """A PEFT tuner layer (e.g. LoRA) whose unmerged adapters run in its forward: its `.weight` is the base alone."""
    return (
        hasattr(module, "base_layer")
        and not getattr(module, "disable_adapters", False)
        and not getattr(module, "merged", False)
    )


def head_bias(head: nn.Module) -> torch.Tensor | None:
    """The bias the lm_head's forward adds, or None. PEFT's TrainableTokensWrapper (trainable_token_indices on an
    lm_head, or on the embedding it is tied to) has no `.bias`: its forward is F.linear(x, merged weight) alone."""
    return getattr(head, "bias", None)


def architecture(model: nn.Module) -> Architecture:
    """The patch table's entry of a transformers causal LM; ValueError for anything else."""
    config = getattr(model, "config", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if config is None or not callable(get_head) or get_head() is None:
        raise ValueError(
            f"model: expected a causal LM with an lm_head (e.g. from AutoModelForCausalLM), got {type(model).__name__}"
        )
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model: model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def decoder_layers(model: nn.Module, arch: Architecture) -> list[nn.Module]:
    """The modules whose direct child is an attention module of the architecture, in model order."""
    return [
        m for m in model.modules() if any(type(c).__name__ in arch.attention_classes for c in m.children())
    ]


def split_recomputed(layers: list[nn.Module], n: int) -> tuple[list[nn.Module], list[nn.Module]]:
    """(the first n decoder layers, recomputed in the backward; the rest, which keep their activations): the split
    of recompute_layers=n, which cannot exceed the model's layers."""
    if n > len(layers):
        raise ValueError(f"recompute_layers: expected at most the model's {len(layers)} decoder layers, got {n}")
    return layers[:n], layers[n:]


def hf_checkpointing_only_first(model: nn.Module, n: int) -> None:
    """HF gradient checkpointing off in the decoder layers after the first n of `model` (a transformers causal LM or
    a PEFT wrapper of one): HF's flag is per layer, and a kept layer's activations stay for the backward."""
    hf_model = unwrap_peft(model)
    for layer in split_recomputed(decoder_layers(hf_model, architecture(hf_model)), n)[1]:
        layer.gradient_checkpointing = False


_ONE_DEVICE = ("fastgrpo's kernels and fused loss run on one device: load the model onto one GPU (device_map={'': 0}), "
               "or shard it across GPUs with FSDP2 (`torchrun --nproc_per_node N -m fastgrpo train`)")


def check_one_device(model: nn.Module) -> None:
    """The model's weights on one device. A device_map across GPUs is refused: fastgrpo's Triton kernels launch on
    the current CUDA device and its stream, not on their tensors' device. Aside: weights on "meta" (accelerate's
    offload hooks load them for each call) and FSDP2's shards (DTensors; gathered onto the GPU for each forward)."""
    from torch.distributed.tensor import DTensor

    devices = sorted({str(p.device) for p in model.parameters() if not p.is_meta and not isinstance(p, DTensor)})
    if len(devices) > 1:
        raise ValueError(f"model: its weights are on {' and '.join(devices)} (a device_map across devices?); "
                         + _ONE_DEVICE)


def check_on_head_device(head: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """`tensor` (the batch, the input embedding, the backbone's hidden states) on the lm_head's device, which the fused
    loss runs on; one on "meta" aside (accelerate's offload hooks load it for each call)."""
    if tensor.device != head.weight.device and not tensor.is_meta:
        raise ValueError(f"model: its lm_head is on {head.weight.device} and {name} on {tensor.device} (a device_map "
                         "across devices?); " + _ONE_DEVICE)


def check_inputs_on_head_device(model: nn.Module, head: nn.Module, input_ids: torch.Tensor) -> None:
    """The batch and the input embedding, where the forward starts, on the lm_head's device (check_on_head_device):
    with the batch on the lm_head's GPU and the embedding on another, the final norm puts the hidden states on the
    lm_head's too, and only the embedding shows the split."""
    check_on_head_device(head, "input_ids", input_ids)
    check_on_head_device(head, "its input embedding", model.get_input_embeddings().weight)


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(backbone, lm_head) of any transformers causal LM or PEFT wrapper of one: the lm_head is
    get_output_embeddings() with a [V, H] weight, the backbone the base model (it returns last_hidden_state).

    Tied embeddings share the weight already. Weights on the meta device (accelerate's CPU / disk offload hooks move
    them there between calls) are an error: the fused loss reads lm_head.weight directly and would compute garbage.
    """
    check_layer_adapters(model)
    hf_model = unwrap_peft(model)
    get_head = getattr(hf_model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"model: expected a causal LM whose get_output_embeddings() has a [V, H] weight, got "
                         f"{type(hf_model).__name__}")
    if weight.is_meta:
        raise ValueError("model: lm_head.weight is on the meta device (accelerate offload hooks?); the fused loss "
                         "reads the weight itself: load the model onto one device (no device_map offload)")
    if adapters_active(head):
        raise ValueError(
            f"model: the lm_head ({type(head).__name__}) has active PEFT adapters, which the fused loss would skip "
            "(it reads lm_head.weight); leave lm_head out of target_modules, or merge the adapters first"
        )
    prefix = getattr(hf_model, "base_model_prefix", "")
    backbone = getattr(hf_model, prefix, None) if prefix else None
    if not isinstance(backbone, nn.Module):
        raise ValueError(f"model: found no base model at base_model_prefix {prefix!r} of {type(hf_model).__name__}")
    return backbone, head


def logit_softcap(model: nn.Module) -> float | None:
    """The soft-cap the model applies to its logits (Gemma-2: config.final_logit_softcapping), or None; None for a
    model outside the patch table that has no such setting."""
    hf_model = unwrap_peft(model)
    config = getattr(hf_model, "config", None)
    arch = ARCHITECTURES.get(getattr(config, "model_type", None))
    if arch is not None:
        return arch.logit_softcap(config)
    return getattr(config, "final_logit_softcapping", None)


def has_sliding_window(config) -> bool:
    """Whether the model windows any layer's attention: every layer without `layer_types`, the sliding ones with
    them."""
    layer_types = getattr(config, "layer_types", None)
    return bool(getattr(config, "sliding_window", None)) and (
        layer_types is None or "sliding_attention" in layer_types)


def cache_keyword(model: nn.Module) -> str:
    """transformers 5.17 takes the cache as `past_key_values`; later 5.x renamed it `cache` (old name deprecated)."""
    inner = unwrap_peft(model)
    # the class's forward, whatever is bound on the instance (patch_model, accelerate hooks)
    return "cache" if "cache" in inspect.signature(type(inner).forward).parameters else "past_key_values"


def loading_attention(model: str) -> str:
    """The attention implementation to load the causal LM `model` (a folder or Hub name) with: SDPA where its
    transformers class has it, else eager (Gemma-2, whose attention soft-caps its scores: transformers refuses to
    load it with "sdpa"). Asked for by name rather than left to transformers, which would take one a config.json
    names."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(AutoConfig.from_pretrained(model)), None)
    return "eager" if model_class is not None and not model_class._supports_sdpa else "sdpa"


@contextlib.contextmanager
def attention_implementation(model: nn.Module, name: str | None) -> Iterator[str]:
    """Within the block the model's attention runs through the registered attention function `name` (None: keep
    the model's); yields the implementation the model had, which is restored afterwards."""
    config = unwrap_peft(model).config
    previous = config._attn_implementation
    if name is not None:
        config._attn_implementation = name
    try:
        yield previous
    finally:
        config._attn_implementation = previous


def register_attention(name: str, function) -> None:
    """Make `function` selectable as a model's attention implementation under `name` (transformers'
    AttentionInterface)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)
