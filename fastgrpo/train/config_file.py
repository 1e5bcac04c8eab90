"""A config's file I/O: a YAML config file (`--config`) read into a {field: value} mapping, every problem one line
naming the file, and ConfigFile, the from_yaml / from_dict / to_dict every command's config has."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
from pathlib import Path

from fastgrpo._checks import check_known_fields
from fastgrpo.train.base_fingerprint import FINGERPRINT_KEY, recorded_fingerprint
from fastgrpo.train.coercion import coerced
from fastgrpo.train.dataset_fingerprint import FINGERPRINT_KEY as DATASET_FINGERPRINT_KEY
from fastgrpo.train.dataset_fingerprint import recorded_fingerprint as recorded_dataset_fingerprint
from fastgrpo.train.command_fields import unknown_key_notes
from fastgrpo.train.naming import setting
from fastgrpo.train.setting_sources import SettingSources, from_file
from fastgrpo.train.sources import function_file, recorded_function, resolved_dtype

# fields naming a file or folder a run reads: recorded absolute (ConfigFile.to_dict), so that a resume from another
# folder compares the files, not how they were spelt
INPUT_PATH_FIELDS = ("model", "dataset", "eval_dataset", "checkpoint")
# fields listing reward functions: the file of a "path/to/file.py:function" entry is recorded absolute alike
# (sources.recorded_function); a built-in name or a "module:function" is kept as typed
REWARD_FUNCTION_FIELDS = ("reward_funcs", "eval_reward_funcs")
# what one invocation does with the run already in output_dir, not a setting of the run: left out of the record, which
# fed back as --config would do it again (overwrite_output_dir: delete the run the record came from)
INVOCATION_FIELDS = ("resume", "resume_allow_changes", "overwrite_output_dir")
# the dtype the model loaded in where the record was written (dtype "auto" resolved there: a GPU run's bfloat16), so
# that `fastgrpo export` on a CPU writes what the run's final/ holds; beside the fields, no setting of its own
DTYPE_KEY = "resolved_dtype"
# a record's keys that are no fields: left out when it is read back
RECORD_KEYS = (FINGERPRINT_KEY, DATASET_FINGERPRINT_KEY, DTYPE_KEY)
RUN_RECORD = "run_config.json"  # the name of a run's record (fastgrpo.train.checkpoint.CONFIG_FILE is this one)


class ConfigFile:
    """from_yaml / from_dict / to_dict for a config dataclass; COMMAND names its subcommand in messages."""

    COMMAND = "train"

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides):
        """Fields from a YAML mapping, then `overrides`; unknown keys are an error naming them, a refused value one
        naming the file where the file gave it."""
        settings = cls.file_settings(path)
        check_relative_paths(settings, overrides, path)
        with SettingSources(cls, (settings, from_file(path)), (overrides, None)).naming():
            return cls.from_dict({**settings, **overrides})

    @classmethod
    def from_dict(cls, data: dict):
        """The config of `data`'s fields; a key that is no field is an error naming it (and the command it belongs
        to where it is another command's field: command_fields.unknown_key_notes). A record's fingerprint of its
        base model is no setting: left out."""
        data = {key: value for key, value in data.items() if key not in RECORD_KEYS}
        check_known_fields(data, cls, cls.COMMAND, unknown_key_notes(data, cls.COMMAND))
        return cls(**data)

    @classmethod
    def file_settings(cls, path: str | Path | None) -> dict:
        """The {field: value} settings of a YAML config file (`--config`; none: {}), each value of its field's type,
        before presets and flags join them; an unknown key or a wrong type is an error naming the file."""
        if path is None:
            return {}
        data = read_yaml(path)
        if Path(path).name == RUN_RECORD:  # a record from before to_dict left them out: not this invocation's
            data = {key: value for key, value in data.items() if key not in INVOCATION_FIELDS}
        data = {key: value for key, value in data.items() if key not in RECORD_KEYS}  # a record's, not settings
        check_known_fields(data, cls, cls.COMMAND, unknown_key_notes(data, cls.COMMAND),
                           source=f"config: {Path(path).expanduser()}")
        # `learning_rate: expected a number, got 'fast'` names the file: a flag could have said that
        with SettingSources(cls, (data, from_file(path))).naming():
            return coerced(cls, data)

    def to_dict(self) -> dict:
        """The fields, as the run's record (checkpoints, exports, metrics) keeps them: an input path that exists here
        (INPUT_PATH_FIELDS) made absolute, as is a reward function's file (REWARD_FUNCTION_FIELDS), so the record
        names the file the run read wherever it is read later, and output_dir absolute (the run's folder, for a
        resume from elsewhere); no INVOCATION_FIELDS. A local model folder's
        fingerprint is added (FINGERPRINT_KEY: base_fingerprint.recorded_fingerprint), which a resume and eval
        --checkpoint check the base against, a local dataset's (DATASET_FINGERPRINT_KEY: dataset_fingerprint), which
        a resume warns of where it changed, and the dtype the model loads in here (DTYPE_KEY)."""
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in INVOCATION_FIELDS}
        for name in INPUT_PATH_FIELDS:
            if isinstance(data.get(name), str) and os.path.exists(data[name]):
                data[name] = os.path.abspath(data[name])
        if isinstance(data.get("output_dir"), str):  # the record fed back (--resume) names its own run from anywhere
            data["output_dir"] = os.path.abspath(data["output_dir"])
        for name in REWARD_FUNCTION_FIELDS:
            if isinstance(data.get(name), list):
                data[name] = [recorded_function(spec, name) for spec in data[name]]
        if isinstance(data.get("dtype"), str) and isinstance(data.get("device"), str):
            data[DTYPE_KEY] = resolved_dtype(data["dtype"], data["device"])
        for key, recorded in ((FINGERPRINT_KEY, recorded_fingerprint(self)),
                              (DATASET_FINGERPRINT_KEY, recorded_dataset_fingerprint(self))):
            if recorded is not None:
                data[key] = recorded
        return data


def check_relative_paths(settings: dict, flags: dict, path: str | Path | None) -> None:
    """A config file's relative paths start from the current folder, as a flag's do (and TRL's and Axolotl's YAML
    paths). One of `settings` (the file's, no flag replacing it) missing there but found beside the file (a config
    written for a run from its own folder) is a ValueError naming the file, where loading it would say `no such
    file`."""
    if path is None:
        return
    folder = Path(path).expanduser().absolute().parent
    for name, given in _local_paths(settings):
        if name not in flags and not Path(given).is_absolute() and not Path(given).exists() \
                and (folder / given).exists():
            raise ValueError(f"{name} ({from_file(path)}): {given} is not in the current folder ({Path.cwd()}), "
                             "where a config file's relative paths start, as a flag's do; it is beside the config "
                             f"file: write {os.path.normpath(folder / given)} or run from {folder}")


def check_record_output_dir(settings: dict, flags: dict, path: str | Path | None) -> None:
    """A run's record (`<run>/checkpoint-<N>/` or `<run>/final/` RUN_RECORD) given as --config names its run's folder
    as output_dir, absolute: read from a copy of the run, it would resume (write into) the original. Where that folder
    is not the run folder holding the record and no --output-dir flag is given, a ValueError naming both folders."""
    if path is None or "output_dir" in flags or not isinstance(settings.get("output_dir"), str):
        return
    record = Path(path).expanduser().absolute()
    if record.name != RUN_RECORD or not _is_run_folder_part(record.parent.name):
        return
    run, named = record.parent.parent, Path(settings["output_dir"]).expanduser()
    if named.resolve() != run.resolve():
        raise ValueError(f"output_dir ({from_file(path)}): the record of the run in {run} names {named} as its run "
                         f"folder (a copied run?); pass {setting('output_dir', run)} for this one, or "
                         f"{setting('output_dir', named)} for that one")


def _is_run_folder_part(name: str) -> bool:
    """A run's checkpoint-<N>/ or final/ folder, where a run's record sits."""
    return name == "final" or (name.startswith("checkpoint-") and name.removeprefix("checkpoint-").isdigit())


def _local_paths(settings: dict):
    """(field, path) of each input path of a config's settings: INPUT_PATH_FIELDS' and reward functions' files."""
    for name in INPUT_PATH_FIELDS:
        if isinstance(settings.get(name), str):
            yield name, settings[name]
    for name in REWARD_FUNCTION_FIELDS:
        for spec in settings.get(name) or []:
            file = function_file(spec, name) if isinstance(spec, str) else None
            if file is not None:
                yield name, str(file)


