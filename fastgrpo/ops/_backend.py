"""Which implementation an op runs: the Triton kernel or its plain-torch fallback."""
from __future__ import annotations

import os

import torch


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton on CUDA tensors, or anywhere under TRITON_INTERPRET=1 (CPU tests); plain torch otherwise."""
    return all(t.is_cuda for t in tensors) or os.environ.get("TRITON_INTERPRET") == "1"
