"""The checks of the fields that refine offload_activations and gradient_checkpointing, shared by every config
that loads a model (GRPOConfig, and through fastgrpo.train.options the sft and ei configs)."""
from __future__ import annotations

import math

from fastgrpo._checks import check_int_at_least
from fastgrpo.train.naming import setting


def check_activation_memory_options(config) -> None:
    """offload_activations (it needs patch), and offload_host_memory_gib and recompute_layers, which refine
    offload_activations / gradient_checkpointing."""
    if config.offload_activations and not config.patch:  # else nothing would offload, silently
        raise ValueError(f"offload_activations: runs in patch_model's layers, and patch is off (pass "
                         f"{setting('patch', True)})")
    if config.offload_host_memory_gib is not None:
        if not 0 < config.offload_host_memory_gib < math.inf:
            raise ValueError("offload_host_memory_gib: expected a finite number > 0 or none, got "
                             f"{config.offload_host_memory_gib}")
        if not (config.offload_activations and config.patch):
            raise ValueError("offload_host_memory_gib: bounds the memory of offload_activations, which is off "
                             "(it needs patch and offload_activations)")
    layers = config.recompute_layers
    if layers is not None:
        check_int_at_least("recompute_layers", layers, 0, or_else=" or none")
        if not (config.gradient_checkpointing or (config.offload_activations and config.patch)):
            raise ValueError("recompute_layers: chooses the layers that gradient_checkpointing or offload_activations "
                             "(with patch) recompute, and neither is on")
