"""Run reward functions over a batch and report every failure: a function that raises, returns the wrong number
of rewards, or a value that is not a number, None or NaN (inf, text). Its failed samples score 0.0; the caller decides
whether a failure stops the run (GRPOTrainer's default, reward_errors="raise": RewardError names the function and the
first bad row) or is logged and trained through (reward_errors="skip"). A function raising mid-run is the run failing
in the user's code, not a mistake in the command's input: `fastgrpo train / ei / eval` end with exit 1 (as any
uncaught Python error; fastgrpo.train.errors), the one line naming the line that raised, and --debug shows the
function's traceback (RewardError is raised from its exception). Input a built-in reward cannot read (a null answer,
an unknown ifeval constraint) is refused before anything runs (value_checks): exit 2, with the other input mistakes.

Reward functions follow TRL: f(prompts, completions, **dataset_columns) -> list[float], one per completion; None
(or NaN, which TRL reads alike) for a completion the function does not apply to (left out of the sum across
functions: fastgrpo.loss.grpo.weighted_rewards). A function with a parameter named `completions` is called as TRL
calls it, by keyword (`f(completions, solution, **kwargs)` works); any other gets prompts and completions by
position. The arguments are TRL 1.16's (GRPOTrainer._calculate_rewards): the completions as text, or for a
conversational dataset (prompts of chat messages) as [{"role": "assistant", "content": text}]
(completions.as_trl_passes); each dataset column other than the prompt as a keyword holding one value per
completion; and TRAINER_KEYWORDS and TRL's logging hooks log_metric / log_extra (fastgrpo.rewards.reward_logs), given
to a function that names them or takes **kwargs. An async function (one returning an awaitable) is awaited, all of a
batch's together, on one event loop kept for the process (as TRL's), so a client a function keeps stays on its loop.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
import threading
import traceback
from collections.abc import Callable, Sequence

import torch

from fastgrpo.rewards.completions import as_trl_passes
from fastgrpo.rewards.reward_logs import HOOKS, RewardLogs
from fastgrpo.train.naming import setting

logger = logging.getLogger(__name__)
FAILURE = 0.0
_HOOKS_FILE = inspect.getfile(RewardLogs)  # a bad log_metric call raises in there: the user's line is the caller's
# What a trainer passes a reward function besides prompts, completions and the dataset's columns, as TRL does: each
# completion's token ids (a list of ints, the stop token included) and transformers' TrainerState of the run.
TRAINER_KEYWORDS = ("completion_ids", "trainer_state")


def reward_name(func: Callable) -> str:
    """As TRL names it (trl.trainer.utils.get_callable_name): a functools.partial by the function it wraps, an object
    without __name__ by its class."""
    while isinstance(func, functools.partial):
        func = func.func
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


def _by_keyword(func: Callable) -> bool:
    """True for a function that names `completions` as TRL's examples do: TRL passes prompts and completions by
    keyword, so such a function may leave out `prompts` or put `completions` first."""
    try:
        param = inspect.signature(func).parameters.get("completions")
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind != inspect.Parameter.POSITIONAL_ONLY


def _accepted(func: Callable, keywords: dict) -> dict:
    """The keywords `func` names or takes as **kwargs: a function written for fastgrpo before it passed
    TRAINER_KEYWORDS, f(prompts, completions, answer), keeps working."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return keywords
    return {k: v for k, v in keywords.items() if k in params and params[k].kind != inspect.Parameter.POSITIONAL_ONLY}


def call_reward(func: Callable, prompts: list, completions: list, columns: dict[str, list], trainer: dict):
    """What `func` returns for these completions, called by keyword or by position (_by_keyword); trainer: the
    TRAINER_KEYWORDS' values and the logging hooks (RewardLogs.hooks), each passed if `func` takes it. An awaitable
    for an async function."""
    columns = {**columns, **_accepted(func, trainer)}
    if _by_keyword(func):
        return func(prompts=prompts, completions=completions, **columns)
    return func(prompts, completions, **columns)


