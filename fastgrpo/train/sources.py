"""Where a run's inputs come from, checked before anything heavy runs: the user's reward code, data files, the
model's path or hub name, the device. Each mistake is a one-line ValueError naming the field (and the file:line
for data), which the commands print as `fastgrpo <command>: error: ...` (fastgrpo.train.errors).
"""
from __future__ import annotations

import contextlib
import csv
import gzip
import importlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import torch

from fastgrpo.hf.hub import hub_model_problem
from fastgrpo.train.coercion import expanded_path
from fastgrpo.train.naming import setting


def import_function(spec: str, field: str):
    """The callable that "module:function" or "path/to/file.py:function" names.

    A module is looked up as `python -m` would: the current folder first (so `myrewards:fn` finds ./myrewards.py
    from the `fastgrpo` console script too), then sys.path. A .py path is loaded from that file, its ~ and $VAR /
    ${VAR} expanded."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"{field}: expected 'module:function' or 'path/to/file.py:function', got {spec!r}")
    file = function_file(spec, field)
    module = _module_from_file(file, field) if file is not None else _module_named(target, attr, field)
    func = getattr(module, attr, None)
    if not callable(func):
        raise ValueError(f"{field}: {file or target} has no function {attr!r}")
    return func


def function_file(spec: str, field: str) -> Path | None:
    """The file of a "path/to/file.py:function" spec, its ~ and $VAR / ${VAR} expanded (as a dataset's path is:
    coercion.PATH_FIELDS); None for a "module:function" (a module name, looked up as Python does) and for a name
    without ':' (a built-in reward)."""
    target, sep, _ = spec.rpartition(":")
    if not sep or not target:
        return None
    target = expanded_path(field, target)
    return Path(target) if target.endswith(".py") else None


def recorded_function(spec: str, field: str) -> str:
    """`spec` as a run's record keeps it (ConfigFile.to_dict): a "path/to/file.py:function" whose file exists here
    with that file absolute, as a dataset's path is, so a resume or an eval from another folder imports the file the
    run did; any other form as typed."""
    try:
        file = function_file(spec, field)
    except ValueError:  # an unset variable: importing the reward says so
        return spec
    if file is None or not file.is_file():
        return spec
    return f"{os.path.abspath(file)}:{spec.rpartition(':')[2]}"


def _module_named(target: str, attr: str, field: str):
    try:
        with _on_sys_path(os.getcwd()):
            return importlib.import_module(target)
    except ModuleNotFoundError as err:
        if err.name and (target == err.name or target.startswith(err.name + ".")):
            raise ValueError(f"{field}: no module {target!r} in the current folder or on sys.path "
                             f"(for a file, name it as path/to/file.py:{attr})") from None
        raise ValueError(f"{field}: importing {target!r} failed: {err}") from None
    except Exception as err:  # the user's module is run: any error in it is theirs to see, in one line
        raise ValueError(f"{field}: importing {target!r} failed: {type(err).__name__}: {err}") from None


def _module_from_file(path: Path, field: str):
    if not path.is_file():
        raise ValueError(f"{field}: no such file {path}")
    name = f"fastgrpo_user.{path.stem}"  # a name of its own: a file named like a real module must not shadow it
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so pickling and dataclasses find it
    try:
        with _on_sys_path(str(path.resolve().parent)):  # its sibling modules import as they would from there
            spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(f"{field}: loading {path} failed: {type(err).__name__}: {err}") from None
    return module


@contextlib.contextmanager
def _on_sys_path(folder: str):
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


# The data files a dataset field takes, by suffix (a trailing .gz: gzipped): JSON ones are read here, so that a bad
# row is named by its line; tables by the `datasets` builder named, as datasets.load_dataset(builder, data_files=...)
JSON_SUFFIXES = (".jsonl", ".json")
TABLE_BUILDERS = {".parquet": ("parquet", {}), ".csv": ("csv", {}), ".tsv": ("csv", {"sep": "\t"})}
DATA_FILE_FORMS = (".jsonl, .json, .parquet, .csv or .tsv file (.jsonl.gz, .csv.gz too), a folder of them or a Hugging "
                   "Face dataset name")


def data_suffix(path: Path) -> str:
    """A data file's format suffix, lower case, under a .gz ("data.jsonl.gz" -> ".jsonl"); "" for no known one."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    if suffixes[-1:] == [".gz"]:
        suffixes.pop()
    suffix = suffixes[-1] if suffixes else ""
    return suffix if suffix in JSON_SUFFIXES or suffix in TABLE_BUILDERS else ""


