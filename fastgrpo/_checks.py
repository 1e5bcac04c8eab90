"""Argument checks shared by the public functions: each raises ValueError naming the argument."""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

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
    check_integer_ids(name, ids)
    if ids.numel():
        raise_unless_in_range(name, *read_ints(*ids.aminmax()), upper)


def check_integer_ids(name: str, ids: torch.Tensor) -> None:
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dtype.is_complex:
        raise ValueError(f"{name}: expected an integer dtype, got {ids.dtype}")


def raise_unless_in_range(name: str, low: int, high: int, upper: int) -> None:
    """check_index_range's error, from the ids' min and max read already."""
    if low < 0 or high >= upper:
        raise ValueError(f"{name}: expected ids in [0, {upper}), got min {low} max {high}")


def read_ints(*values: torch.Tensor) -> list[int]:
    """Integer / bool tensors (0-dim, or 1-D: their values in order) -> Python ints in one host read: one sync on
    CUDA for all the value checks of a call, instead of one per check (each stalls the host until the GPU drains
    its queue)."""
    return torch.cat([v.reshape(-1).long() for v in values]).tolist()


def nonbinary(mask: torch.Tensor) -> torch.Tensor:
    """0-dim bool: whether mask holds a value other than 0 and 1 (never for a bool mask)."""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=torch.bool, device=mask.device)
    return ((mask != 0) & (mask != 1)).any()


def raise_if_nonbinary(name: str, flag: int) -> None:
    """check_binary_mask's error, from nonbinary(mask) read already."""
    if flag:
        raise ValueError(f"{name}: expected a bool mask or 0/1 values, got values outside {{0, 1}}")


def first_nonfinite(values: torch.Tensor, mask: torch.Tensor | None = None, *, nan_ok: bool = False,
                    nonnegative: bool = False, at_most: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """0-dim: the flat index of the first NaN / inf in `values` (values.numel() when all are finite), only
    where `mask` (of values' shape) is nonzero when given, and what it is (0 NaN, 1 inf, -1 -inf, 2 a negative
    number, 3 a number above at_most), for raise_if_nonfinite after read_ints: no host sync of its own. nan_ok: NaN
    passes; nonnegative: a negative number is bad too; at_most (>= 0): so is a number above it."""
    flat = values.detach().reshape(-1)
    if not flat.numel():  # nothing to gather from; index 0 = numel: all finite
        return (torch.zeros((), dtype=torch.long, device=flat.device),) * 2
    bad = ~flat.isfinite()
    if nan_ok:
        bad = bad & ~flat.isnan()
    if nonnegative:
        bad = bad | (flat < 0)
    if at_most is not None:
        bad = bad | (flat > at_most)
    if mask is not None:
        bad = bad & mask.reshape(-1).bool()
    positions = torch.arange(flat.numel(), device=flat.device)
    index = torch.where(bad, positions, flat.numel()).min()
    value = flat.gather(0, index.clamp(max=flat.numel() - 1).reshape(1))[0]  # gather: indexing by a tensor syncs
    finite_kind = torch.where(value < 0, 2, 3)
    kind = torch.where(value.isnan(), 0, torch.where(value.isinf(), torch.where(value > 0, 1, -1), finite_kind))
    return index, kind


def raise_if_nonfinite(name: str, shape: Sequence[int], index: int, kind: int, where: str = "",
                       expected: str = "finite values") -> None:
    """The error for first_nonfinite's (index, kind) read already: names the entry by row (and column if 2-d).
    where: the positions checked, for the message (" where completion_mask is 1"); expected: what they hold."""
    if index < math.prod(shape):
        what = {0: "NaN", 1: "inf", -1: "-inf", 2: "a negative value", 3: "a positive value"}[kind]
        at = f"row {index}" if len(shape) == 1 else "row {}, column {}".format(*divmod(index, shape[-1]))
        raise ValueError(f"{name}: expected {expected}{where}, got {what} at {at}")


# How far above 0 a log-prob (an engine's, or old / ref ones) may be from rounding alone: a near-certain token's logit
# minus the logsumexp rounded to bf16 (logits below 64) is too large by up to half of bf16's spacing there, 2^-3.
# Past that it is no log-prob (a negative log-likelihood or a probability passed by mistake).
LOGPROB_ROUNDING = 2.0 ** -3


class Masked(NamedTuple):
    """A per-token tensor for masked_nonfinite with more to its check than finite values: NaN passes too (nan_ok: an
    engine's log-prob of a token it could not score), a negative value fails too (nonnegative: a weight), or a
    positive one does (logprob: past LOGPROB_ROUNDING)."""

    tensor: torch.Tensor | None
    nan_ok: bool = False
    nonnegative: bool = False
    logprob: bool = False

    def expected(self) -> str:
        """What the values hold, for the message."""
        if self.nonnegative:
            return "finite values >= 0"
        what = "finite log-probs <= 0" if self.logprob else "finite values"
        return f"{what} (or NaN)" if self.nan_ok else what


def _given(tensors: dict[str, torch.Tensor | Masked | None]) -> list[tuple[str, Masked]]:
    checks = [(name, t if isinstance(t, Masked) else Masked(t)) for name, t in tensors.items()]
    return [(name, check) for name, check in checks if check.tensor is not None]


def masked_nonfinite(mask: torch.Tensor, tensors: dict[str, torch.Tensor | Masked | None]) -> list[torch.Tensor]:
    """first_nonfinite of each given tensor (None: skipped; a Masked one with its options) where `mask` is 1, flat,
    for one read_ints with the caller's other values; raise_if_masked_nonfinite reads the result."""
    return [value for _, t in _given(tensors)
            for value in first_nonfinite(t.tensor, mask, nan_ok=t.nan_ok, nonnegative=t.nonnegative,
                                         at_most=LOGPROB_ROUNDING if t.logprob else None)]


def raise_if_masked_nonfinite(mask_name: str, tensors: dict[str, torch.Tensor | Masked | None],
                              read: Sequence[int]) -> None:
    """The error for masked_nonfinite's values read already, naming the first tensor (in `tensors`' order) that
    holds a NaN / inf (or what its Masked options refuse) where the mask is 1."""
    for (name, t), index, kind in zip(_given(tensors), read[::2], read[1::2]):
        raise_if_nonfinite(name, t.tensor.shape, index, kind, f" where {mask_name} is 1", t.expected())


def check_linear_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
) -> None:
    """hidden [..., H] and weight [V, H] (and bias [V]) of one floating dtype; temperature > 0; softcap None or a
    positive finite number."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise ValueError("hidden: expected a tensor of shape [..., H]")
    check_shape("weight", weight, (None, hidden.shape[-1]))
    check_dtype("hidden", hidden, (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: expected the dtype of hidden ({hidden.dtype}), got {weight.dtype}")
    if bias is not None:
        check_shape("bias", bias, (weight.shape[0],))
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature: expected a finite float > 0, got {temperature!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 < softcap < math.inf
    ):
        raise ValueError(f"softcap: expected None or a positive finite float, got {softcap!r}")


def check_binary_mask(name: str, mask: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """check_mask, and the values must be 0 or 1: a float mask of weights is rejected. One host sync on CUDA."""
    check_mask(name, mask, like_name, like)
    if mask.dtype != torch.bool:
        raise_if_nonbinary(name, read_ints(nonbinary(mask))[0])


def check_floating(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating dtype, got {str(tensor.dtype).removeprefix('torch.')}")


def check_int_at_least(name: str, value: object, low: int, *, or_else: str = "") -> None:
    """value is an int (a bool is not) >= low; or_else: what else the argument takes, for the message (" or None")."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}{or_else}, got {value!r}")


