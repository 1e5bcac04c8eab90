"""The line a command logs (stderr, rank 0) as its loop starts: what it trains, where, and how many steps of what,
so that a user watching a run whose first step takes minutes (the rollout engine compiles in it) knows it started,
on which model and device, and with which batch.

    fastgrpo train: training Qwen2ForCausalLM (1.56B parameters, bfloat16; LoRA r16: 18.5M trained) on
    cuda (NVIDIA H200) x 2 processes: steps 1-100, 64 completions a step (8 prompts x 8, up to 1024 tokens)
"""
from __future__ import annotations

import logging
from collections import Counter

import torch

from fastgrpo.hf.models import lora_rank, unwrap_peft, values_held

logger = logging.getLogger(__name__)


def log_start(verb: str, model: torch.nn.Module, device: torch.device, world_size: int, plan: str,
              trains: bool = True) -> None:
    logger.info("%s %s on %s: %s", verb, describe_model(model, trains), describe_device(device, world_size), plan)


def describe_model(model: torch.nn.Module, trains: bool = True) -> str:
    """'Qwen2ForCausalLM (1.56B parameters, bfloat16; LoRA r16: 18.5M trained)' (without what is trained where
    `trains` is off: an evaluation); a 4-bit base's values counted as values, not as the bytes they are packed in."""
    total = trained = 0
    dtypes: Counter = Counter()
    for param in model.parameters():
        values = values_held(param)
        total += values
        trained += values if param.requires_grad else 0
        dtypes["4-bit" if values > param.numel() else str(param.dtype).removeprefix("torch.")] += values
    dtype = ", ".join(name for name, _ in dtypes.most_common())
    if not trains:
        return f"{_class_name(model)} ({count(total)} parameters, {dtype})"
    rank = lora_rank(model)
    which = f"; LoRA r{rank}: {count(trained)} trained" if rank else ", all trained" if trained == total else \
        f"; {count(trained)} trained"
    return f"{_class_name(model)} ({count(total)} parameters, {dtype}{which})"


def describe_device(device: torch.device, world_size: int) -> str:
    name = f"{device.type} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else device.type
    return f"{name} x {world_size} processes" if world_size > 1 else name


def steps(first: int, last: int, unit: str = "step") -> str:
    """'steps 41-100', 'step 100'."""
    return f"{unit} {last}" if first == last else f"{unit}s {first}-{last}"


def count(n: int) -> str:
    """1.54B, 18.5M, 12.3K, 512: three significant digits."""
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return str(n)


def _class_name(model: torch.nn.Module) -> str:
    """The HF model's class under PEFT's wrapper and FSDP2's (a class made at run time, `FSDP<class>`)."""
    base = unwrap_peft(model)
    return next(c for c in type(base).__mro__ if not c.__module__.startswith("torch.distributed")).__name__
