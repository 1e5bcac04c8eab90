"""The trainer's LoRA adapter for vLLM, without a disk round trip: as vLLM adapter tensors, or merged into weights.

vLLM 0.24's LoRARequest only names a path, and its worker's `_load_adapter` reads adapter_config.json and the
safetensors from there. `InMemoryAdapters` binds, on the one worker LoRA manager of the in-process engine, a
`_load_adapter` that serves paths under mem:// from tensors held here and hands any other path to vLLM's own.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from fastgrpo.hf.models import unwrap_peft
from fastgrpo.hf.peft import (
    has_variant_or_bias,
    peft_type_name,
    trained_tokens_layer,
    weight_run_by,
    with_lora_deltas,
    wrapped_original,
)
from fastgrpo.rollout.vllm_settings import BUILTIN_ENGINE, MERGE_SYNC
from fastgrpo.rollout.vllm_weights import PEFT_PREFIX, parameter_holders

MEM_PREFIX = "mem://"
VLLM_TUNERS = ("LORA", "TRAINABLE_TOKENS")  # the PEFT types whose weights vLLM runs
# vLLM's allowed max_lora_rank values (vllm/config/lora.py MaxLoRARanks)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Full module name -> PEFT LoRA layer with adapters (empty for a model without PEFT LoRA)."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")
            and len(m.lora_A) + len(getattr(m, "lora_embedding_A", {})) > 0}


def check_lora_only(model: nn.Module) -> None:
    """vLLM runs LoRA adapters and trained token rows alone (merged into its weights or through its LoRA path): a PEFT
    model holding another tuner's adapters (LoHa, IA3, AdaLoRA, ...) is refused in one line before vLLM builds its
    engine, where bind refused it minutes later, naming one of the tuner's parameters as a weight vLLM's model lacks.
    PEFT's TrainableTokensConfig alone reaches vLLM through the merged sync (bind merges its rows)."""
    for name, config in getattr(model, "peft_config", {}).items():
        kind = peft_type_name(config)
        if kind not in VLLM_TUNERS:
            raise ValueError(f"model: adapter {name!r} is {kind}, and vLLM runs LoRA adapters only; use "
                             f"{BUILTIN_ENGINE}")


def adapter_config(model: nn.Module) -> dict:
    """r, lora_alpha, target_modules, use_rslora of the model's active adapter, as vLLM's PEFTHelper reads them.
    Refused: what vLLM's LoRA (0.24) does not run over its base, e.g. a trained copy of a module (modules_to_save) or
    trained embedding rows (trainable_token_indices: vLLM would run the frozen base's rows)."""
    name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    cfg = model.peft_config[name]
    unsupported = [f for f in ("use_dora", "modules_to_save", "trainable_token_indices") if getattr(cfg, f, None)]
    if getattr(cfg, "bias", "none") != "none":
        unsupported.append("bias")
    if getattr(cfg, "rank_pattern", None) or getattr(cfg, "alpha_pattern", None):
        unsupported.append("rank_pattern/alpha_pattern")
    if unsupported:
        raise ValueError(f"model: vLLM's LoRA does not run adapters with {unsupported}; use {MERGE_SYNC}")
    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else sorted(cfg.target_modules)
    return {"r": cfg.r, "lora_alpha": cfg.lora_alpha, "target_modules": targets, "use_rslora": bool(cfg.use_rslora)}


