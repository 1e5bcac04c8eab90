"""Liger-Kernel beside patch_model: a model runs one library's fused forwards, never a silent mix of both.

Liger binds its forwards on the same module instances as patch_model (apply_liger_kernel_to_*(model=...), which HF's
Trainer calls under use_liger_kernel=True, at train() in transformers 5.24), and swaps the modeling module's classes
for the models built afterwards (LlamaRMSNorm becomes LigerRMSNorm, in the whole process). Over a patched model it
replaced fastgrpo's RMSNorm, MLP (tiled MLP included) and loss forwards but not its RoPE, while fastgrpo_patch_summary
still listed them; patch_model over a Liger-patched model replaced Liger's or, on Liger's classes, left them and
patched the rest. A Liger forward is known by the package it is defined in: liger-kernel need not be installed.
"""
from __future__ import annotations

import torch
from torch import nn

from fastgrpo.hf.peft import modules_to_save_inside

LIGER_PACKAGE = "liger_kernel"
PATCHED_ATTR = "fastgrpo_patch_summary"  # patch.SUMMARY_ATTR, there while the model is patched (patch.py imports us)
_WATCHED_ATTR = "_fastgrpo_liger_watched"


def liger_modules(model: nn.Module) -> list[str]:
    """The class names of the modules of `model` whose forward in effect is Liger-Kernel's, sorted."""
    return sorted({type(module).__name__ for module in model.modules() if _runs_liger(module)})


def liger_patched_problem(model: nn.Module) -> str | None:
    """The one-line refusal for patching a model Liger-Kernel has patched, or None."""
    names = liger_modules(model)
    if not names:
        return None
    return (f"model: Liger-Kernel's forwards already run in its {', '.join(names)} modules, and "
            "fastgrpo.patch_model would mix its kernels with them; build the model in a process where Liger has not "
            "run (apply_liger_kernel_to_* and use_liger_kernel=True patch every model of that type built after), or "
            "leave it unpatched to train on Liger's")


def refuse_liger_patched(hf_model: nn.Module) -> None:
    """patch_model's first check: a model Liger-Kernel has patched is refused."""
    problem = liger_patched_problem(hf_model)
    if problem is not None:
        raise ValueError(problem)


def watch_for_liger(hf_model: nn.Module, layers: list[nn.Module]) -> None:
    """patch_model's last step: the patched model refuses, at its next training forward, Liger forwards put in it
    later (as HF's Trainer does under use_liger_kernel). unwatch_liger takes the check off (unpatch_model)."""
    # Liger's apply functions patch every decoder layer alike: the first one's modules tell, in 10 us where a walk of
    # a 28-layer LoRA model took 6 ms per step.
    hf_model.__dict__[_WATCHED_ATTR] = layers[0] if layers else None
    # Called through the model's __call__ by HF's Trainer, TRL's trainers and PEFT's LoraModel alike; a module-level
    # function, so a deepcopy's hook checks the copy.
    if _refuse_liger_over_fastgrpo not in hf_model._forward_pre_hooks.values():
        hf_model.register_forward_pre_hook(_refuse_liger_over_fastgrpo)


def _refuse_liger_over_fastgrpo(hf_model: nn.Module, args) -> None:
    if PATCHED_ATTR not in hf_model.__dict__:  # no longer patched: Liger's forwards alone are the user's choice
        unwatch_liger(hf_model)
        return
    # Training steps only: Liger comes in when training starts; generate (no grad) calls the model once per token.
    if not (hf_model.training and torch.is_grad_enabled()):
        return
    layer = hf_model.__dict__.get(_WATCHED_ATTR)
    children = list(layer.children()) if layer is not None else []
    # Liger patches the modules inside a PEFT modules_to_save wrapper (its RMSNorm), not the wrapper.
    watched = [hf_model, *children, *(inner for child in children for inner in modules_to_save_inside(child))]
    names = sorted({type(module).__name__ for module in watched if _runs_liger(module)})
    if names:  # not only over fastgrpo's forwards: beside them (fused_loss=False, then Liger's loss) is a mix too
        raise ValueError(
            f"use_liger_kernel: Liger-Kernel's forwards now run in this fastgrpo-patched model ({', '.join(names)}), "
            "beside fastgrpo.patch_model's, as HF's Trainer puts them with use_liger_kernel=True; set it False to "
            "train on fastgrpo's kernels, or leave the model unpatched to train on Liger's"
        )


def unwatch_liger(hf_model: nn.Module) -> None:
    """watch_for_liger undone: the hook and its attribute go (an unpatched model pickles without fastgrpo)."""
    hf_model.__dict__.pop(_WATCHED_ATTR, None)
    hooks = hf_model._forward_pre_hooks
    for key in [key for key, hook in hooks.items() if hook is _refuse_liger_over_fastgrpo]:
        del hooks[key]


def _runs_liger(module: nn.Module) -> bool:
    """Whether Liger's forward is in effect. Under an accelerate hook (device_map offload), whose forward calls
    `_old_forward` (where patch_model binds), Liger binds `forward` over the hook's, or the hook wraps Liger's."""
    forwards = ("forward", "_old_forward") if "_hf_hook" in module.__dict__ else ("forward",)
    return any(_is_liger(module.__dict__.get(attr, type(module).forward)) for attr in forwards)


def _is_liger(function) -> bool:
    function = getattr(function, "__func__", function)  # a bound method, or fastgrpo's WeakBoundMethod
    return (getattr(function, "__module__", None) or "").partition(".")[0] == LIGER_PACKAGE