def _required_keywords(func: Callable) -> list[str]:
    """The parameters `func` needs a value for, other than prompts and completions (by name for a function called
    by keyword, else the first two)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return []
    params = [p for p in params if p.name not in ("prompts", "completions")] if _by_keyword(func) else params[2:]
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]


def required_columns(func: Callable) -> list[str]:
    """Dataset columns `func` needs: the parameters it needs a value for other than prompts, completions, the
    TRAINER_KEYWORDS and the logging hooks (log_metric, log_extra)."""
    passed = (*TRAINER_KEYWORDS, *HOOKS)
    return [name for name in _required_keywords(func) if name not in passed]


def value_checks(func: Callable) -> dict[str, Callable[[object], str | None]]:
    """{column: check} for the columns `func` needs a readable value of in every row: check(value) names what is
    missing ("null", "empty"), raises ValueError for a value `func` cannot read (ifeval's unknown constraint), and
    returns None when nothing is wrong. From the function's `value_checks` attribute (the math rewards' answer,
    ifeval's constraints); none for other functions."""
    return getattr(func, "value_checks", {})


def check_column_values(reward_funcs: Sequence[Callable], rows, field: str) -> None:
    """Refuse the first row whose value in a column a reward function needs (value_checks) is missing or unreadable,
    naming the row and the column: the math rewards scored a null answer 0 on every completion, silently, and
    ifeval raised on a bad constraint only once the run had sampled the row. rows: a list of dict rows that have the
    columns, or a datasets.Dataset; field names them in the error."""
    for func in reward_funcs:
        for column, check in value_checks(func).items():
            values = rows[column] if getattr(rows, "column_names", None) is not None else (row[column] for row in rows)
            for i, value in enumerate(values):
                try:
                    problem = check(value)
                except ValueError as err:
                    raise ValueError(f"{field}: row {i}: {err}") from None
                if problem is not None:
                    raise ValueError(f"{field}: row {i} has no {column} (the {column} column is {problem}); reward "
                                     f"function {reward_name(func)} needs one per row")


class RewardError(RuntimeError):
    """A reward function failed and the run stops (reward_errors="raise")."""


class RewardFailure(str):
    """The message of one reward function's failure on a batch ("raised KeyError: 'x'", "returned inf, ..."), a
    str (it goes into metrics and JSON as it is) that also carries the function's name, `row`: the first
    completion (batch position) the failure shows on, None when no single row is to blame (a wrong count), and for
    an exception it raised (`error`), `raised_at` (" (at rewards.py:12, in lookup)": the innermost frame, the user's
    code or what it called; for a bad log_metric call, the line that made it) and `trace`, its traceback as text. Text, not the exception: its frames would hold the
    step's tensors alive for as long as the metrics keep the failure (reward_errors="skip")."""

    function: str
    row: int | None
    raised_at: str
    trace: str | None

    def __new__(cls, function: str, problem: str, row: int | None = None, error: Exception | None = None):
        out = super().__new__(cls, problem)
        out.function, out.row, out.raised_at, out.trace = function, row, "", None
        if error is not None and error.__traceback__ is not None:
            frame = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != _HOOKS_FILE][-1]
            out.raised_at = f" (at {os.path.basename(frame.filename)}:{frame.lineno}, in {frame.name})"
            out.trace = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
        return out


class ReportedTraceback(Exception):
    """A reward function's traceback, as text: what a RewardError is raised from, so that --debug shows where the
    user's function failed."""


def traceback_of(failure: str) -> ReportedTraceback | None:
    """The traceback of the exception a failure (a RewardFailure) stands for; None for one that raised nothing, or
    plain text (failures merged across processes)."""
    trace = getattr(failure, "trace", None)
    return None if trace is None else ReportedTraceback(trace)


def _as_float(value) -> float | None:
    """A finite float; NaN for None or NaN (not applicable: TRL's nansum leaves both out); None for anything else
    (inf, text, even "1"): a bug."""
    if value is None:
        return math.nan
    if isinstance(value, (str, bytes)):  # float("1") would pass a reward that is text, which TRL refuses
        return None
    if isinstance(value, bool):
        return float(value)
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isinf(out) else out


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


_loop: asyncio.AbstractEventLoop | None = None  # the async reward functions' event loop, started on first use


