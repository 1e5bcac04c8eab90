"""The CUDA device fastgrpo's entry points run under: their tensors' own.

Triton launches a kernel on the current CUDA device and its stream, whatever device its tensors are on: a model on
cuda:1 while cuda:0 is current (torch's default) handed cuda:1's pointers to a launch on cuda:0, which Triton refuses
("Pointer argument (at 0) cannot be accessed from Triton"), and a CUDA graph captured on cuda:0's stream would not
hold cuda:1's work. So the patched model's forward, the losses, the built-in rollout and the fused AdamW step switch
to their tensors' device for the call, as torch's own ops do per tensor; the autograd engine runs each backward on
its tensors' device already.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from fastgrpo.hf.binding import signature_with_self


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """torch.cuda.device(device) where it is a CUDA device other than the current one; a no-op otherwise (the CPU,
    already current: the common case costs one query; or inside torch.compile's tracing, where the eager caller, the
    rollout, has switched already)."""
    if (device.type != "cuda" or device.index is None or torch.compiler.is_compiling()
            or device.index == torch.cuda.current_device()):
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's input embedding, where its forward starts (fastgrpo takes models on one device)."""
    return model.get_input_embeddings().weight.device


def on_model_device(function: Callable) -> Callable:
    """`function(model, ...)` run under on_device(model_device(model))."""
    @functools.wraps(function)
    def run(model, *args, **kwargs):
        with on_device(model_device(model)):
            return function(model, *args, **kwargs)
    return run


def forward_on_model_device(previous: Callable) -> Callable:
    """A model's forward (bind_forward's make_forward) that runs `previous` under its model's device."""
    def forward(self, *args, **kwargs):
        with on_device(model_device(self)):
            return previous(*args, **kwargs)
    forward.__signature__ = signature_with_self(previous)
    return forward
