"""AdamW and its learning-rate schedule, as every training command builds them."""
from __future__ import annotations

import functools
import math

import torch


def lr_factor(update: int, *, total: int, warmup: int, kind: str) -> float:
    """LR multiplier at optimizer update `update` (0-based): linear warm-up, then constant / linear / cosine."""
    if update < warmup:
        return (update + 1) / warmup
    progress = (update - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return 1.0


def adamw_with_schedule(model: torch.nn.Module, config, device: torch.device, total_updates: int):
    """(AdamW over the model's trainable parameters, its LambdaLR schedule over `total_updates` updates): fused on
    CUDA, foreach on the CPU. `config` has learning_rate, adam_beta1/2, adam_epsilon, weight_decay, warmup_steps and
    lr_scheduler."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model: has no trainable parameters")
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
        weight_decay=config.weight_decay, fused=cuda or None, foreach=None if cuda else True,
    )
    schedule = functools.partial(lr_factor, total=total_updates, warmup=config.warmup_steps, kind=config.lr_scheduler)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
