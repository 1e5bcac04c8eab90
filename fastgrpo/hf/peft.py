"""PEFT and bitsandbytes internals: LoRA adapters merged into a (dequantized) base for export and weight sync, and the
dense linears of a model with their effective weights (the rollout's decode weights,
fastgrpo/rollout/decode_weights.py)."""
from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable

import torch


def _dequantized(param: torch.Tensor) -> torch.Tensor:
    if type(param).__name__ == "Params4bit":  # bitsandbytes 4-bit weight
        from peft.utils.integrations import dequantize_bnb_weight

        return dequantize_bnb_weight(param, state=param.quant_state)
    return param.detach()


UNSUPPORTED = "unsupported adapter layout"  # the end of every refusal of an adapter layout the merge cannot merge


def check_mergeable(model: torch.nn.Module) -> None:
    """Refuse, in one line ending UNSUPPORTED, a PEFT model whose adapters merged_state_dict cannot merge into a model
    folder: a LoRA variant (DoRA) or LoRA bias over a bitsandbytes-quantized base, a LoRA bias where the base layer has
    no bias to add it to, a tuner other than LoRA, LoHa, LoKr, IA3, VeRA and OFT (_tuner_part), or one of those over
    a quantized base.
    Structural: no weight is copied or merged (cheap on an 8B model), so a run that will export calls it before its
    first step, and export_model before it merges."""
    from transformers import AutoModelForCausalLM

    names = {name for part in _merge_parts(model) for name in part.names}
    with torch.device("meta"):  # the merged model's parameter names, as export_model builds it
        plain = AutoModelForCausalLM.from_config(merged_config(model))
    missing = [name for name, _ in plain.named_parameters() if name not in names]
    if missing:
        raise ValueError(f"model: merged weights lack {missing[:3]}; {UNSUPPORTED}")


def peft_type_name(config) -> str:
    """A PEFT config's tuner type as its name ("LORA", "TRAINABLE_TOKENS", "ADALORA", ...), whether peft_type holds a
    PeftType or the plain string."""
    return getattr(config.peft_type, "value", config.peft_type)


def check_not_mixed(model: torch.nn.Module) -> None:
    """Refuse, in one line, a PeftMixedModel (adapters of several tuner types: get_peft_model(..., mixed=True)): it
    has no get_base_model, and taken for the transformers model it was patched and trained as one (the fused loss
    found no last_hidden_state, the rollout no _supports_sdpa)."""
    if type(model).__name__ == "PeftMixedModel":
        raise ValueError("model: a PeftMixedModel (get_peft_model(..., mixed=True), adapters of several tuner types "
                         "at once) is not supported; use a PeftModel, whose adapters are of one tuner type")


def check_layer_adapters(model: torch.nn.Module) -> None:
    """Refuse, in one line, a PEFT model whose adapter is prompt learning (prompt / prefix tuning, p-tuning, ...):
    PeftModel's forward adds its virtual tokens or past keys and values, while fastgrpo's loss and rollout engine run
    the base model's own layers, which would neither train nor sample with it; and a PeftMixedModel
    (check_not_mixed)."""
    check_not_mixed(model)
    for name, config in getattr(model, "peft_config", {}).items():
        if getattr(config, "is_prompt_learning", False):
            kind = peft_type_name(config)
            raise ValueError(f"model: adapter {name!r} is {kind} (prompt learning), which PeftModel's forward adds as "
                             "virtual tokens, while fastgrpo's loss and rollout run the base model's layers; use an "
                             "adapter in the layers (LoRA, ...)")


# LoRA initializations that move a part of each base weight into the adapter (W_base = W - B A * scale at init, or a
# quantized W): the model is the original one only with the adapter on
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def base_changing_init(model: torch.nn.Module) -> tuple[str, str] | None:
    """(adapter name, init_lora_weights) of the first adapter of a PEFT model whose initialization changed the base
    weights (BASE_CHANGING_INITS, "pissa_niter_<n>" too): its base with the adapters disabled is not the model it
    started as. None where no adapter did (another tuner's config has no init_lora_weights)."""
    for name, config in getattr(model, "peft_config", {}).items():
        init = getattr(config, "init_lora_weights", None)
        if isinstance(init, str) and init.lower().split("_niter_")[0] in BASE_CHANGING_INITS:
            return name, init
    return None


def merged_config(model: torch.nn.Module, **changes):
    """The config of the model a PEFT model merges into: its base's, unquantized, with `changes` set."""
    config = model.get_base_model().config
    settings = {k: v for k, v in config.to_dict().items() if k != "quantization_config"}
    return config.__class__.from_dict({**settings, **changes})


