"""Reading a YAML config file (`--config`) into a {field: value} mapping, every problem one line naming the file."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_config_file_argument(parser: argparse.ArgumentParser, config_name: str) -> None:
    """--config, given at most once (a second one would replace the first silently)."""
    parser.add_argument("--config", type=Path, action=_GivenOnce, help=f"YAML file of {config_name} fields")


class _GivenOnce(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"argument {option_string}: given twice ({getattr(namespace, self.dest)}, {values}); one "
                         "config file per run")
        setattr(namespace, self.dest, values)


def read_yaml(path: str | Path) -> dict:
    """The {field: value} mapping of a YAML config file (an empty file is {}); a missing file, bad YAML or a key
    given twice (YAML would keep the last silently) is a one-line ValueError with the file and line."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    mark = key_node.start_mark
                    raise ValueError(f"config: {path}:{mark.line + 1}: {key!r} is given twice")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is no key
    except FileNotFoundError:
        raise ValueError(f"config: no such file {path}") from None
    except OSError as err:
        raise ValueError(f"config: cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"config: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    try:
        data = yaml.load(text, Loader=UniqueKeys) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"config: {where}: malformed YAML ({problem})") from None
    if not isinstance(data, dict):
        raise ValueError(f"config: expected a YAML mapping of field: value in {path}, got {type(data).__name__}")
    return data
