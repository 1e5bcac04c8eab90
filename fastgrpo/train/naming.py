"""How a message names a setting: as the flag under `fastgrpo ...` (`--reward-errors skip`), as the keyword from
Python (`reward_errors='skip'`). The CLI runs its commands inside `command_line()`; outside it is the Python API.
"""
from __future__ import annotations

import contextlib
import contextvars

_ON_COMMAND_LINE = contextvars.ContextVar("fastgrpo_on_command_line", default=False)
_UNSET = object()


def flag(field: str) -> str:
    """The command-line flag of a config field: reward_errors -> --reward-errors."""
    return "--" + field.replace("_", "-")


def setting(field: str, value=_UNSET) -> str:
    """A config field, with the value to give it, as the user writes it: `--resume` / `resume=True`, `--no-export` /
    `export=False`, `--reward-errors skip` / `reward_errors='skip'`; no value: the flag or the field's name."""
    if not _ON_COMMAND_LINE.get():
        return field if value is _UNSET else f"{field}={value!r}"
    if value is _UNSET or value is True:
        return flag(field)
    if value is False:
        return "--no-" + field.replace("_", "-")
    return f"{flag(field)} {value}"


TRAINERS = {"train": "GRPOTrainer", "sft": "SFTTrainer", "ei": "ExpertIteration"}  # command -> Python API


def continuing(command: str) -> str:
    """How to continue a run of `command`: `fastgrpo ei --resume` / ExpertIteration with resume=True."""
    if _ON_COMMAND_LINE.get():
        return f"`fastgrpo {command} --resume`"
    return f"fastgrpo.{TRAINERS[command]} with resume=True"


@contextlib.contextmanager
def command_line():
    """Messages raised or logged inside name flags (fastgrpo.train.errors.run_command enters it)."""
    token = _ON_COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _ON_COMMAND_LINE.reset(token)
