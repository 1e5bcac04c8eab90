"""Run reward functions over a batch safely: a function that raises, returns the wrong count or non-numbers
is reported and its samples score 0.0 (a failure), so one bad function never crashes a training run.

Reward functions follow TRL: f(prompts, completions, **dataset_columns) -> list[float], one per completion.
"""
from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)
FAILURE = 0.0


def reward_name(func: Callable) -> str:
    return getattr(func, "__name__", type(func).__name__)


def reward_names(funcs: Sequence[Callable]) -> list[str]:
    """One distinct name per function for metrics and errors: a repeated name gets _2, _3, ... (two lambdas,
    two functools.partial of one function)."""
    names, seen = [], {}
    for func in funcs:
        name = reward_name(func)
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return names


def required_columns(func: Callable) -> list[str]:
    """Dataset columns `func` needs: keyword parameters after (prompts, completions) that have no default."""
    try:
        params = list(inspect.signature(func).parameters.values())[2:]
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]


def _as_float(value) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return FAILURE
    return out if math.isfinite(out) else FAILURE


def score(
    reward_funcs: Sequence[Callable], prompts: list, completions: list[str], columns: dict[str, list]
) -> tuple[torch.Tensor, dict[str, str]]:
    """Rewards [N, F] (float64) of N completions under F functions, and {name: error} for those that failed."""
    n = len(completions)
    rewards = torch.full((n, len(reward_funcs)), FAILURE, dtype=torch.float64)
    errors = {}
    for j, (func, name) in enumerate(zip(reward_funcs, reward_names(reward_funcs))):
        try:
            values = list(func(prompts, completions, **columns))
            if len(values) != n:
                raise ValueError(f"returned {len(values)} rewards for {n} completions")
        except Exception as err:  # a user's function may raise anything; the step must go on
            errors[name] = f"{type(err).__name__}: {err}"
            logger.warning("reward function %s failed; its %d samples score %s: %s", name, n, FAILURE, errors[name])
            continue
        rewards[:, j] = torch.tensor([_as_float(v) for v in values], dtype=torch.float64)
    return rewards, errors