def check_table_file(path: Path, field: str = "dataset") -> None:
    """A ValueError for a CSV / TSV file (maybe gzipped) whose header line names a column twice (the csv reader
    renames the second `name.1`: a run would read the first and drop the other without a word), or that has no row
    under its header (datasets says 'Instruction "train" corresponds to no data!')."""
    lines = _table_lines(path, 2)
    if lines is None:
        return  # the csv builder's reading says what is wrong with the file
    header, first_row = (lines[0] if lines else []), (lines[1] if len(lines) > 1 else None)
    twice = next((name for i, name in enumerate(header) if name in header[:i]), None)  # as pandas: " a" is not "a"
    if twice is not None:
        raise ValueError(f"{field}: {path} names the column {twice!r} twice in its header line")
    if first_row is None:
        raise ValueError(f"{field}: expected at least one row, got an empty dataset ({path} has none under its "
                         "header line)")


def table_header(path: Path) -> list[str]:
    """The column names of a CSV / TSV file's header line (maybe gzipped); [] where it cannot be read."""
    lines = _table_lines(path, 1)
    return lines[0] if lines else []


def _table_lines(path: Path, count: int) -> list[list[str]] | None:
    """The first `count` lines of a CSV / TSV file (maybe gzipped) as the csv reader splits them; None where it
    cannot be read."""
    _, options = TABLE_BUILDERS[data_suffix(path)]
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8-sig", newline="") as file:
            lines = csv.reader(file, delimiter=options.get("sep", ","))
            return [line for _, line in zip(range(count), lines)]
    except (OSError, EOFError, UnicodeDecodeError, csv.Error):
        return None


def read_json_rows(path: str | Path, field: str = "dataset") -> list[dict]:
    """The rows of a .jsonl file (one JSON object per line; blank lines skipped) or a .json list of objects (or JSON
    lines too), either maybe gzipped (.jsonl.gz); a bad row is reported as `file:line: ...`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{field}: no such file {path}")
    data = path.read_bytes()
    if path.suffix.lower() == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as err:
            raise ValueError(f"{field}: {path} is not a readable gzip file ({err})") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not a row
    except UnicodeDecodeError as err:
        raise ValueError(f"{field}: {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    if data_suffix(path) == ".json":
        try:
            document = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":  # else one object after another: JSON lines, as datasets' to_json writes
                raise ValueError(f"{path}:{err.lineno}: invalid JSON in {setting(field)} ({err.msg}, column "
                                 f"{err.colno})") from None
        except _RepeatedKey as err:
            raise ValueError(f"{path}: {err.message(field)}") from None
        else:
            return _listed_rows(document, path, field)
    return _json_lines(text, path, field)


class _RepeatedKey(ValueError):
    """A JSON object with a key twice, which json.loads would keep the last value of."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key

    def message(self, field: str) -> str:
        return f"the key {self.key!r} twice in a row of {setting(field)} (JSON keeps the last value, losing the other)"


def _unique_keys(pairs: list[tuple]) -> dict:
    """json.loads' object_pairs_hook: the object as a dict, a _RepeatedKey for a key given twice."""
    row = dict(pairs)
    if len(row) == len(pairs):
        return row
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen.add(key)


def _listed_rows(document, path: Path, field: str) -> list[dict]:
    """The rows of a .json file's document: a list of objects."""
    if not isinstance(document, list):
        raise ValueError(f"{field}: expected a JSON list of row objects in {path}, got {type(document).__name__}")
    for i, row in enumerate(document):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {i} is {type(row).__name__}, expected a JSON object")
    return document


# JSON lines end at \n (\r\n, \r), which a JSON string cannot hold unescaped; not at str.splitlines' other ends (U+2028,
# U+0085 ...), which it holds as they are where it was written with ensure_ascii=False
_LINE_END = re.compile(r"\r\n|\r|\n")


