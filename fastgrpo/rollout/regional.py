"""Regional compilation of the decode step (EngineConfig.compile_scope="layers"): one decoder layer's code is
compiled once and run by every layer, instead of the whole step, all layers unrolled, being one graph.

Why: the whole-step compile traces and lowers every layer again (28 on Qwen2.5-1.5B, 32 on Llama-3.1-8B), though
their code is the same and only their weights and cache buffers differ; the first call spends 26 / 30 s compiling
and capturing on an H200 (benchmarks/NOTES_rollout.md). Dynamo lifts a module's parameters to graph inputs (torch
>= 2.5, inline_inbuilt_nn_modules), so one compiled layer serves every layer of its class unless the trace reads
something that differs per layer. Two things do, and are handled here for the step:
- `cache.update(..., self.layer_idx)` indexes the engine's cache by an int attribute of the module, which dynamo
  specializes on. Each layer gets a LayerCache of its own buffers as its cache (and as the keyword that carries the
  shared prefix and fp8 scales to the attention), which never reads the index.
- an instance-level forward that is not a types.MethodType is guarded by identity: patch_model's WeakBoundMethod
  forwards (norms, MLPs, attention, LoRA linears) become MethodTypes of the same functions (guarded by code).
Either would cost one recompile per layer, and past dynamo's recompile limit (8) the rest would run eagerly.
The layer's compiled forward is its class's: an instance-level forward of the layer itself (patch_model's activation
offload, training-only) is skipped. Everything is bound for one step and restored after it (hf/binding.py), so
the prefill and training never see it. The rest of the step (embedding, rotary tables, final norm, lm_head: once
per step) runs eagerly and the sampling is compiled apart; on CUDA the whole step is still captured as one CUDA
graph, so the eager parts cost no host time at replay.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

from fastgrpo.hf.binding import as_method, bind_forward
from fastgrpo.hf.models import architecture, decoder_layers
from fastgrpo.rollout.attention import CACHE_KWARG
from fastgrpo.rollout.kv_cache import StaticKVCache


# Inductor's options for a decoder layer. Its reductions are per row; unsplit, W8A8's SwiGLU quantizer is one kernel,
# not three. Combo kernels launch kernels with no data between them (q's RoPE, the K/V cache writes) as one: fewer
# graph nodes a step: Qwen2.5-1.5B's bf16 step 6% faster in each of three fresh compiles, its W8A16 step 3%,
# Llama-3.1-8B's bf16 step level. With weights="w8a8" the step's time is a draw at each compile, mostly a loss (from
# 18% slower to 6% faster), where off gives the same time within 3%; hence off there (benchmarks/NOTES_rollout.md,
# thirty-first to thirty-third sessions). The sampling, compiled apart, keeps Inductor's defaults: its reductions over
# the vocabulary stay split.
LAYER_OPTIONS = (("split_reductions", False),)
COMBO_LAYER_OPTIONS = LAYER_OPTIONS + (("combo_kernels", True),)


def layer_options(weights: str) -> tuple:
    """Inductor's options for the decoder layers of an engine whose EngineConfig.weights is `weights`."""
    return LAYER_OPTIONS if weights == "w8a8" else COMBO_LAYER_OPTIONS


def layer_indices(model: nn.Module) -> dict[nn.Module, int] | None:
    """Each decoder layer -> the cache index of its attention; None for a model outside the patch table (whose
    layers this module cannot find)."""
    try:
        arch = architecture(model)
    except ValueError:
        return None
    found = {}
    for layer in decoder_layers(model, arch):
        attention = next(c for c in layer.children() if type(c).__name__ in arch.attention_classes)
        found[layer] = attention.layer_idx
    return found


@contextlib.contextmanager
def compiled_layers(layers: dict[nn.Module, int], cache: StaticKVCache, cache_kw: str,
                    compiled: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within the block each decoder layer runs compiled(its class's forward) on a LayerCache of its own buffers.

    compiled(fn) -> the compiled fn, the same object for the same fn (the engine's cached torch.compile)."""
    with contextlib.ExitStack() as undo:
        for layer, index in layers.items():
            forward = _layer_forward(compiled(type(layer).forward), cache.layer(index), cache_kw)
            undo.callback(bind_forward(layer, lambda _previous, forward=forward: forward).restore)
            for module in layer.modules():
                as_method(module, undo)
        yield


def _layer_forward(forward: Callable, view, cache_kw: str) -> Callable:
    def run(layer, *args, **kwargs):
        kwargs[cache_kw] = view
        if CACHE_KWARG in kwargs:  # the kernel's extra keywords (shared prefix, fp8 scales): this layer's, same view
            kwargs[CACHE_KWARG] = view
        return forward(layer, *args, **kwargs)

    return run
