"""TRL's logging hooks for reward functions, as fastgrpo honours them (TRL 1.16's GRPOTrainer passes every function
`log_metric` and `log_extra`, bound to its _log_metric / _log_completion_extra).

log_metric(name, value): a scalar for this batch. Under `name`, as TRL logs it, every command records the mean of the
values logged under it on every process: a training step in its metrics line (metrics.jsonl, wandb, tensorboard), an
expert-iteration round in its line of metrics.jsonl, an evaluation in its summary (summary.json; "eval/<name>" in the
metrics line of the step it ran at). A NaN value is "not measured" (left out; a name with none logs null, as TRL's
log() drops NaN). Values of a call that raised are dropped (reward_errors="skip"), a hook kept past its call logs into
the batch being scored (RewardLogs). score() called without a RewardLogs records none, with a warning once per name.
A name the command's own metrics take (RewardLogs' `taken`) is refused as it is logged, before the command changes
anything (the caller raises `clash`).
log_extra(column, values): a column of TRL's completions table (its log_completions), which fastgrpo does not keep:
taken and not recorded, with a warning once per column.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import traceback
from collections.abc import Container

logger = logging.getLogger(__name__)
HOOKS = ("log_extra", "log_metric")
_warned: set[tuple[str, str]] = set()  # (hook, name) already warned of in this process: once, not every step


def _warn_once(hook: str, name: str, message: str, *args) -> None:
    if (hook, name) not in _warned:
        _warned.add((hook, name))
        logger.warning(message, *args)


@dataclasses.dataclass(frozen=True)
class TakenNames:
    """The metric names a command's own metrics take: `names`, and every name starting with one of `prefixes`."""

    names: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()

    def __contains__(self, name: str) -> bool:
        return name in self.names or name.startswith(self.prefixes)

    def __or__(self, other: TakenNames) -> TakenNames:
        return TakenNames(self.names | other.names, self.prefixes + other.prefixes)


def clash_message(function: str, name: str, where: str = "") -> str:
    """The error of reward function `function` logging metric `name` that fastgrpo's own metrics take; where: the
    line that logged it (" (at my_rewards.py:3, in judge)")."""
    return (f"reward function {function} logged metric {name!r} with log_metric{where}, a name fastgrpo's own metrics "
            f"take; give it another (e.g. '{function}/{name}')")


def _calling_line() -> str:
    """ (at file:line, in function) of the innermost frame outside this module: the line that called log_metric."""
    frame = [f for f in traceback.extract_stack() if f.filename != __file__][-1]
    return f" (at {os.path.basename(frame.filename)}:{frame.lineno}, in {frame.name})"


def metric_value(name, value) -> float:
    """`value` as a float: a number, a one-element tensor or a 0-d array; NaN stays NaN (not measured). Anything else,
    inf, or a name that is not text, is a ValueError naming log_metric (raised in the reward function that called
    it, so that the run's reward error names the function)."""
    if not isinstance(name, str) or not name.strip():  # a blank name is no key a metrics viewer can show
        raise ValueError(f"log_metric: expected a metric name (text, not blank), got {name!r:.40}")
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
    score() call given none, whose caller records no metrics: a warning names what is not recorded.

    A call's values count once it is settled (score(): the function returned); a call that raised logged part of what
    it meant to (reward_errors="skip" trains on), so its values are dropped, its names kept (null: not measured).
    TRL's hooks are one pair for the whole run, fastgrpo's one per call: a hook kept from an earlier call (or used by
    a thread still running after its call returned) logs into the batch being scored now, as TRL's would; with none
    being scored, what it logs is not recorded (a warning says so).

    taken: the names the command's own metrics take (TakenNames). Logging one records nothing: `clash` is then the
    error of the first such call (clash_message, naming its line), which the caller raises once the functions
    return, before it changes anything (a training step's update would be lost with the step's metrics)."""

    def __init__(self, recorded: bool = True, taken: Container[str] = ()):
        self.values: dict[str, list[float]] = {}
        self.sources: dict[str, str] = {}
        self.recorded, self.taken = recorded, taken
        self.clash: str | None = None
        self._calls: dict[str, _FunctionHooks] = {}  # {function: its hooks in the call not settled yet}
        self._lock = threading.Lock()  # a reward may log from a thread pool while its call is settled

    def hooks(self, function: str) -> dict:
        """log_metric and log_extra for reward function `function` (its name in metrics and errors): bound methods
        taking what TRL's take."""
        hooks = self._calls[function] = _FunctionHooks(self, function)
        return {"log_extra": hooks.log_extra, "log_metric": hooks.log_metric}

    @contextlib.contextmanager
    def scoring(self):
        """While score() calls the functions: the batch that hooks kept from earlier calls log into."""
        global _scoring
        outer, _scoring = _scoring, self
        try:
            yield self
        finally:
            _scoring = outer

    def settle(self, function: str, raised: bool) -> None:
        """Record what `function`'s call logged: its names only, for a call that raised."""
        with self._lock:
            hooks = self._calls.pop(function)
            hooks.settled = True
            for name, value in hooks.pending:
                self._record(function, name, math.nan if raised else value)

    def hold(self, hooks: _FunctionHooks, name: str, value: float) -> bool:
        """Hold a value `hooks` logged until its call is settled; False once it is."""
        with self._lock:
            if hooks.settled:
                return False
            if not self._refused(hooks.function, name):
                hooks.pending.append((name, value))
        self._warn_if_unrecorded(hooks.function, name)
        return True

    def hold_late(self, function: str, name: str, value: float) -> None:
        """A value from a hook of an earlier call of `function`: held with this batch's call of it, if unsettled."""
        with self._lock:
            if self._refused(function, name):
                return
            call = self._calls.get(function)
            if call is not None:
                call.pending.append((name, value))
            else:
                self._record(function, name, value)
        self._warn_if_unrecorded(function, name)

    def _refused(self, function: str, name: str) -> bool:
        """Whether `name` is taken (called holding the lock); the first taken one logged becomes `clash`."""
        if name not in self.taken:
            return False
        self.clash = self.clash or clash_message(function, name, _calling_line())
        return True

    def _record(self, function: str, name: str, value: float) -> None:
        self.values.setdefault(name, [])
        self.sources.setdefault(name, function)
        if not math.isnan(value):
            self.values[name].append(value)

    def _warn_if_unrecorded(self, function: str, name: str) -> None:
        if not self.recorded:
            _warn_once("log_metric", name, "reward function %s logged metric %r with log_metric: score() was "
                       "called without logs=RewardLogs(), so it is not recorded", function, name)


_scoring: RewardLogs | None = None  # the batch score() is scoring now on this process


class _FunctionHooks:
    def __init__(self, logs: RewardLogs, function: str):
        self.logs, self.function = logs, function
        self.pending: list[tuple[str, float]] = []  # (name, value) logged by this call, until it is settled
        self.settled = False

    def log_metric(self, name: str, value: float) -> None:
        value = metric_value(name, value)
        if self.logs.hold(self, name, value):
            return
        batch = _scoring
        if batch is None:
            _warn_once("late", self.function, "reward function %s called log_metric(%r) after its call returned and "
                       "outside any reward call: not recorded (log with the log_metric of the call being made)",
                       self.function, name)
            return
        batch.hold_late(self.function, name, value)

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
