"""PEFT and bitsandbytes internals: LoRA adapters merged into a (dequantized) base for export and weight sync."""
from __future__ import annotations

import torch


def _dequantized(param: torch.Tensor) -> torch.Tensor:
    if type(param).__name__ == "Params4bit":  # bitsandbytes 4-bit weight
        from peft.utils.integrations import dequantize_bnb_weight

        return dequantize_bnb_weight(param, state=param.quant_state)
    return param.detach()


def merged_state_dict(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The base model's state dict with every active LoRA adapter merged: W = dequant(W_base) + B A * scale.

    The merge runs in fp32 on dequantized weights, on the weights' device, and is cast to `dtype` once: merging
    into a 4-bit base would re-quantize the update away. The result lives in CPU memory (an 8B model is 16 GB in
    bf16, more than a 24 GB card has left). The trained model is left untouched.
    """
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            weight = _dequantized(module.base_layer.weight).float()
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + module.get_delta_weight(adapter).float()
            merged[f"{name}.weight"] = weight.to(dtype).cpu()
            if module.base_layer.bias is not None:
                merged[f"{name}.bias"] = module.base_layer.bias.detach().to(dtype).cpu()
            continue
        if any(isinstance(parent, LoraLayer) for parent in _ancestors(base, name)):
            continue
        for pname, param in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            key = f"{name}.{pname}" if name else pname
            value = _dequantized(param)
            merged[key] = (value.to(dtype) if value.is_floating_point() else value).cpu()
    return merged


def _ancestors(root: torch.nn.Module, name: str):
    parts = name.split(".") if name else []
    for i in range(1, len(parts)):
        yield root.get_submodule(".".join(parts[:i]))
