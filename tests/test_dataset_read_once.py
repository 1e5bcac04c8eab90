"""A run whose --eval-dataset names its --dataset reads that name once: a data file is parsed once, a folder or a Hub
dataset resolved and prepared by datasets once (each a Hub round trip, with retries where the Hub is slow or cannot be
reached), and each split taken from what was read, as datasets.load_dataset(name, split=...) gives it (kept in memory
where it keeps it). What one run keeps is told apart by all that shapes it (the name, a config, the text columns):
each read gives what it gives alone; a read that failed is not kept."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastgrpo.train.dataset_rows import DatasetReads, load_rows
from tests.test_dataset_source import (  # noqa: F401 - fixtures, found by name
    RUN_FLAGS, _cache_as_hub_dataset, _counted, _run, hub, hub_at, project, refusing_hub,
)

datasets = pytest.importorskip("datasets")

ROWS = [{"prompt": f"what is {i} plus 1", "answer": str(i + 1)} for i in range(4)]
COMMANDS = ["train", "sft", "ei"]


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _run_on(command: str, dataset: str, eval_flags: list[str], capsys) -> None:
    """One short run of `command` on `dataset`, evaluating at its step on eval_flags' rows."""
    code, err, _ = _run([command, "--dataset", dataset, *eval_flags, "--eval-steps", "1", "--eval-max-examples", "1",
                         "--output-dir", "out", "--no-export", "--no-progress-bar", "--logging-steps", "0",
                         *RUN_FLAGS[command]], capsys)
    assert code == 0, err
    assert (Path("out") / "eval" / "step-1_summary.json").is_file()  # it evaluated


def _resolutions(monkeypatch) -> list:
    """The names datasets resolves from now on, each as a builder's module: one per load_dataset (load_dataset_builder)
    of a folder (its data files listed and hashed) or a Hub dataset (a Hub round trip, or its cache looked up)."""
    return _counted(monkeypatch, datasets.load, "dataset_module_factory")


def _file_reads(monkeypatch, file: Path) -> list:
    """The reads of `file`'s bytes from now on (sources.read_json_rows parses what it reads)."""
    reads, original, file = [], Path.read_bytes, file.resolve()

    def counting(path):
        if path.resolve() == file:
            reads.append(path)
        return original(path)

    monkeypatch.setattr(Path, "read_bytes", counting)
    return reads


@pytest.mark.parametrize("command", COMMANDS)
def test_a_data_file_named_by_both_is_parsed_once(command, project, refusing_hub, monkeypatch, capsys):
    data = _write_rows(project / "data" / "rows.jsonl", ROWS)
    reads = _file_reads(monkeypatch, data)
    _run_on(command, "data/rows.jsonl", ["--eval-dataset", "data/rows.jsonl", "--eval-dataset-split", "train[:2]"],
            capsys)
    assert len(reads) == 1, reads


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_named_by_both_is_resolved_once(command, project, refusing_hub, monkeypatch, capsys):
    _write_rows(project / "folder" / "train.jsonl", ROWS)
    _write_rows(project / "folder" / "test.jsonl", ROWS[:1])
    resolved = _resolutions(monkeypatch)
    _run_on(command, "folder", ["--eval-dataset", "folder"], capsys)  # its train split, and test to evaluate on
    assert resolved == ["folder"], resolved


def test_a_hub_dataset_named_by_both_is_asked_of_the_hub_and_resolved_once(project, hub, monkeypatch, capsys):
    import fastgrpo.train.dataset_source as dataset_source

    _cache_as_hub_dataset(project / "datasets_cache", "owner/my_rows", _write_rows(project / "rows.jsonl", ROWS))
    asked = _counted(monkeypatch, dataset_source, "ask_hub")
    resolved = _resolutions(monkeypatch)
    _run_on("train", "owner/my_rows", ["--eval-dataset", "owner/my_rows", "--eval-dataset-split", "train[2:]"],
            capsys)
    assert (asked, resolved) == (["owner/my_rows"], ["owner/my_rows"])


SPLIT_NAMES = ["train", "test", "validation", "bogus"]  # validation: a split with no row
BOUNDS = st.one_of(st.none(), st.integers(-7, 7).map(str), st.integers(-120, 120).map(lambda p: f"{p}%"))
SLICED = st.builds(lambda name, start, stop: f"{name}[{start or ''}:{stop or ''}]", st.sampled_from(SPLIT_NAMES),
                   BOUNDS, BOUNDS)
SPEC_PART = st.one_of(st.sampled_from(SPLIT_NAMES), SLICED)
SPECS = st.one_of(st.lists(SPEC_PART, min_size=1, max_size=2).map("+".join),
                  st.sampled_from(["all", "train[:", "train[1:2:3]", "tr ain", "train[abc]", "train[-0%:]"]))


@pytest.fixture(scope="module")
def folder_of_splits(tmp_path_factory) -> Path:
    """A folder of data files: train (5 rows), test (2) and validation, whose file has no row."""
    folder = tmp_path_factory.mktemp("splits") / "rows"
    _write_rows(folder / "train.jsonl", [{"prompt": f"train {i}"} for i in range(5)])
    _write_rows(folder / "test.jsonl", [{"prompt": f"test {i}"} for i in range(2)])
    _write_rows(folder / "validation.jsonl", [])
    return folder


@pytest.fixture(scope="module")
def one_read() -> DatasetReads:
    """One run's reads, across a property test's examples: the first reads, the others take their splits from it."""
    return DatasetReads()


def _loaded(read) -> list[dict] | tuple[type, str]:
    """datasets.load_dataset's rows, or the error it raised."""
    try:
        return [dict(row) for row in read()]
    except Exception as err:  # noqa: BLE001 - whichever datasets raises
        return type(err), str(err)