def _event_loop() -> asyncio.AbstractEventLoop:
    """One event loop for the process, run by a daemon thread: a reward's await works inside a caller's running
    loop too (a notebook), and a client a function created on an earlier batch is still on its loop."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        threading.Thread(target=_loop.run_forever, name="fastgrpo-async-rewards", daemon=True).start()
    return _loop


def _forget_event_loop() -> None:
    global _loop
    _loop = None


# a forked child (a user's worker pool, a test's process group) copies _loop without the thread that runs it: its
# first async reward would wait for good on a loop that never runs
os.register_at_fork(after_in_child=_forget_event_loop)


def _await_together(awaitables: list) -> list:
    """The results of the awaitables, awaited concurrently (as TRL's asyncio.gather); an exception one raised in its
    place."""
    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    return asyncio.run_coroutine_threadsafe(gather(), _event_loop()).result()


def _returned(func: Callable, prompts: list, completions: list, columns: dict[str, list], trainer: dict):
    """What `func` returns, an async function's result awaited; raises what it raised."""
    out = call_reward(func, prompts, completions, columns, trainer)
    if inspect.isawaitable(out):
        out, = _await_together([out])
        if isinstance(out, BaseException):
            raise out
    return out


def _trainer_keywords(completion_ids: list[list[int]] | None, trainer_state) -> dict:
    """The TRAINER_KEYWORDS a caller has values for."""
    return {k: v for k, v in zip(TRAINER_KEYWORDS, (completion_ids, trainer_state)) if v is not None}


def _call_all(reward_funcs: Sequence[Callable], prompts: list, completions: list, columns: dict[str, list],
              trainer: dict, logs: RewardLogs) -> list:
    """Each function's return value, or the Exception it raised; the async ones awaited together."""
    outs = []
    for func, name in zip(reward_funcs, reward_names(reward_funcs)):
        try:
            outs.append(call_reward(func, prompts, completions, columns, {**trainer, **logs.hooks(name)}))
        except Exception as err:  # a user's function may raise anything; the caller decides what happens
            outs.append(err)
    pending = [j for j, out in enumerate(outs) if inspect.isawaitable(out)]
    for j, out in zip(pending, _await_together([outs[j] for j in pending]) if pending else []):
        if isinstance(out, BaseException) and not isinstance(out, Exception):  # KeyboardInterrupt: the user's stop
            raise out
        outs[j] = out
    return outs


def _rewards_of(name: str, returned, n: int) -> tuple[list[float | None], RewardFailure | None]:
    """A function's return value as n floats (None for a bad value) and the failure, if any."""
    if isinstance(returned, Exception):
        return [None] * n, RewardFailure(name, f"raised {_first_line(returned)}", error=returned)
    try:
        values = list(returned)
    except TypeError:  # None (a forgotten return) or one number: not an error the function raised
        return [None] * n, RewardFailure(name, f"returned {returned!r:.40}, expected a list of {n} rewards (one per "
                                               "completion)")
    if len(values) != n:
        return [None] * n, RewardFailure(name, f"returned {len(values)} rewards for {n} completions")
    parsed = [_as_float(v) for v in values]
    bad = [i for i, v in enumerate(parsed) if v is None]
    if not bad:
        return parsed, None
    more = f" ({len(bad) - 1} more rows too)" if len(bad) > 1 else ""
    return parsed, RewardFailure(name, f"returned {values[bad[0]]!r}, not a finite number, None or NaN{more}", bad[0])


def score(
    reward_funcs: Sequence[Callable], prompts: list, completions: list[str], columns: dict[str, list], *,
    completion_ids: list[list[int]] | None = None, trainer_state=None, logs: RewardLogs | None = None,
) -> tuple[torch.Tensor, dict[str, RewardFailure]]:
    """Rewards [N, F] (float64) of N completions (texts) under F functions, and {name: failure} for those that
    failed (their failed samples score FAILURE). A None reward is NaN. The functions get the completions as TRL
    passes them (as_trl_passes), completion_ids / trainer_state where given (TRAINER_KEYWORDS), and log_metric /
    log_extra, into `logs` (None: a caller that records none of it, RewardLogs(recorded=False)); what a function that
    raised logged is dropped (RewardLogs.settle)."""
    n = len(completions)
    rewards = torch.full((n, len(reward_funcs)), FAILURE, dtype=torch.float64)
    failures = {}
    with (logs or RewardLogs(recorded=False)).scoring() as logs:
        outs = _call_all(reward_funcs, prompts, as_trl_passes(prompts, completions), columns,
                         _trainer_keywords(completion_ids, trainer_state), logs)
        for returned, name in zip(outs, reward_names(reward_funcs)):
            logs.settle(name, raised=isinstance(returned, Exception))
    for j, (returned, name) in enumerate(zip(outs, reward_names(reward_funcs))):
        parsed, failure = _rewards_of(name, returned, n)
        if failure is not None:
            failures[name] = failure
        rewards[:, j] = torch.tensor([FAILURE if v is None else v for v in parsed], dtype=torch.float64)
    return rewards, failures


def warn_unscored(rewards: torch.Tensor, describe_row: Callable[[int], str] = lambda row: f"row {row}") -> None:
    """A warning for the completions no reward function applied to (every one returned None or NaN; rewards [N] NaN):
    they carry no signal, as in TRL (advantage 0, not counted in means)."""
    unscored = rewards.isnan().nonzero().flatten().tolist()
    if unscored:
        logger.warning("every reward function returned None (or NaN) for %d completion(s), first %s; they are left "
                       "out (advantage 0): make at least one function score every completion", len(unscored),
                       describe_row(unscored[0]))


def nan_mean(values: torch.Tensor) -> float | None:
    """The mean over the non-NaN entries (rewards a function scored); None when there are none (valid JSON)."""
    kept = values[~values.isnan()]
    return kept.mean().item() if kept.numel() else None


def nan_sample_std(values: torch.Tensor) -> float | None:
    """TRL 1.16's nanstd: the std (Bessel's correction) over the non-NaN entries; None for fewer than two, where
    TRL's is NaN and its log() writes null (one value has no spread to measure: not 0.0)."""
    kept = values[~values.isnan()]
    return kept.std().item() if kept.numel() > 1 else None


def zero_spread_fraction(grouped: torch.Tensor) -> float:
    """The fraction of groups (rows of grouped [groups, G]) whose scored rewards are all equal (no signal); a
    group with no scored reward counts too."""
    high, low = grouped.nan_to_num(-math.inf).amax(-1), grouped.nan_to_num(math.inf).amin(-1)
    return ((high == low) | grouped.isnan().all(-1)).float().mean().item()


def first_failing_row(func: Callable, prompts: list, completions: list[str], columns: dict[str, list], *,
                      completion_ids: list[list[int]] | None = None, trainer_state=None) -> int | None:
    """The first row on which `func`, called on that row alone (as score() calls it), raises; None if every row
    alone passes. For the message of a function that raised on the batch (it costs up to one call per row: only
    when the run stops; what it logs is dropped)."""
    passed = as_trl_passes(prompts, completions)
    with RewardLogs().scoring() as dropped:  # a log_metric `func` kept from an earlier call logs in here too
        hooks = dropped.hooks(reward_name(func))
        for i in range(len(completions)):
            row_ids = None if completion_ids is None else completion_ids[i:i + 1]
            try:
                _returned(func, prompts[i:i + 1], passed[i:i + 1], {k: v[i:i + 1] for k, v in columns.items()},
                          {**_trainer_keywords(row_ids, trainer_state), **hooks})
            except Exception:
                return i
    return None


def check_failures(failures: dict[str, RewardFailure], reward_funcs: Sequence[Callable], prompts: list,
                   completions: list[str], columns: dict[str, list], *, on_error: str,
                   describe_row: Callable[[int], str] = lambda row: f"row {row}",
                   completion_ids: list[list[int]] | None = None, trainer_state=None) -> None:
    """What a run does with score()'s failures. on_error="skip": log each one (its samples scored 0). "raise":
    RewardError naming the first failing function, what went wrong and the first bad row, as describe_row(batch
    position) words it (a trainer names the dataset row); for a function that raised on the batch, the row is
    found by calling it on each row alone (with score()'s arguments: completion_ids, trainer_state)."""
    if on_error == "skip":
        for failure in failures.values():
            logger.warning("reward function %s failed; its failed samples score 0: %s", failure.function, failure)
        return
    failure = next(iter(failures.values()))
    row = failure.row
    if row is None and failure.startswith("raised"):
        func = reward_funcs[reward_names(reward_funcs).index(failure.function)]
        row = first_failing_row(func, prompts, completions, columns, completion_ids=completion_ids,
                                trainer_state=trainer_state)
    where = "" if row is None else f" on {describe_row(row)}: {completions[row][:40]!r}"
    raise RewardError(f"reward function {failure.function} {failure}{failure.raised_at}{where}; "
                      f"{setting('reward_errors', 'skip')} scores such rows 0 instead") from traceback_of(failure)
