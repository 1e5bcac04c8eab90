"""Where each trainer weight lives inside vLLM's model, and the binding that stores it once.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (rows in that order, sizes in the fused layer's
`output_sizes`), pads the vocabulary rows of embed_tokens / lm_head to a multiple of 64, and, with LoRA enabled,
moves every wrapped layer's parameters under `.base_layer`. Everything else keeps HF's name and shape. A dim-0 row
slice of a row-major [out, in] tensor is contiguous, so each HF parameter can become a view of rows of a vLLM
parameter: vLLM owns the storage (its CUDA graphs hold those addresses, which never change), the trainer's
parameters alias it, and an optimizer step writes straight into what the next rollout reads. A PEFT modules_to_save
wrapper (modules_to_save=["lm_head"]) holds the frozen original and a trained copy: vLLM's weight is the one its
forward runs (the active adapter's copy), which aliases vLLM's rows like any trained weight. A PEFT
trainable-token layer (trainable_token_indices) runs its base weight with some rows replaced by trained ones: vLLM
runs that weight as its own copy (TrainedRows), while the trainer's base keeps the frozen rows its reference forward
(PEFT's disable_adapter) runs, so the two cannot alias.

What cannot alias (a dtype vLLM does not run, a LoRA-adapted weight that vLLM must see merged with its adapter,
or everything when sharing is off) is a `Copy`: rows of vLLM's tensor refreshed from the trainer by `refresh`.
Nothing here imports vllm: the functions take vLLM's model as a plain nn.Module.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from fastgrpo.hf.peft import (
    merged_token_rows,
    modules_to_save_names,
    trained_rows,
    trained_tokens_layers,
    trained_tokens_names,
)
from fastgrpo.rollout.vllm_settings import BUILTIN_ENGINE

# HF projection -> (vLLM's fused layer, index of its rows among the fused layer's output_sizes)
STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
PEFT_PREFIX = "base_model.model."
# PEFT's adapter parameters: trained by the trainer, sent to vLLM as adapters or merged, never shared
ADAPTER_KEYS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


@dataclasses.dataclass(frozen=True)
class Target:
    """Rows [start, stop) of vLLM's parameter `name` hold one HF parameter."""

    name: str
    start: int
    stop: int


@dataclasses.dataclass
class Copy:
    """Rows of a vLLM parameter that vLLM keeps as its own copy; `source()` is the trainer's current value."""

    hf_name: str
    rows: torch.Tensor
    source: Callable[[], torch.Tensor]

    def refresh(self) -> None:
        self.rows.copy_(self.source())


@dataclasses.dataclass
class TrainedRows:
    """Rows of a vLLM parameter holding a PEFT TrainableTokensLayer's weight as its forward runs it: the frozen base
    weight with the active adapters' trained rows in place (bit for bit merge_and_unload's weight).

    A refresh writes the trained rows alone (an embedding of 128K x 4096 in bf16 is 1 GB; its trained rows are a few
    KB), and puts the base's rows back where rows written before are no longer trained (another adapter set active,
    the adapters off). The whole base is copied at the first refresh and again when the base weight is another tensor
    (PEFT's merge) or was written in place (its version counter: an optimizer step on a base left trainable). PEFT's
    unmerge writes through weight.data, which moves neither: the rows a merge put in the base count as written. Other
    writes through .data (w.data.copy_(...)) are not seen: write the base as w.copy_(...) under torch.no_grad()."""

    hf_name: str
    rows: torch.Tensor
    layer: nn.Module
    _base_seen: tuple[int, int] | None = None  # (data_ptr, _version) of the base weight at the last whole copy
    _written: list[int] = dataclasses.field(default_factory=list)  # token rows holding trained values

    def refresh(self) -> None:
        base = self.layer.base_layer.weight
        trained = trained_rows(self.layer)
        indices = [i for rows, _ in trained for i in rows]
        if (base.data_ptr(), base._version) != self._base_seen:
            self.rows.copy_(base)
            self._base_seen = (base.data_ptr(), base._version)
        else:
            stale = sorted(set(self._written) - set(indices))
            if stale:
                self._write(stale, base[stale])
        for rows, values in trained:
            self._write(rows, values)
        self._written = indices + merged_token_rows(self.layer)

    def _write(self, indices: list[int], values: torch.Tensor) -> None:
        index = torch.tensor(indices, device=self.rows.device)
        self.rows.index_copy_(0, index, values.to(self.rows))