def _loaded_rows(read) -> list[dict] | tuple[type, str]:
    """load_rows' rows, or the error of datasets its one-line ValueError says (its cause)."""
    try:
        return [dict(row) for row in read()]
    except ValueError as err:
        assert err.__cause__ is not None, err
        return type(err.__cause__), str(err.__cause__)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=SPECS)
def test_each_split_taken_from_one_read_is_what_load_dataset_gives(folder_of_splits, one_read, spec):
    # against datasets.load_dataset(folder, split=spec), which resolves the folder anew: the same rows in the same
    # order, or the same error
    expected = _loaded(lambda: datasets.load_dataset(str(folder_of_splits), split=spec))
    assert _loaded_rows(lambda: load_rows(str(folder_of_splits), spec, reads=one_read)) == expected, spec


def test_half_a_save_to_disk_folder_is_refused_as_load_dataset_refuses_it(tmp_path):
    # its state.json without dataset_info.json: no saved Dataset (sources.saved_to_disk), and load_dataset refuses it
    # at once ("use load_from_disk") where its builder would read state.json as a data file
    folder = tmp_path / "saved"
    _write_rows(folder / "rows.jsonl", ROWS)
    (folder / "state.json").write_text("{}")
    expected = _loaded(lambda: datasets.load_dataset(str(folder), split="train"))
    assert _loaded_rows(lambda: load_rows(str(folder))) == expected
    assert "load_from_disk" in expected[1], expected


def test_each_reader_of_a_data_file_gets_its_own_list_of_its_rows(tmp_path):
    data = _write_rows(tmp_path / "rows.jsonl", ROWS)
    reads = DatasetReads()
    first = load_rows(str(data), reads=reads)
    first.pop()
    assert load_rows(str(data), reads=reads) == ROWS


CONFIGS_README = """---
configs:
- config_name: main
  data_files: main/*.jsonl
- config_name: socratic
  data_files: socratic/*.jsonl
---
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[tuple[str, dict]]:
    """load_rows' calls that one run's settings may make, of sources told apart by what a DatasetReads key holds: a
    CSV file and a folder of them read with other text columns (an answer "0123", or the int the csv builder makes
    of it), two saved Datasets, two configs of one folder, a name that is no file."""
    root = tmp_path_factory.mktemp("sources")
    _write_rows(root / "rows.jsonl", ROWS)
    table = "prompt,answer\nwhat is 0122 plus 1,0123\n"
    (root / "table.csv").write_text(table)
    (root / "tables").mkdir()
    (root / "tables" / "train.csv").write_text(table)
    (root / "tables" / "test.csv").write_text("prompt,answer\nwhat is 0009 plus 1,0010\n")
    for name, rows in (("saved_a", ROWS[:2]), ("saved_b", ROWS[2:])):
        datasets.Dataset.from_list(rows).save_to_disk(str(root / name))
    for config, rows in (("main", ROWS[:1]), ("socratic", ROWS[1:])):
        _write_rows(root / "configs" / config / "train.jsonl", rows)
    (root / "configs" / "README.md").write_text(CONFIGS_README)
    prompt, both = dict(text_columns=("prompt",)), dict(text_columns=("prompt", "answer"))
    return [(str(root / "rows.jsonl"), {}), (str(root / "table.csv"), prompt), (str(root / "table.csv"), both),
            (str(root / "tables"), dict(split="test", **prompt)), (str(root / "tables"), both),
            (str(root / "saved_a"), {}), (str(root / "saved_b"), {}),
            (str(root / "configs"), dict(config_name="main")), (str(root / "configs"), dict(config_name="socratic")),
            (str(root / "missing" / "rows.jsonl"), {})]


def _rows_or_error(dataset: str, options: dict, reads: DatasetReads) -> list[dict] | str:
    try:
        return [dict(row) for row in load_rows(dataset, reads=reads, **options)]
    except ValueError as err:
        return str(err)


@pytest.mark.parametrize("order", [1, -1], ids=["in-order", "reversed"])
def test_one_runs_reads_give_each_read_what_it_gives_alone(sources, order):
    # whichever read came first, each gets the rows (or the error) it gets with a DatasetReads of its own
    alone = [_rows_or_error(dataset, options, DatasetReads()) for dataset, options in sources]
    shared = DatasetReads()
    together = [_rows_or_error(dataset, options, shared) for dataset, options in sources[::order]][::order]
    assert together == alone
    assert alone[1] != alone[2] and alone[5] != alone[6] and alone[7] != alone[8], alone  # told apart indeed
    assert alone[-1].startswith("dataset: "), alone[-1]


def test_a_read_that_failed_is_not_kept():
    reads, calls = DatasetReads(), []

    def failing():
        calls.append("read")
        raise ValueError("eval_dataset: no such file")

    for _ in range(2):
        with pytest.raises(ValueError, match="^eval_dataset: no such file$"):
            reads.once(("json", "rows.jsonl"), failing)
    assert calls == ["read", "read"]
    assert reads.once(("json", "rows.jsonl"), lambda: "rows") == "rows"


@pytest.mark.parametrize("in_memory_max_size", [0, 1 << 30], ids=["mapped", "in-memory"])
def test_a_split_is_kept_in_memory_where_load_dataset_keeps_it(folder_of_splits, monkeypatch, in_memory_max_size):
    # datasets.config.IN_MEMORY_MAX_SIZE (0 by default: every dataset mapped from its cache files)
    monkeypatch.setattr(datasets.config, "IN_MEMORY_MAX_SIZE", in_memory_max_size)
    expected = datasets.load_dataset(str(folder_of_splits), split="train")
    got = load_rows(str(folder_of_splits), "train")
    assert (bool(got.cache_files), bool(expected.cache_files)) == (in_memory_max_size == 0,) * 2
