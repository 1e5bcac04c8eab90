"""Adaptive control of the KL coefficient beta toward a target KL."""
from __future__ import annotations

import math

import torch

# --- KL coefficient control --------------------------------------------------------------------------------------


class AdaptiveKLController:
    """Proportional control of the KL coefficient toward target_kl (Ziegler et al. 2019, multiplicative form):
    beta <- beta * exp(clip((kl - target_kl) / target_kl, -max_log_step, max_log_step)).
    """

    def __init__(self, init_beta: float, target_kl: float, max_log_step: float = 0.2) -> None:
        if not init_beta >= 0:
            raise ValueError(f"init_beta: expected >= 0, got {init_beta}")
        if not target_kl > 0:
            raise ValueError(f"target_kl: expected > 0, got {target_kl}")
        if not max_log_step >= 0:
            raise ValueError(f"max_log_step: expected >= 0, got {max_log_step}")
        self.beta = float(init_beta)
        self.target_kl = float(target_kl)
        self.max_log_step = float(max_log_step)

    def update(self, observed_kl: float | torch.Tensor) -> float:
        kl = float(observed_kl)
        if not math.isfinite(kl):
            raise ValueError(f"observed_kl: expected a finite number, got {kl}")
        error = (kl - self.target_kl) / self.target_kl
        self.beta *= math.exp(min(max(error, -self.max_log_step), self.max_log_step))
        return self.beta