def _json_lines(text: str, path: Path, field: str) -> list[dict]:
    """The rows of JSON lines text: one object per line, blank lines skipped."""
    rows = []
    for number, line in enumerate(_LINE_END.split(text), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: invalid JSON in {setting(field)} ({err.msg}, column "
                             f"{err.colno})") from None
        except _RepeatedKey as err:
            raise ValueError(f"{path}:{number}: {err.message(field)}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object (one row), got {type(row).__name__}")
        rows.append(row)
    return rows


def resolve_device(device: str) -> str:
    """"auto" -> cuda when torch sees a GPU, else cpu; an explicit CUDA device must exist."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {device!r}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} needs a CUDA GPU, and torch {torch.__version__} sees none; pass "
                             "--device cpu, or auto to use a GPU when there is one")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r}, but torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def resolved_dtype(dtype: str, device: str) -> str:
    """The dtype name a model loads in on `device` (a config's, "auto" too): "auto" -> bfloat16 on a GPU that has it,
    else float32."""
    if dtype != "auto":
        return dtype
    gpu = (device == "auto" or device.startswith("cuda")) and torch.cuda.is_available()
    return "bfloat16" if gpu and torch.cuda.is_bf16_supported() else "float32"


def check_model_source(model: str) -> None:
    """A model that is written as a local path must exist; another name must be a Hub repo id that is cached or
    that the Hub answers for (fastgrpo.hf.hub), else transformers answers after 20 s or more of retries. `model` is
    a config's, whose leading ~ the config has expanded (coercion.coerced_value), as the loader then reads it."""
    path = Path(model)
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {model} is not a Hugging Face model folder (no config.json in it)"
                             f"{_run_folder_hint(path)}")
        return
    looks_local = path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1 or "\\" in model
    if looks_local:
        raise ValueError(f"model: no such folder {model}")
    problem = hub_model_problem(model)
    if problem is not None:
        raise ValueError(f"model: no such folder {model}, and {problem}")


# checkpoint.STATE_FILE, which this module cannot import (checkpoint -> config_file -> sources)
_CHECKPOINT_STATE = "trainer_state.pt"


def _run_folder_hint(path: Path) -> str:
    """What --model takes instead of a folder without config.json: a run's, one of its checkpoints, or a PEFT
    adapter (TRL's LoRA output, say), in words true for every command: only `eval` has --checkpoint."""
    if (path / _CHECKPOINT_STATE).is_file():
        return " (a run's checkpoint: --model takes the run's final/; fastgrpo eval --checkpoint takes a checkpoint)"
    if (path / "final" / "config.json").is_file() or any(path.glob("checkpoint-*")):
        return " (a run's folder: --model takes its final/; fastgrpo eval --checkpoint takes the run)"
    if (path / "adapter_config.json").is_file():
        return (" (a PEFT adapter: --model takes a whole model; save the adapter's merge_and_unload() and its "
                "tokenizer to a folder)")
    return ""


def model_load_error(model: str, err: Exception) -> ValueError:
    """A one-line ValueError for a model (or tokenizer) that transformers could not load."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    first = lines[0] if lines else type(err).__name__
    where = "the local folder" if Path(model).is_dir() else "a local folder or the Hugging Face Hub"
    return ValueError(f"model: cannot load {model!r} from {where}: {first}")


@contextlib.contextmanager
def naming_the_model(model: str | None):
    """transformers' OSError for a folder without a model or an unknown hub name, as model_load_error's one line
    (the built-in model, model None, raises as it is)."""
    try:
        yield
    except OSError as err:
        if model is None:
            raise
        raise model_load_error(model, err) from err


def folder_options(path: Path, text_columns: tuple[str, ...]) -> dict:
    """load_dataset's options for a local folder whose data files are all CSV: its text_columns read as written, as a
    CSV file's are (load_rows); none for another folder or a Hub name (other builders refuse `converters`)."""
    if not path.is_dir() or saved_to_disk(path):
        return {}
    files = [file for file in path.rglob("*") if file.is_file() and data_suffix(file)]
    return text_column_options(files, text_columns) if {data_suffix(f) for f in files} == {".csv"} else {}


def text_column_options(files: list[Path], text_columns: tuple[str, ...]) -> dict:
    """The csv builder's options that read the CSV / TSV `files`' text_columns as written: pandas' converters take a
    cell's text (columns a file lacks are ignored), and its missing-value cells ("NA", "None", "null", "", ...) are
    missing only in the other columns, which keep read_csv's defaults."""
    from pandas._libs.parsers import STR_NA_VALUES  # read_csv's default missing-value cells (its documented list)

    others = {name for file in files for name in table_header(file)} - set(text_columns)
    return {"converters": dict.fromkeys(text_columns, str), "keep_default_na": False,
            "na_values": {name: sorted(STR_NA_VALUES) for name in sorted(others)}}


def saved_to_disk(path: Path) -> bool:
    """A folder Dataset.save_to_disk wrote (one dataset, no splits; a DatasetDict's folder load_dataset reads)."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
