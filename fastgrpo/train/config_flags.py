"""Each field of a config dataclass as a `--field-name` flag of its command (add_config_arguments), with its --help
text and default, parsed to the field's type."""
from __future__ import annotations

import argparse
import dataclasses

from fastgrpo.train.coercion import base_type, type_hints
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.naming import flag as flag_of


def _parser_for(scalar: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() in ("none", "null"):
            return None
        return scalar(text)

    parse.__name__ = scalar.__name__
    return parse


class _ListOrNone(argparse.Action):
    """An optional list's flag: a lone `none` unsets it, as a YAML `report_to: none` does (`--report-to none` is how
    TRL's users turn reporting off); among other values it is a value (`--stop none END`)."""

    def __init__(self, *args, item_type, **kwargs):
        super().__init__(*args, **kwargs)
        self.item_type = item_type

    def __call__(self, parser, namespace, values, option_string=None):
        if len(values) == 1 and values[0].lower() in ("none", "null"):
            setattr(namespace, self.dest, None)
            return
        items = []
        for value in values:
            try:
                items.append(self.item_type(value))
            except ValueError:  # argparse's own words for a bad value of a `type`
                raise argparse.ArgumentError(self, f"invalid {self.item_type.__name__} value: {value!r}") from None
        setattr(namespace, self.dest, items)


def add_config_arguments(parser: argparse.ArgumentParser, config_class: type = GRPOConfig,
                         notes: dict[str, str] | None = None) -> None:
    """One `--field-name` flag per field of config_class (a config dataclass such as GRPOConfig); unset flags stay
    absent from the parsed namespace. notes: {field: text} appended to the default in --help, for defaults that a
    preset replaces (`default: 1e-06; 0.003 for the built-in model`)."""
    hints = type_hints(config_class)
    notes = notes or {}
    for field in dataclasses.fields(config_class):
        scalar, is_list, optional = base_type(hints[field.name])
        flag = flag_of(field.name)
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        note = f"; {notes[field.name]}" if field.name in notes else ""
        help_text = f"{field.metadata.get('help', '')} (default: {default}{note})".replace("%", "%%")
        if scalar is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        elif is_list and optional:
            parser.add_argument(flag, nargs="*", action=_ListOrNone, item_type=_parser_for(scalar, False),
                                default=argparse.SUPPRESS, help=help_text + ", space-separated; 'none' to unset")
        elif is_list:
            parser.add_argument(flag, nargs="*", type=_parser_for(scalar, False), default=argparse.SUPPRESS,
                                help=help_text + ", space-separated")
        else:
            parser.add_argument(flag, type=_parser_for(scalar, optional), default=argparse.SUPPRESS,
                                help=help_text + (", 'none' to unset" if optional else ""))
