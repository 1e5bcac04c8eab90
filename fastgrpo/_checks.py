"""Argument checks shared by the public functions: each raises ValueError naming the argument."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def check_shape(name: str, tensor: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Raise unless `tensor` has `shape`; None in `shape` matches any size."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    ok = tensor.dim() == len(shape) and all(want is None or want == got for want, got in zip(shape, tensor.shape))
    if not ok:
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {expected}, got {list(tensor.shape)}")


def check_same_shape(name: str, tensor: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != like.shape:
        raise ValueError(f"{name}: expected the shape of {like_name} {list(like.shape)}, got {list(tensor.shape)}")


def check_dtype(name: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name}: expected dtype in ({names}), got {str(tensor.dtype).removeprefix('torch.')}")


def check_mask(name: str, mask: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """Masks are bool or 0/1 integer or floating tensors of the same shape as `like`."""
    check_same_shape(name, mask, like_name, like)
    if mask.dtype.is_complex:
        raise ValueError(f"{name}: expected a bool, integer or floating mask, got {mask.dtype}")


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def check_index_range(name: str, ids: torch.Tensor, upper: int) -> None:
    """Raise unless every id is in [0, upper). Costs one reduction (a host sync on CUDA)."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer dtype, got {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= upper):
        raise ValueError(f"{name}: expected ids in [0, {upper}), got min {int(ids.min())} max {int(ids.max())}")
