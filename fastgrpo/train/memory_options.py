"""The checks of the fields that refine offload_activations and gradient_checkpointing, and of fp8_base, shared
by every config that loads a model (GRPOConfig, and through fastgrpo.train.options the sft and ei configs), and of the
fsdp_* fields that refine a torchrun launch's FSDP2 (the commands' check_fsdp_applies)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection

from fastgrpo._checks import check_int_at_least
from fastgrpo.train.naming import setting
from fastgrpo.train.ranks import process_count


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
    check_fp8_base(config)
    layers = config.recompute_layers
    if layers is not None:
        check_int_at_least("recompute_layers", layers, 0, or_else=" or none")
        if not (config.gradient_checkpointing or (config.offload_activations and config.patch)):
            raise ValueError("recompute_layers: chooses the layers that gradient_checkpointing or offload_activations "
                             "(with patch) recompute, and neither is on")


def check_fp8_base(config) -> None:
    """fp8_base runs in patch_model's layers (LoRA's, or with lora_rank 0 the trained linears), over 16-bit
    linears."""
    if not config.fp8_base:
        return
    if not config.patch:
        raise ValueError(f"fp8_base: runs in patch_model's layers, and patch is off (pass "
                         f"{setting('patch', True)})")
    if config.lora_rank == 0 and process_count() > 1:  # FSDP2's sharded weights: each process would copy them whole
        raise ValueError(f"fp8_base: keeps e4m3 copies of the weights it multiplies, and with "
                         f"{setting('lora_rank', 0)} under torchrun FSDP2 shards them: every process would keep "
                         "copies of every weight, unsharded; run one process, or train LoRA")
    if config.load_in_4bit:
        raise ValueError(f"fp8_base: multiplies a 16-bit base in FP8, and {setting('load_in_4bit', True)} "
                         "loads it in 4 bits; use one of them")
    if config.lora_dropout:  # the training forward would be PEFT's, the base in bf16: FP8 silently off
        raise ValueError(f"fp8_base: runs in fastgrpo's LoRA forward, which takes no adapter dropout, and "
                         f"{setting('lora_dropout', config.lora_dropout)} would leave training to PEFT's forward "
                         f"(the base in bf16); set {setting('lora_dropout', 0)}")


FSDP_FIELDS = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "fsdp_sync_every_micro_batch", "fsdp_layers_per_group")


def check_fsdp_applies(config, resumed: Collection[str] = ()) -> None:
    """An fsdp_* field set off its default where FSDP2 does not run (it shards full fine-tuning under torchrun, and
    DDP trains LoRA there): refused, as it would do nothing. The commands check it, in the processes that run: a
    config can be built before they start (the Python API). `resumed`: the fields a --resume took from its run, which
    no one set now: a run of several processes resumed on one keeps them, for its next resume on several."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    changed = [name for name in FSDP_FIELDS
               if name in defaults and name not in resumed and getattr(config, name) != defaults[name]]
    if not changed:
        return
    if process_count() == 1:  # the group is joined after the config is checked: WORLD_SIZE then
        why = "this run has one process"
    elif config.lora_rank > 0:
        why = f"a LoRA run ({setting('lora_rank', config.lora_rank)}) trains through DDP"
    else:
        return
    raise ValueError(f"{changed[0]}: shapes FSDP2, which shards full fine-tuning under torchrun, and {why}")
