"""TRL's logging hooks for reward functions, as fastgrpo honours them (TRL 1.16's GRPOTrainer passes every function
`log_metric` and `log_extra`, bound to its _log_metric / _log_completion_extra).

log_metric(name, value): a scalar for this batch. Under `name`, as TRL logs it, every command records the mean of the
values logged under it on every process: a training step in its metrics line (metrics.jsonl, wandb, tensorboard), an
expert-iteration round in its line of metrics.jsonl, an evaluation in its summary (summary.json; "eval/<name>" in the
metrics line of the step it ran at). A NaN value is "not measured" (left out; a name with none logs null, as TRL's
log() drops NaN). score() called without a RewardLogs records none, with a warning once per name.
log_extra(column, values): a column of TRL's completions table (its log_completions), which fastgrpo does not keep:
taken and not recorded, with a warning once per column.
"""
from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)
HOOKS = ("log_extra", "log_metric")
_warned: set[tuple[str, str]] = set()  # (hook, name) already warned of in this process: once, not every step


def _warn_once(hook: str, name: str, message: str, *args) -> None:
    if (hook, name) not in _warned:
        _warned.add((hook, name))
        logger.warning(message, *args)


def metric_value(name, value) -> float:
    """`value` as a float: a number, a one-element tensor or a 0-d array; NaN stays NaN (not measured). Anything else,
    inf, or a name that is not text, is a ValueError naming log_metric (raised in the reward function that called
    it, so that the run's reward error names the function)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"log_metric: expected a metric name (text), got {name!r:.40}")
    try:
        out = None if isinstance(value, (str, bytes)) else float(value)  # float("1") would take text
    except (TypeError, ValueError):
        out = None
    if out is None or math.isinf(out):
        raise ValueError(f"log_metric: {name!r} got {value!r:.40}, expected one finite number")
    return out


class RewardLogs:
    """What the reward functions of one batch log through TRL's hooks: `values` {metric name: the numbers logged
    under it, NaN left out} and `sources` {metric name: the function that logged it first}. recorded=False for a
    score() call given none, whose caller records no metrics: a warning names what is not recorded."""

    def __init__(self, recorded: bool = True):
        self.values: dict[str, list[float]] = {}
        self.sources: dict[str, str] = {}
        self.recorded = recorded

    def hooks(self, function: str) -> dict:
        """log_metric and log_extra for reward function `function` (its name in metrics and errors): bound methods
        taking what TRL's take."""
        hooks = _FunctionHooks(self, function)
        return {"log_extra": hooks.log_extra, "log_metric": hooks.log_metric}


class _FunctionHooks:
    def __init__(self, logs: RewardLogs, function: str):
        self.logs, self.function = logs, function

    def log_metric(self, name: str, value: float) -> None:
        value, logs = metric_value(name, value), self.logs
        logs.values.setdefault(name, [])
        logs.sources.setdefault(name, self.function)
        if not math.isnan(value):
            logs.values[name].append(value)
        if not logs.recorded:
            _warn_once("log_metric", name, "reward function %s logged metric %r with log_metric: score() was "
                       "called without logs=RewardLogs(), so it is not recorded", self.function, name)

    def log_extra(self, column: str, values: list) -> None:
        _warn_once("log_extra", str(column), "reward function %s logged column %r with log_extra: fastgrpo keeps no "
                   "completions table (TRL's log_completions), so it is not recorded", self.function, column)


def merged_means(shares: list[tuple[dict, dict]]) -> dict[str, tuple[float | None, str]]:
    """{metric name: (mean, function that logged it)} of the (values, sources) of RewardLogs on every process, in
    name order: each name's mean over all its values (TRL's sum / count across processes), None where none was
    measured."""
    values, sources = {}, {}
    for share_values, share_sources in shares:
        for name, numbers in share_values.items():
            values.setdefault(name, []).extend(numbers)
            sources.setdefault(name, share_sources[name])
    return {name: (sum(values[name]) / len(values[name]) if values[name] else None, sources[name])
            for name in sorted(values)}