def merged_state_dict(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The base model's state dict with every active LoRA adapter merged: W = dequant(W_base) + B A * scale (a LoRA
    variant such as DoRA, or a LoRA bias, by PEFT's own merge on a copy of the layer, as are the adapters of LoHa,
    LoKr, IA3, VeRA and OFT layers), each modules_to_save
    wrapper's trained copy (its active adapter's) in its place, as merge_and_unload keeps them, and each
    trainable_token_indices wrapper's weight with its trained rows in place.

    The merge runs in fp32 on dequantized weights, on the weights' device, and is cast to `dtype` once: merging
    into a 4-bit base would re-quantize the update away. The result lives in CPU memory (an 8B model is 16 GB in
    bf16, more than a 24 GB card has left), one layer's temporaries at a time. The trained model is left untouched.
    """
    merged = {}
    for part in _merge_parts(model):
        for key, value in part.values().items():
            merged[key] = (value.to(dtype) if value.is_floating_point() else value).cpu()
    return merged


@dataclasses.dataclass(frozen=True)
class _MergePart:
    """Tensors of the merged model: their state-dict names, and a function computing them (name -> tensor)."""

    names: tuple[str, ...]
    values: Callable[[], dict[str, torch.Tensor]]


def _merge_parts(model: torch.nn.Module) -> list[_MergePart]:
    """What merged_state_dict holds, module by module, before any tensor is computed; a LoRA layer PEFT's merge
    cannot merge is refused here (_check_peft_merge)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper

    from peft.tuners.tuners_utils import BaseTunerLayer

    # a tuner layer wraps its base layer and its adapters: it is one part (a LoRA layer, or another tuner's, refused
    # by _tuner_part where PEFT's merge is not known to write what its forward runs)
    wrappers = (BaseTunerLayer, ModulesToSaveWrapper, TrainableTokensWrapper)
    base = model.get_base_model()
    parts = []
    for name, module in base.named_modules():
        if any(isinstance(parent, wrappers) for parent in _ancestors(base, name)):
            continue
        prefix = f"{name}." if name else ""
        if isinstance(module, LoraLayer):
            parts.append(_lora_part(name, module))
        elif isinstance(module, BaseTunerLayer):
            parts.append(_tuner_part(name, module))
        elif isinstance(module, TrainableTokensWrapper):  # trainable_token_indices: rows of a weight trained
            # its forward runs the merged weight alone (F.linear without the bias of a head it wraps)
            parts.append(_MergePart((f"{prefix}weight",), functools.partial(_with_trained_tokens, prefix, module)))
        else:
            if isinstance(module, ModulesToSaveWrapper):  # e.g. modules_to_save=["lm_head"]: a trained copy
                tensors = dict(_module_in_use(module).state_dict())
            else:
                tensors = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
            tensors = {f"{prefix}{pname}": tensor for pname, tensor in tensors.items()}
            parts.append(_MergePart(tuple(tensors), functools.partial(_dequantized_all, tensors)))
    return parts


def _lora_part(name: str, module: torch.nn.Module) -> _MergePart:
    # merged (PEFT's merge_adapter): the weight holds the adapters already, as merge_and_unload leaves it
    adapters = [] if module.merged else [a for a in module.active_adapters
                                         if a in module.lora_A or a in module.lora_embedding_A]
    has_bias = getattr(module.base_layer, "bias", None) is not None  # an embedding has none
    names = (f"{name}.weight", *([f"{name}.bias"] if has_bias else []))
    if has_variant_or_bias(module, adapters):
        _check_peft_merge(name, module, adapters)
        return _MergePart(names, lambda: dict(zip(names, _merged_by_peft(module, adapters))))
    return _MergePart(names, lambda: dict(zip(names, _merged_by_deltas(module, adapters))))


def _merged_tuners() -> dict[str, type]:
    """The tuner layers other than LoRA whose PEFT merge the export runs, each checked to give a model computing what
    the PEFT model's forward does (tests/test_tuners.py), by the names PEFT gives them."""
    from peft.tuners.ia3 import IA3Layer
    from peft.tuners.loha import LoHaLayer
    from peft.tuners.lokr import LoKrLayer
    from peft.tuners.oft import OFTLayer
    from peft.tuners.vera import VeraLayer

    return {"LoHa": LoHaLayer, "LoKr": LoKrLayer, "IA3": IA3Layer, "VeRA": VeraLayer, "OFT": OFTLayer}