def vllm_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank r."""
    for rank in VLLM_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"lora_rank: vLLM runs LoRA ranks up to {VLLM_RANKS[-1]}, got {r}")


def merged_weight(layer: nn.Module) -> torch.Tensor:
    """W + sum of the active adapters' B A * scale, in the weight's dtype (merged in fp32; W is untouched)."""
    weight = layer.base_layer.weight
    return with_lora_deltas(layer, weight.detach()).to(weight.dtype)


def merged_sources(model: nn.Module) -> dict:
    """Full parameter name of each LoRA layer's base weight -> a function giving its merged value. A layer whose
    adapters W + B A * scale does not describe (a variant such as DoRA, a LoRA bias) is refused: vLLM would generate
    from another model than the one trained (DoRA leaves out its magnitude's rescaling); so is a tied embedding and
    lm_head that the trained model runs as two weights (check_tied_embedding). bind places a modules_to_save wrapper's
    trained copy where vLLM runs the module it wraps, and merges a trainable-token layer's trained rows itself."""
    check_tied_embedding(model)
    layers = lora_layers(model)
    holders = parameter_holders(model)  # a tied embedding / lm_head's weight: two
    for name, layer in layers.items():
        if has_variant_or_bias(layer, layer.active_adapters):
            raise ValueError(f"model: {name.removeprefix(PEFT_PREFIX)}: vLLM's merged weight sync writes W + B A * "
                             f"scale, which leaves out a LoRA variant (DoRA) or a LoRA bias; use {BUILTIN_ENGINE}")
        if len(holders[id(layer.base_layer.weight)]) > 1:
            # vLLM's lm_head is its embedding module: the merged weight would reach both, the trainer's partner is W
            raise ValueError(f"model: {name.removeprefix(PEFT_PREFIX)}: vLLM ties the embedding and lm_head, so the "
                             "merged weight sync would put the LoRA on both while the trained model has it on one; "
                             f"leave it out of the LoRA targets or use {BUILTIN_ENGINE}")
    return {f"{name}.base_layer.weight": functools.partial(merged_weight, layer) for name, layer in layers.items()}


def check_tied_embedding(model: nn.Module) -> None:
    """Refuse a tied embedding and lm_head that the trained model runs as two weights: through modules_to_save (a
    trained copy in place of one of them, or one copy for each) or trainable_token_indices (trained rows in one of
    them, or other rows in each): vLLM's one tied weight cannot hold both. With PEFT's ensure_weight_tying=True both
    run one copy, and trainable_token_indices given as a list puts the embedding's trained rows in the head too: one
    weight, which vLLM runs as its tied weight."""
    base = unwrap_peft(model)
    embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
    if head is None or wrapped_original(embedding).weight is not wrapped_original(head).weight:
        return  # not tied: vLLM has an lm_head of its own
    if weight_run_by(embedding) == weight_run_by(head):
        return
    names = {module: name.removeprefix(PEFT_PREFIX) for name, module in model.named_modules()}
    rows = [names[m] for m in (embedding, head) if trained_tokens_layer(m) is not None]
    if rows:
        raise ValueError(f"model: trainable_token_indices on {' and '.join(rows)}: vLLM ties the embedding and lm_head "
                         "to one weight, while the trained model runs other token rows in each; give the indices as a "
                         "list (the embedding's trained rows, which PEFT runs in the tied head too) or use "
                         f"{BUILTIN_ENGINE}")
    copied = [names[m] for m in (embedding, head) if m is not wrapped_original(m)]
    raise ValueError(f"model: modules_to_save {copied}: vLLM ties the embedding and lm_head to one weight, while the "
                     f"trained model runs them apart (a trained copy in place of {' and '.join(copied)}); pass "
                     f"ensure_weight_tying=True to the LoraConfig (one trained copy for both) or use {BUILTIN_ENGINE}")


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors (base_model.model....lora_A.weight), cloned: vLLM scales lora_B in place when it
    loads an adapter (LoRALayerWeights.optimize), which would otherwise rescale the trainer's parameters."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


class InMemoryAdapters:
    """Adapters served to vLLM's worker from memory under mem:// paths."""

    def __init__(self, worker_lora_manager) -> None:
        self.manager = worker_lora_manager
        self.adapters: dict[str, tuple[dict[str, torch.Tensor], dict]] = {}
        stock = worker_lora_manager._load_adapter
        worker_lora_manager._load_adapter = functools.partial(self._load, stock)

    def put(self, path: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
        if not path.startswith(MEM_PREFIX):
            raise ValueError(f"path: expected {MEM_PREFIX}..., got {path!r}")
        self.adapters[path] = (tensors, config)

    def _load(self, stock, request):
        if not request.lora_path.startswith(MEM_PREFIX):
            return stock(request)
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.manager
        tensors, config = self.adapters[request.lora_path]
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        device = next(iter(tensors.values())).device
        return manager._lora_model_cls.from_lora_tensors(
            lora_model_id=request.lora_int_id, tensors=tensors, peft_helper=helper, device=str(device),
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=getattr(model, "hf_to_vllm_mapper", None),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
