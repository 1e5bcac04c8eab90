"""Where each setting of a run came from: a flag, a config file, a built-in preset or the config's default. A refused
value's one-line error names the place to change it, `learning_rate (from run.yaml): expected a finite number >= 0,
got -1.0`; a flag's (or a Python keyword's) error stays `learning_rate: ...`, the name the user typed.

A command's config_from_args names every source while it builds and checks the config (SettingSources.naming: there
`batch_size (the default): expected a multiple of num_generations (3), got 64` says the user never set it). The CLI
runs each command inside naming_recorded_sources(), where config_from_args records its sources (record_sources): an
error raised later in the run names the file of a setting the user wrote there (`model (from run.yaml): no such
folder ...`), not a default, whose error is about the run's state more than about the value.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

DEFAULT = "the default"
MODEL_PRESET = "the built-in model's setting"
DATA_PRESET = "the built-in task's setting"
UNSET = (DEFAULT, MODEL_PRESET, DATA_PRESET)  # the sources of what the user did not set

# the field(s) a message is about, as the codebase's errors begin: `name: ...`, `name / other: ...`
_LEADING_FIELDS = re.compile(r"([a-z][a-z0-9_]*(?: / [a-z][a-z0-9_]*)*): ")
_RECORDED = contextvars.ContextVar("fastgrpo_setting_sources", default=None)


def from_file(path: str | Path) -> str:
    """The source of a config file's settings, as messages name it: 'from /abs/or/typed/run.yaml'."""
    return f"from {Path(path).expanduser()}"


class SettingSources:
    """{field: where its value came from} of one config; a field no layer sets comes from DEFAULT. Layers are given
    lowest precedence first, as (names, where); where None is what the user typed (a flag, a keyword): not said."""

    def __init__(self, config_class: type, *layers: tuple[Iterable[str], str | None]):
        self._where: dict[str, str | None] = {field.name: DEFAULT for field in dataclasses.fields(config_class)}
        for names, where in layers:
            self._where.update({name: where for name in names if name in self._where})

    def named(self, err: ValueError, unset_too: bool = True) -> ValueError:
        """`err` with where each field it begins with came from, `lr (from run.yaml): ...`; `err` itself where it
        begins with no field, or only with fields the user typed. unset_too: a default's or a preset's too, else only
        what a file (or a checkpoint's run) gave."""
        message = str(err)
        match = _LEADING_FIELDS.match(message)
        names = match.group(1).split(" / ") if match is not None else []
        said = {name: self._where.get(name) for name in names}
        said = {name: where for name, where in said.items() if where and (unset_too or where not in UNSET)}
        if type(err) is not ValueError or not said:
            return err
        lead = " / ".join(f"{name} ({said[name]})" if name in said else name for name in names)
        return ValueError(f"{lead}: {message[match.end():]}")

    @contextlib.contextmanager
    def naming(self):
        """Inside: a ValueError about a setting names where it came from (named)."""
        try:
            yield
        except ValueError as err:
            _raise_named(err, self.named(err))


def record_sources(sources: SettingSources) -> None:
    """Tell the enclosing naming_recorded_sources() (the CLI's run of a command) where its settings came from."""
    recorded = _RECORDED.get()
    if recorded is not None:
        recorded.append(sources)


@contextlib.contextmanager
def naming_recorded_sources():
    """Inside: a ValueError about a setting a file gave names the file, by the sources record_sources last got."""
    recorded: list[SettingSources] = []
    token = _RECORDED.set(recorded)
    try:
        yield
    except ValueError as err:
        if not recorded:
            raise
        _raise_named(err, recorded[-1].named(err, unset_too=False))
    finally:
        _RECORDED.reset(token)


def _raise_named(err: ValueError, named: ValueError):
    if named is err:
        raise err
    raise named from err
