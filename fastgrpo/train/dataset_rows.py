"""The rows a dataset name holds: a local data file (sources.DATA_FILE_FORMS), a folder of them or one save_to_disk
wrote, or a Hugging Face dataset, read with the `datasets` library where it is no JSON file; what it cannot read, as
one line naming the setting and what it takes. A run reads each name once (DatasetReads), however many of its
settings name it."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastgrpo.train.dataset_source import check_dataset_source
from fastgrpo.train.naming import setting
from fastgrpo.train.sources import (DATA_FILE_FORMS, JSON_SUFFIXES, TABLE_BUILDERS, check_table_file, data_suffix,
                                    folder_options, read_json_rows, saved_to_disk, text_column_options)


class DatasetReads:
    """What a run has read of its data sources, kept for its other reads of them: each name checked (a Hub round trip
    for a Hub id), each file parsed, each folder or Hub dataset resolved (a Hub round trip, retried where the Hub is
    slow) and prepared by datasets once, where --dataset X --eval-dataset X read X twice. A read that failed is not
    kept: the next one fails as it did, naming its own setting."""

    def __init__(self):
        self._kept: dict[tuple, object] = {}

    def once(self, key: tuple, read: Callable[[], object]):
        """read()'s result, read the first time `key` (what is read, and how) is asked for."""
        if key not in self._kept:
            self._kept[key] = read()
        return self._kept[key]


def load_rows(dataset: str, split: str = "train", field: str = "dataset", config_name: str | None = None,
              default_split: str = "train", text_columns: tuple[str, ...] = (), reads: DatasetReads | None = None):
    """Rows of a local data file (sources.DATA_FILE_FORMS: JSON ones read here, tables through `datasets`), of a
    folder of them or one save_to_disk wrote, or of a Hugging Face dataset (config_name: its config, which
    `field`_config names); `field` names the config field in errors. A file (or a saved Dataset) is its only split,
    as datasets.load_dataset(builder, data_files=file) makes it "train": it is read whole under that split or the
    field's default_split (eval's "test"), or a slice of it ("train[:100]"); another split is refused rather than
    ignored. A CSV / TSV file's text_columns (the prompt's, sft's response's) are read as written: "0123", not the
    int 123 the csv builder makes of digits; its other columns keep the types it infers, as TRL's users get them.
    reads: the run's DatasetReads, where it reads other rows of `dataset` too (None: read here alone)."""
    path = Path(dataset)
    reads = reads or DatasetReads()
    if not (path.is_file() or saved_to_disk(path)):
        return _read_rows(dataset, split, field, config_name, text_columns, reads)
    _check_whole_split(path, split, field, config_name, default_split)
    rows = _read_rows(dataset, split, field, config_name, text_columns, reads)
    indices = _slice_indices(split, len(rows), default_split)
    if indices is None:
        return rows
    return [rows[i] for i in indices] if isinstance(rows, list) else rows.select(indices)


def _read_rows(dataset: str, split: str, field: str, config_name: str | None, text_columns: tuple[str, ...],
               reads: DatasetReads):
    """load_rows' reading, of `split` where `dataset` is not a file or a saved Dataset (those are read whole)."""
    path = Path(dataset)
    suffix = data_suffix(path)
    # a mistyped local path, an unreachable Hub: one line, before datasets retries
    reads.once(("source", dataset), lambda: check_dataset_source(dataset, field))
    if path.is_file():
        if suffix in JSON_SUFFIXES:  # a bad row is an error at file:line; each caller its own list of the rows
            return list(reads.once(("json", dataset), lambda: read_json_rows(path, field)))
        if not suffix:  # load_dataset would take its name for the Hub's
            raise ValueError(f"{field}: expected a {DATA_FILE_FORMS}; got {path}")
        if TABLE_BUILDERS[suffix][0] == "csv":
            check_table_file(path, field)
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{field}: reading {dataset!r} needs `pip install datasets` (a .jsonl / .json file does "
                         "not)") from None
    try:
        if path.is_file():
            builder, options = TABLE_BUILDERS[suffix]
            if builder == "csv":
                options = {**options, **text_column_options([path], text_columns)}
            return reads.once(("table", dataset, repr(options)),
                              lambda: datasets.load_dataset(builder, data_files=str(path), split="train", **options))
        if saved_to_disk(path):  # load_dataset refuses such a folder ("use load_from_disk")
            return reads.once(("saved", dataset), lambda: datasets.load_from_disk(str(path)))
        options = folder_options(path, text_columns)
        prepared = reads.once(("prepared", dataset, config_name, repr(options)),
                              lambda: _prepared(datasets, dataset, config_name, options))
        return prepared.as_dataset(split=split, in_memory=_in_memory(prepared))
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds (mixed files: DatasetGenerationError)
        if not path.is_file() and "config" in str(err).lower():  # "Config name is missing", "BuilderConfig 'x' ..."
            _check_config_name(datasets, dataset, config_name, field)
        missing = None if path.is_file() or split not in str(err) else _missing_split(datasets, dataset, split, field,
                                                                                     config_name)
        if missing is not None:  # datasets' "Unknown split", said naming the setting
            raise ValueError(missing) from err
        if not path.exists():
            # a Hub name: unreachable (ConnectionError) or no such dataset (DatasetNotFoundError, a FileNotFoundError)
            # may as well be a local name mistyped; the network's other errors are not the user's input
            if isinstance(err, (ConnectionError, FileNotFoundError)):
                reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
                raise ValueError(f"{field}: no such file or folder {dataset}, and datasets could not load it from the "
                                 f"Hub: {reason}") from err
            raise
        cause = err.__cause__ or err  # a local file or folder: what datasets cannot read there is its fault
        what = f"the file {path}" if path.is_file() else f"the folder {path} ({split!r} split)"
        raise ValueError(f"{field}: datasets.load_dataset could not read {what}: "
                         f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}") from err