def add_config_file_argument(parser: argparse.ArgumentParser, config_name: str) -> None:
    """--config, given at most once (a second one would replace the first silently)."""
    parser.add_argument("--config", type=Path, action=_GivenOnce,
                        help=f"YAML file of {config_name} fields; relative paths in it start from the current "
                             "folder, as a flag's do")


class _GivenOnce(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"argument {option_string}: given twice ({getattr(namespace, self.dest)}, {values}); one "
                         "config file per run")
        setattr(namespace, self.dest, values)


def read_yaml(path: str | Path) -> dict:
    """The {field: value} mapping of a YAML config file, or a JSON one (a .json file: JSON is YAML but for the tabs
    that editors indent it with); an empty file is {}. A missing file, bad YAML or a key given twice (YAML would keep
    the last silently) is a one-line ValueError with the file and line."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is no key
    except FileNotFoundError:
        raise ValueError(f"config: no such file {path}") from None
    except IsADirectoryError:
        raise ValueError(f"config: {path} is a folder, not a YAML file{_run_record_note(path)}") from None
    except OSError as err:
        raise ValueError(f"config: cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"config: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    data = (_parse_json if path.suffix.lower() == ".json" else _parse_yaml)(text, path)
    if not isinstance(data, dict):
        raise ValueError(f"config: {path}: expected a mapping of field: value, got {_kind(data)}")
    return data


# YAML 1.1 (PyYAML's) reads what a config's author meant otherwise: `seed: 010` as octal (8), `save_minutes: 1:30` in
# base 60 (90), `prompt_column: no` / `export: on` as booleans. Read them as YAML 1.2 does: 010 is 10 (as `--seed 010`
# is), 1:30 is text (refused where a number is expected), only true / false are booleans (a bool field takes yes / no
# / on / off too: coercion.BOOL_WORDS)
_BOOL_TAG = "tag:yaml.org,2002:bool"
_OCTAL_LOOKING = re.compile(r"[-+]?0[0-7]+")


@functools.cache
def _yaml_1_2_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_yaml_int(self, node):
            text = self.construct_scalar(node)
            digits = text.replace("_", "")
            if ":" in digits:
                return text
            return int(digits, 10) if _OCTAL_LOOKING.fullmatch(digits) else super().construct_yaml_int(node)

        def construct_yaml_float(self, node):
            text = self.construct_scalar(node)
            return text if ":" in text else super().construct_yaml_float(node)

    Loader.yaml_implicit_resolvers = {first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
                                      for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
    Loader.add_constructor("tag:yaml.org,2002:float", Loader.construct_yaml_float)
    return Loader


def _parse_yaml(text: str, path: Path):
    import yaml

    class UniqueKeys(_yaml_1_2_loader()):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)  # a [a, b] key whole, not yet []
                where = f"config: {path}:{key_node.start_mark.line + 1}"
                if not isinstance(key, str):  # `1:`, `yes:` (YAML 1.1's true), `[a, b]:`: no field's name
                    raise ValueError(f"{where}: key {key!r} is no field name (expected text)")
                if key in seen:
                    raise ValueError(f"{where}: {key!r} is given twice")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    try:
        return yaml.load(text, Loader=UniqueKeys) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"config: {where}: malformed YAML ({problem})") from None


def _kind(data) -> str:
    """What a file holds instead of a mapping, as its author wrote it: 'a list', 'null' (a JSON file), 'text'."""
    kinds = {list: "a list", str: "text", bool: "true or false", int: "a number", float: "a number"}
    return kinds.get(type(data), "null" if data is None else type(data).__name__)


def _parse_json(text: str, path: Path):
    def unique_keys(pairs: list) -> dict:
        keys = [key for key, _ in pairs]
        for key in keys:
            if keys.count(key) > 1:
                raise ValueError(f"config: {path}: {key!r} is given twice")
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique_keys) if text.strip() else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"config: {path}:{err.lineno}:{err.colno}: malformed JSON ({err.msg})") from None


def _run_record_note(folder: Path) -> str:
    """' (the run's settings are in <folder>/checkpoint-<newest>/run_config.json)' for a run's output_dir, the file
    a --config of the run's folder likely meant; '' for another folder."""
    steps = {int(p.parent.name.removeprefix("checkpoint-")): p for p in folder.glob(f"checkpoint-*/{RUN_RECORD}")
             if p.parent.name.removeprefix("checkpoint-").isdigit()}
    return f" (the run's settings are in {steps[max(steps)]})" if steps else ""
