"""Config field values given their annotated types, so a YAML file, a flag and a Python keyword mean the same.

coerce_fields is what each config dataclass calls first in its __post_init__; coerced types a YAML mapping before the
config is built (the presets read it); type_hints and base_type also give config_flags.add_config_arguments each
flag's type.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import types
import typing


def coerce_fields(config) -> None:
    """Give each field of a config dataclass its annotated type (coerced_value), or raise a ValueError naming it.
    Any config dataclass may call it first thing in its __post_init__."""
    hints = type_hints(type(config))
    for field in dataclasses.fields(config):
        setattr(config, field.name, coerced_value(field.name, getattr(config, field.name), hints[field.name]))


def coerced(config_class: type, values: dict) -> dict:
    """`values` (a YAML file's, say) with each field of config_class given its type as coerce_fields gives it, so
    that what reads them before the config is built (presets) sees `16` for a YAML `"16"` and None for `none`; a
    bool field's yes / no / on / off (BOOL_WORDS) true / false; other keys as they are (from_dict names them)."""
    hints = type_hints(config_class)
    return {k: _file_value(k, v, hints[k]) if k in hints else v for k, v in values.items()}


def _file_value(name: str, value, hint):
    """coerced_value of a config file's value; a number or boolean for a text field is refused saying how to write
    it as text (`dataset_config: 2023`: '2023', as the flag would have it)."""
    try:
        return coerced_value(name, _yaml_bool(name, value, hint), hint)
    except ValueError as err:
        if base_type(hint)[0] is str and isinstance(value, (bool, int, float)):
            raise ValueError(f"{err} (read as {'a boolean' if isinstance(value, bool) else 'a number'}: "
                             "quote it)") from None
        raise


def _yaml_bool(name: str, value, hint):
    """`value` as a bool where it is one of BOOL_WORDS for a bool field (or one TRL_VALUES maps); else as it is. Not
    coerce_fields': from Python, patch='yes' is more likely a mistake than a YAML author's boolean."""
    if isinstance(value, str) and value.lower() in BOOL_WORDS and (base_type(hint)[0] is bool or name in TRL_VALUES):
        return BOOL_WORDS[value.lower()]
    return value


# fields holding a path, where ~ and $VAR / ${VAR} are expanded (as a shell expands them on a command line; YAML
# does not); a reward function's file is expanded as it is imported (fastgrpo.train.sources.import_function)
PATH_FIELDS = ("model", "dataset", "eval_dataset", "output_dir", "checkpoint")


# what a config file's bool field takes as text: YAML 1.2 (config_file's reading) leaves yes / no / on / off as text,
# which YAML 1.1 (and TRL's configs) read as booleans
BOOL_WORDS = {word: value for value, words in ((True, ("true", "yes", "on")), (False, ("false", "no", "off")))
              for word in words}

# values TRL's configs take for a field that fastgrpo spells otherwise, as TRL reads them (a recipe's YAML works here)
TRL_VALUES = {"scale_rewards": {True: "group", False: "none"}}


def coerced_value(name: str, value, hint):
    """`value` of field `name` as its type hint says, or a ValueError naming it. YAML 1.1 reads `learning_rate:
    1e-6` as a string (a float needs a dot there), so numeric strings become the field's int / float; an integral
    float becomes an int (`max_steps: 1e3`); one scalar becomes a one-element list (`reward_funcs: length`); 'none'
    unsets an optional field, as its flag's 'none' does; a path field's ~ and environment variables are expanded;
    TRL's scale_rewards: false is 'none'."""
    scalar, is_list, optional = base_type(hint)
    if isinstance(value, bool) and name in TRL_VALUES:
        value = TRL_VALUES[name][value]
    if optional and isinstance(value, str) and value.lower() in ("none", "null"):  # as on the command line
        value = None
    if value is None:
        if not optional:
            raise ValueError(f"{name}: expected {_describe(scalar, is_list)}, got None")
        return None
    if name in PATH_FIELDS and isinstance(value, str):
        return expanded_path(name, value)
    if is_list:
        items = [value] if isinstance(value, (str, int, float)) else value
        if not isinstance(items, (list, tuple)) or any(isinstance(item, (list, tuple, dict)) for item in items):
            raise ValueError(f"{name}: expected {_describe(scalar, True)}, got {value!r}")  # [[a, b]]: no list of lists
        return [_coerce(name, item, scalar) for item in items]
    return _coerce(name, value, scalar)


def expanded_path(name: str, path: str) -> str:
    """`path` with ~ and $VAR / ${VAR} expanded; a variable that is not set is an error naming it (os.path.expandvars
    would leave a folder named `$SCRATCH` to be read or created)."""
    expanded = os.path.expandvars(os.path.expanduser(path))
    unset = re.search(r"\$(\w+|\{[^}]*\})", expanded)
    if unset is not None:
        raise ValueError(f"{name}: environment variable {unset.group(1).strip('{}')} is not set (in {path!r})")
    return expanded


def _coerce(name: str, value, scalar: type):
    if scalar is bool:
        if isinstance(value, bool):
            return value
    elif scalar is int:
        number = _number(value)
        if number is not None and float(number).is_integer():
            return int(number)
    elif scalar is float:
        number = _number(value)
        if number is not None:
            return float(number)
    elif isinstance(value, scalar):
        return value
    raise ValueError(f"{name}: expected {_describe(scalar, False)}, got {value!r}")


def _number(value) -> int | float | None:
    """An int or float from a number or a numeric string (not a bool); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        for parse in (int, float):
            try:
                return parse(value.strip())
            except ValueError:
                pass
    return None


def _describe(scalar: type, is_list: bool) -> str:
    word = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(scalar, scalar.__name__)
    return f"a list of {word.removeprefix('an ').removeprefix('a ')}s" if is_list else word


@functools.cache
def type_hints(config_class: type) -> dict:
    return typing.get_type_hints(config_class)


def base_type(annotation) -> tuple[type, bool, bool]:
    """(scalar type, is_list, is_optional) of a field annotation such as `list[str] | None`."""
    hint = annotation
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True, optional
    return hint, False, optional