def _prepared(datasets, dataset: str, config_name: str | None, options: dict):
    """What datasets.load_dataset(dataset, config_name, split=..., **options) builds before it takes the split: the
    dataset's builder, resolved and prepared (every split, whichever is asked for), whose as_dataset gives each split
    as load_dataset does; a run takes all the splits it reads of `dataset` from it."""
    if Path(dataset, "state.json").exists():  # half of a save_to_disk folder: load_dataset's refusal, at once
        datasets.load_dataset(dataset, config_name, **options)
    builder = datasets.load_dataset_builder(dataset, config_name, **options)
    builder.download_and_prepare()
    return builder


def _in_memory(builder) -> bool:
    """load_dataset's keep_in_memory default: a dataset under datasets.config.IN_MEMORY_MAX_SIZE (0: none) is copied
    into memory, a larger one mapped from its cache files."""
    from datasets.utils.info_utils import is_small_dataset

    return is_small_dataset(builder.info.dataset_size)


def _check_whole_split(path: Path, split: str, field: str, config_name: str | None, default_split: str) -> None:
    """For a file or a saved Dataset, read whole: a config or a split named that it does not have, which would be
    ignored (a user's `--dataset-split test` got the training rows)."""
    what = "one file" if path.is_file() else "a folder save_to_disk wrote, of one split"
    if config_name is not None:
        raise ValueError(f"{field}_config: names a config of an HF dataset (or of a folder whose README.md lists "
                         f"configs); {path} is {what}")
    try:
        _slice_indices(split, 0, default_split)
    except ValueError:
        raise ValueError(f"{field}_split: {split!r} names a split of an HF dataset or a folder of data files; {path} "
                         f"is {what}, read whole: give the file of those rows, or leave {setting(f'{field}_split')} "
                         f"at {default_split!r} (or slice it: '{default_split}[:100]')") from None


def _slice_indices(split: str, count: int, default_split: str) -> list[int] | None:
    """The rows of a file's (or saved Dataset's) `count` that `split` picks: None for all of them (its one split,
    which datasets names "train", or the field's default_split); a slice of it ("train[:100]", "test[10%:]") as
    datasets.ReadInstruction reads one for a Hub dataset. A ValueError for any other split."""
    if split in ("train", default_split):
        return None
    if "[" not in split:
        raise ValueError(split)
    try:
        from datasets import ReadInstruction
        parts = ReadInstruction.from_spec(split).to_absolute({"train": count, default_split: count})
    except (ImportError, AssertionError) as err:  # no datasets; a spec it cannot read
        raise ValueError(split) from err
    return [i for part in parts for i in range(part.from_, part.to)]


def _check_config_name(datasets, dataset: str, config_name: str | None, field: str) -> None:
    """For a load that failed naming a config: the line saying which configs the dataset has, where config_name is
    none of them (or is None and it has several); nothing where they cannot be read (the load's error then shows)."""
    try:
        names = datasets.get_dataset_config_names(dataset)
    except Exception:  # noqa: BLE001 - whatever it is, the load's error is the one to show
        return
    if config_name is None and len(names) > 1:
        raise ValueError(f"{field}_config: {dataset} has several configs, {names}: name one "
                         f"({setting(f'{field}_config', names[0])})")
    if config_name is not None and names and config_name not in names:
        raise ValueError(f"{field}_config: no config {config_name!r} in {dataset}; its configs: {names}")


def _missing_split(datasets, dataset: str, split: str, field: str, config_name: str | None) -> str | None:
    """For a load that failed naming `split`: the line saying the dataset (its config config_name) has no such split
    and which it has; None where it has it or its splits cannot be read (the load's own error then shows)."""
    try:
        names = datasets.get_dataset_split_names(dataset, config_name)
    except Exception:  # noqa: BLE001 - whatever it is, the load's error is the one to show
        return None
    if split in names or not names:
        return None
    where = f"{dataset} (config {config_name!r})" if config_name is not None else dataset
    return (f"{field}_split: no {split!r} split in {where}; its splits: {names} (pass "
            f"{setting(f'{field}_split', names[0])})")
