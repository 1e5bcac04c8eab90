"""AdamW and its learning-rate schedule, as every training command builds them."""
from __future__ import annotations

import functools
import math

import torch

from fastgrpo.train.stochastic_adamw import StochasticRoundingAdamW


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
    """(AdamW over the model's trainable parameters, its LambdaLR schedule over `total_updates` updates): with bf16
    weights StochasticRoundingAdamW, otherwise torch's (fused on CUDA, foreach on the CPU). `config` has
    learning_rate, adam_beta1/2, adam_epsilon, weight_decay, warmup_steps, lr_scheduler (and seed, for the rounding's
    random bits)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model: has no trainable parameters")
    cuda = device.type == "cuda"
    hyper = dict(lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
                 weight_decay=config.weight_decay)
    if any(p.dtype == torch.bfloat16 for p in params):
        # round-to-nearest would drop every update below half a bf16 step (lr 1e-6 on weights above 2^-12)
        optimizer = StochasticRoundingAdamW(params, **hyper, seed=getattr(config, "seed", 0))
    else:
        optimizer = torch.optim.AdamW(params, **hyper, fused=cuda or None, foreach=None if cuda else True)
    schedule = functools.partial(lr_factor, total=total_updates, warmup=config.warmup_steps, kind=config.lr_scheduler)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