def hf_name(peft_name: str) -> str:
    """A trainer parameter's name as the plain HF model names it (PEFT's prefix and `.base_layer` dropped)."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def is_adapter_param(name: str) -> bool:
    return any(key in name for key in ADAPTER_KEYS)


def _under_base_layer(name: str) -> str:
    module, _, leaf = name.rpartition(".")
    return f"{module}.base_layer.{leaf}"


def locate(name: str, shape: torch.Size, vllm_params: dict[str, torch.Tensor], module_of: Callable[[str], nn.Module]
           ) -> Target | None:
    """The rows of a vLLM parameter that hold HF parameter `name` of `shape`; None when vLLM has no such rows."""
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    fused = STACKED.get(proj)
    wanted = f"{parent}.{fused[0]}.{leaf}" if fused else name
    found = next((n for n in (wanted, _under_base_layer(wanted)) if n in vllm_params), None)
    if found is None or len(shape) == 0:
        return None
    param = vllm_params[found]
    if param.dim() != len(shape) or tuple(param.shape[1:]) != tuple(shape[1:]):
        return None
    owner = module_of(found.rpartition(".")[0])
    if fused:
        sizes = list(getattr(owner, "output_sizes", ()))
        if len(sizes) <= fused[1]:
            return None
        start = sum(sizes[: fused[1]])
        stop = start + sizes[fused[1]]
    else:
        start, stop = 0, shape[0]
        # only vocabulary rows are padded: HF's rows are the first org_vocab_size ones
        if shape[0] != param.shape[0] and getattr(owner, "org_vocab_size", None) != shape[0]:
            return None
    if stop - start != shape[0] or stop > param.shape[0]:
        return None
    return Target(found, start, stop)


def expected_rows(name: str, param: torch.Tensor, module_of: Callable[[str], nn.Module]) -> int:
    """Rows of vLLM parameter `name` that must come from the trainer (padded vocabulary rows are never read)."""
    org = getattr(module_of(name.rpartition(".")[0]), "org_vocab_size", None)
    return org if org is not None and org < param.shape[0] else param.shape[0]


def parameter_holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) that holds it (tied embeddings appear twice)."""
    found: dict[int, dict[tuple[int, str], tuple[nn.Module, str]]] = defaultdict(dict)
    for _, module in model.named_modules(remove_duplicate=False):
        for leaf, param in module._parameters.items():
            if param is not None:
                found[id(param)][(id(module), leaf)] = (module, leaf)
    return {key: list(value.values()) for key, value in found.items()}


def bind(model: nn.Module, vllm_model: nn.Module, *, share: bool = True,
         merged: dict[str, Callable[[], torch.Tensor]] | None = None) -> list[Copy | TrainedRows]:
    """Copy every trainer weight into vLLM's model; make the trainer's parameters views of vLLM's rows where
    possible; return the rest as Copies and TrainedRows that `refresh` from the trainer.

    merged: full trainer parameter name -> the value vLLM must run instead (a LoRA base weight plus its adapter);
    those rows stay vLLM's own, as do a trainable-token layer's (TrainedRows: its base weight with the trained rows
    in place). A modules_to_save wrapper's module in use stands for the module it wraps; the
    other modules inside it (the frozen original under a trained copy) stay the trainer's alone. Raises ValueError
    if a trainer weight has no place in vLLM's model or a vLLM weight gets no value (it would generate with random
    weights).
    """
    merged = merged or {}
    token_layers = trained_tokens_layers(model)
    vllm_params = dict(vllm_model.named_parameters())
    module_of = vllm_model.get_submodule
    aliases = parameter_holders(model)
    run_names = {**modules_to_save_names(model), **trained_tokens_names(model)}
    covered: dict[str, list[tuple[int, int]]] = defaultdict(list)
    copies = []
    with torch.no_grad():
        for full_name, param in list(model.named_parameters()):
            run_as = run_names.get(full_name, full_name)
            # None: a module the wrapper does not run, or trained token rows (the merged weight holds them)
            if is_adapter_param(full_name) or run_as is None:
                continue
            name = hf_name(run_as)
            target = locate(name, param.shape, vllm_params, module_of)
            if target is None:
                raise ValueError(f"model: vLLM's model has no weight for {name} {list(param.shape)}; this "
                                 f"architecture is laid out differently there (use {BUILTIN_ENGINE})")
            rows = vllm_params[target.name].data[target.start:target.stop]
            covered[target.name].append((target.start, target.stop))
            source = merged.get(full_name)
            if source is not None:
                copies.append(Copy(name, rows, source))
            elif full_name in token_layers:
                copies.append(TrainedRows(name, rows, token_layers[full_name]))
            elif share and rows.dtype == param.dtype and rows.device == param.device:
                shared = nn.Parameter(rows, requires_grad=param.requires_grad)
                rows.copy_(param)
                for module, leaf in aliases[id(param)]:
                    setattr(module, leaf, shared)
                continue
            else:
                copies.append(Copy(name, rows, param.detach))
            copies[-1].refresh()
    missing = [n for n, p in vllm_params.items() if "lora_" not in n
               and _covered_rows(covered.get(n, [])) != expected_rows(n, p, module_of)]
    if missing:
        raise ValueError(f"model: vLLM's weights {missing[:3]} get no value from the model (a different config?)")
    return copies


def _covered_rows(ranges: list[tuple[int, int]]) -> int:
    """Length of [0, n) covered by the ranges when they tile it without gaps or overlaps, else -1."""
    end = 0
    for start, stop in sorted(ranges):
        if start != end:
            return -1
        end = stop
    return end