def check_positive_int(name: str, value: object) -> None:
    check_int_at_least(name, value, 1)


def check_per_token_inputs(
    B: int, T: int, advantages: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None
) -> None:
    """advantages [B] or [B, T]; old_logps / ref_logps [B, T] when given."""
    if not isinstance(advantages, torch.Tensor) or advantages.shape not in (torch.Size([B]), torch.Size([B, T])):
        got = list(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(f"advantages: expected a tensor of shape [{B}] or [{B}, {T}], got {got}")
    if advantages.dtype == torch.bool:  # a mask passed by mistake would train as advantages of 0 and 1
        raise ValueError("advantages: expected numbers, got a bool tensor")
    for name, logps in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if logps is not None:
            check_shape(name, logps, (B, T))


MAX_UNKNOWN_NAMED = 4  # keys check_known_fields names; another command's whole config has dozens


def check_known_fields(data: dict, config_class: type, command: str, notes: dict[str, str] | None = None,
                       source: str = "config") -> None:
    """A ValueError naming the keys of `data` that are no field of config_class, each with notes[key] (what it is
    instead, e.g. another command's setting) or else the nearest field name; the first MAX_UNKNOWN_NAMED of them and
    how many more. source: where the keys came from, as the message begins ("config: run.yaml")."""
    names = [f.name for f in dataclasses.fields(config_class)]
    unknown = sorted(set(data) - set(names))
    if not unknown:
        return
    notes = notes or {}
    described = []
    for key in unknown[:MAX_UNKNOWN_NAMED]:
        near = difflib.get_close_matches(key, names, n=1)
        note = notes.get(key) or (f"did you mean {near[0]}?" if near else "")
        described.append((repr(key), f" ({note})" if note else ""))
    where = f"for `fastgrpo {command}`"
    if len(described) == 1:
        listed = f"field {described[0][0]} {where}{described[0][1]}"
    else:
        more = f", and {len(unknown) - len(described)} more" if len(unknown) > len(described) else ""
        listed = f"fields {where}: {', '.join(key + note for key, note in described)}{more}"
    raise ValueError(f"{source}: unknown {listed}; see `fastgrpo {command} --help`")