def _tuner_part(name: str, module: torch.nn.Module) -> _MergePart:
    """A tuner layer other than LoRA (_merged_tuners): its active adapters merged into its base by PEFT's own merge
    on an fp32 copy of the layer (_merged_by_peft); any other tuner is refused."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuners = _merged_tuners()
    kind = next((c.__name__ for c in type(module).__mro__ if c.__name__.endswith("Layer") and c is not BaseTunerLayer
                 and issubclass(c, BaseTunerLayer)), type(module).__name__)  # e.g. HRALayer, not its Linear
    if not isinstance(module, tuple(tuners.values())):
        raise ValueError(f"model: {name}: the export merges LoRA, {', '.join(tuners)} adapters, not {kind} ones; "
                         f"{UNSUPPORTED}")
    base = module.get_base_layer()
    if not isinstance(base, (torch.nn.Linear, torch.nn.Embedding)) or not base.weight.is_floating_point():
        raise ValueError(f"model: {name}: {kind} over a {type(base).__name__} base (quantized, or not a linear or "
                         f"an embedding) cannot be merged into a plain weight; {UNSUPPORTED}")
    adapters = [] if module.merged else [a for a in module.active_adapters  # merged: as in _lora_part
                                         if any(a in getattr(module, attr) for attr in module.adapter_layer_names)]
    names = (f"{name}.weight", *([f"{name}.bias"] if getattr(base, "bias", None) is not None else []))
    return _MergePart(names, lambda: dict(zip(names, _merged_by_peft(module, adapters))))


def has_variant_or_bias(layer: torch.nn.Module, adapters: list[str]) -> bool:
    """Whether a PEFT LoRA layer's `adapters` hold what W + B A * scale leaves out: a variant (DoRA rescales the
    columns of W + B A by its magnitude vector) or a LoRA bias (added to the base's)."""
    return any(a in layer.lora_variant or layer.lora_bias.get(a) for a in adapters)


def _check_peft_merge(name: str, module: torch.nn.Module, adapters: list[str]) -> None:
    """The refusals of _merged_by_peft's merge, said from the layer's structure alone."""
    base = module.get_base_layer()
    if not base.weight.is_floating_point():  # a bitsandbytes 4- or 8-bit base
        raise ValueError(f"model: {name}: a LoRA variant or bias over a quantized base cannot be merged without "
                         f"quantizing the merged weight again; {UNSUPPORTED}")
    if getattr(base, "bias", None) is None and any(module.lora_bias.get(a) for a in adapters):
        # PEFT's merge raises this (a RuntimeError) once it has merged the weight
        raise ValueError(f"model: {name}: Impossible to merge LoRA with `lora_bias=True` because the base layer has "
                         f"no bias; {UNSUPPORTED}")


def _merged_by_deltas(module: torch.nn.Module, adapters: list[str]) -> tuple[torch.Tensor, ...]:
    """(weight[, bias]) of a LoRA layer whose adapters are plain: W + B A * scale summed in fp32."""
    weight = _dequantized(module.base_layer.weight).float()
    for adapter in adapters:  # an embedding's adapters are in lora_embedding_A / _B
        weight = weight + module.get_delta_weight(adapter).float()
    bias = getattr(module.base_layer, "bias", None)
    return (weight,) if bias is None else (weight, bias.detach())


def _merged_by_peft(module: torch.nn.Module, adapters: list[str]) -> tuple[torch.Tensor, ...]:
    """(weight[, bias]) of a LoRA layer whose adapters W + B A * scale does not describe (has_variant_or_bias),
    merged by PEFT's own merge into an fp32 copy of the layer: the trained layer stays unmerged."""
    layer = copy.deepcopy(module).float()
    layer.merge(safe_merge=True, adapter_names=adapters)
    base = layer.get_base_layer()
    bias = getattr(base, "bias", None)
    return (base.weight.detach(),) if bias is None else (base.weight.detach(), bias.detach())


def _with_trained_tokens(prefix: str, wrapper: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{prefix}weight": trained_tokens_weight(wrapper.token_adapter)}


def trained_tokens_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A PEFT TrainableTokensLayer's weight as its forward runs it, as merge_and_unload writes it: the base's, each
    active adapter's trained rows in place (the base weight itself where the adapters are off or merged)."""
    return layer.get_merged_weights(_trained_token_adapters(layer)).detach()


def _trained_token_adapters(layer: torch.nn.Module) -> list[str]:
    """The adapters whose trained rows a TrainableTokensLayer's forward puts in place."""
    if layer.disable_adapters or layer.merged:
        return []
    return [a for a in layer.active_adapters if a in layer.token_indices]


def trained_tokens_layer(module: torch.nn.Module) -> torch.nn.Module | None:
    """The PEFT TrainableTokensLayer that runs in `module`'s place: a trainable_token_indices wrapper's
    (TrainableTokensWrapper.token_adapter), or the module itself under PEFT's TrainableTokensConfig; else None."""
    from peft.tuners.trainable_tokens import TrainableTokensLayer
    from peft.utils.other import TrainableTokensWrapper

    if isinstance(module, TrainableTokensWrapper):
        return module.token_adapter
    return module if isinstance(module, TrainableTokensLayer) else None


def trained_tokens_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Full name of the base weight of each TrainableTokensLayer (as model.named_parameters() names it) -> the layer.
    A layer PEFT ties to another (a tied lm_head following the embedding's trained rows) runs its partner's base
    weight and rows: the partner's entry serves both."""
    from peft.tuners.trainable_tokens import TrainableTokensLayer

    layers = {id(layer.base_layer.weight): layer for layer in model.modules()
              if isinstance(layer, TrainableTokensLayer) and layer.tied_adapter is None}
    return {name: layers[id(param)] for name, param in model.named_parameters() if id(param) in layers}


def trained_rows(layer: torch.nn.Module) -> list[tuple[list[int], torch.Tensor]]:
    """(token indices, trained rows [k, H] in the base weight's dtype) of each adapter whose rows a
    TrainableTokensLayer's forward puts in place over its base weight, in the order it puts them (as
    get_merged_weights does); [] where the adapters are off or merged (the base weight is what runs)."""
    base = layer.base_layer.weight
    return [(list(layer.token_indices[a]), layer.trainable_tokens_delta[a].detach().to(base))
            for a in _trained_token_adapters(layer)]


def merged_token_rows(layer: torch.nn.Module) -> list[int]:
    """Token indices of the adapters PEFT's merge put into a TrainableTokensLayer's base weight: its unmerge writes
    the originals back there in place, through weight.data (no version counter moves)."""
    return [i for a in layer.merged_adapters for i in layer.token_indices[a]]


def trained_tokens_names(model: torch.nn.Module) -> dict[str, str | None]:
    """Full name of each parameter of a TrainableTokensLayer -> its name in the model the forward runs, for the
    base weight (model.embed_tokens.token_adapter.base_layer.weight -> model.embed_tokens.weight), whose value there
    has the trained rows in place; None for the trained rows themselves (trainable_tokens_delta)."""
    from peft.tuners.trainable_tokens import TrainableTokensLayer

    names = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, TrainableTokensLayer):
            continue
        wrapped = name.removesuffix(".token_adapter")  # a trainable_token_indices wrapper's layer
        for leaf, _ in layer.named_parameters(remove_duplicate=False):
            base = leaf.startswith("base_layer.")
            names[f"{name}.{leaf}"] = f"{wrapped}.{leaf.removeprefix('base_layer.')}" if base else None
    return names


def weight_run_by(module: torch.nn.Module) -> tuple:
    """What `module`'s forward multiplies by, as a key two modules share only when they run one weight: a
    TrainableTokensLayer's base weight with each active adapter's trained rows (tied layers share both), a
    modules_to_save wrapper's module in use's weight, any other module's weight."""
    layer = trained_tokens_layer(module)
    if layer is None:
        return (id(module_in_use(module).weight),)
    adapters = _trained_token_adapters(layer)
    rows = [(id(layer.trainable_tokens_delta[a]), tuple(layer.token_indices[a])) for a in adapters]
    return (id(layer.base_layer.weight), *rows)


def _dequantized_all(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: _dequantized(tensor) for name, tensor in tensors.items()}


def _module_in_use(wrapper: torch.nn.Module) -> torch.nn.Module:
    """The module a modules_to_save wrapper runs in its place: the trained copy of its active adapter (the original
    where none of the active adapters has one)."""
    saved = [a for a in wrapper.active_adapters if a in wrapper.modules_to_save]
    return wrapper.modules_to_save[saved[0]] if saved else wrapper.original_module


def module_in_use(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose weights `module`'s forward runs: for a PEFT modules_to_save wrapper, the trained copy of its
    active adapter (the original where none of the active adapters has one); any other module itself."""
    from peft.utils.other import ModulesToSaveWrapper

    return _module_in_use(module) if isinstance(module, ModulesToSaveWrapper) else module


def wrapped_original(module: torch.nn.Module) -> torch.nn.Module:
    """The module a PEFT modules_to_save wrapper or TrainableTokensLayer was built around (the base model's own); any
    other module itself."""
    from peft.utils.other import ModulesToSaveWrapper

    if isinstance(module, ModulesToSaveWrapper):
        return module.original_module
    layer = trained_tokens_layer(module)
    return module if layer is None else layer.base_layer


def modules_to_save_names(model: torch.nn.Module) -> dict[str, str | None]:
    """Full name of each parameter inside a PEFT modules_to_save wrapper -> its name in the model the forward runs
    (lm_head.modules_to_save.default.weight -> lm_head.weight) if it belongs to the module the wrapper runs, else
    None (the frozen original while a trained copy runs, another adapter's copy)."""
    from peft.utils.other import ModulesToSaveWrapper

    names = {}
    for name, wrapper in model.named_modules():
        if not isinstance(wrapper, ModulesToSaveWrapper):
            continue
        in_use = _module_in_use(wrapper)
        inner = next(f"{inner}." for inner, module in wrapper.named_modules() if module is in_use)
        for leaf, _ in wrapper.named_parameters(remove_duplicate=False):
            names[f"{name}.{leaf}"] = f"{name}.{leaf.removeprefix(inner)}" if leaf.startswith(inner) else None
    return names


def modules_to_save_inside(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules a PEFT modules_to_save wrapper (ModulesToSaveWrapper) runs in its place: the original and each
    adapter's trained copy; [] for any other module."""
    from peft.utils.other import ModulesToSaveWrapper

    if not isinstance(module, ModulesToSaveWrapper):
        return []
    return [module.original_module, *module.modules_to_save.values()]


def _ancestors(root: torch.nn.Module, name: str):
    parts = name.split(".") if name else []
    for i in range(1, len(parts)):
        yield root.get_submodule(".".join(parts[:i]))


def dense_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` whose whole forward is one dense map x W^T + b, outermost first: nn.Linear (plain or a
    bitsandbytes 4-bit base) and PEFT LoRA layers over one, whose adapters `dense_weight` merges. Left out, with all
    they hold (they keep running their own forward): other PEFT tuner layers, LoRA variants (DoRA, ...) and LoRA
    biases (not in get_delta_weight), 8-bit bases, 4-bit bases that bitsandbytes repacked for its CPU kernel,
    layers whose weight an accelerate hook brings in (offloaded)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    found, seen = [], set()

    def visit(module: torch.nn.Module) -> None:
        if id(module) in seen:  # a module shared by two parents
            return
        seen.add(id(module))
        if isinstance(module, LoraLayer):
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            if not has_variant_or_bias(module, adapters) and _dense_base(module.base_layer):
                found.append(module)
            return
        if isinstance(module, BaseTunerLayer):
            return
        if isinstance(module, torch.nn.Linear):
            if _dense_base(module):
                found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def _dense_base(linear: torch.nn.Module) -> bool:
    # an accelerate-hooked or meta weight may live elsewhere (offloaded) until the hook brings it in
    if not isinstance(linear, torch.nn.Linear) or hasattr(linear, "_hf_hook") or linear.weight.device.type == "meta":
        return False
    if type(linear.weight).__name__ == "Params4bit":
        # bitsandbytes >= 0.49 repacks a 4-bit weight for its AVX512-BF16 CPU kernel at the first eval forward on
        # such a CPU; dequantize_bnb_weight then returns wrong values (seen with 0.50.2): keep the layer whole
        return not getattr(linear.weight.quant_state, "packing_format_for_cpu", False)
    return linear.weight.is_floating_point()


def dense_weight(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [N, K], bias [N] or None) of one of dense_linears(model) as its forward computes them now: the base
    weight (dequantized if 4-bit) plus each active, unmerged LoRA delta B A * scale, summed in fp32; without a delta
    or dequantization, the parameter itself (no copy)."""
    if not hasattr(module, "base_layer"):
        return _dequantized(module.weight), _detached(module.bias)
    return with_lora_deltas(module, _dequantized(module.base_layer.weight)), _detached(module.base_layer.bias)


def with_lora_deltas(layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """`weight` (the PEFT LoRA layer's base weight, detached or dequantized) plus each active adapter's B A * scale,
    summed in fp32; `weight` itself when no adapter applies (disabled, already merged, or none active)."""
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return weight
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
            weight = weight.float() + layer.get_delta_weight(adapter).float()  # not +=: the base may be fp32
    return weight


def _detached(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach()


def four_bit_parts(linear: torch.nn.Module) -> tuple[torch.Tensor, object, torch.dtype | None] | None:
    """(packed uint8 weight, QuantState, compute dtype or None) of a bitsandbytes 4-bit linear, None for any other
    module. The compute dtype is the one its forward casts x to (None until its first forward sets it)."""
    weight = getattr(linear, "weight", None)
    if type(weight).__name__ != "Params4bit":
        return None
    return weight.data, weight.quant_state, getattr(linear, "compute_dtype", None)
