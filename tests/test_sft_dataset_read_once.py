"""`fastgrpo sft` reads a CSV / TSV file (or a folder of them) that --dataset and --eval-dataset both name once, as
train and ei do (tests/test_dataset_read_once.py): its eval rows read the columns its training reads as written
(the prompt's, the response's, TRL's completion and text), so both settings' reads are one. Before, its evaluation
read the prompt column alone as written: the csv builder parsed the file a second time, with other options, and an
evaluation's reference response "0123" was the int 123 its training had as the text "0123"."""
from __future__ import annotations

from pathlib import Path

import pytest

from fastgrpo.train.dataset_rows import DatasetReads
from fastgrpo.train.default_task import build_tokenizer
from fastgrpo.train.loading import eval_rows, load_dataset
from fastgrpo.train.sft_config import SFTConfig
from tests.test_dataset_source import (  # noqa: F401 - fixtures, found by name
    RUN_FLAGS, _run, hub_at, project, refusing_hub,
)

datasets = pytest.importorskip("datasets")
pandas = pytest.importorskip("pandas")

# the response column (RUN_FLAGS' --response-column answer) holds digits, which the csv builder makes ints; score is
# no column sft reads as text: its type is the one the builder infers, whichever setting reads it
TRAIN_TABLE = "prompt,answer,score\n" + "".join(f"{i:04d} plus 1,{i + 1:04d},{i}\n" for i in range(4))
TEST_TABLE = "prompt,answer,score\n0009 plus 1,0010,9\n"
SOURCES = {  # a data source named by both settings: (its files, the eval split read of it)
    "csv": ({"rows.csv": TRAIN_TABLE}, "train[:2]"),
    "tsv": ({"rows.tsv": TRAIN_TABLE.replace(",", "\t")}, "train[2:]"),
    "folder": ({"tables/train.csv": TRAIN_TABLE, "tables/test.csv": TEST_TABLE}, "test"),
}


def _write(root: Path, files: dict[str, str]) -> str:
    """The files under root; the name that --dataset gives for them (a file, or their folder)."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(Path(next(iter(files))).parent) if len(files) > 1 else next(iter(files))


def _parses(monkeypatch) -> list[str]:
    """The name of each file the csv builder parses from now on (it calls pandas.read_csv on the open file)."""
    parsed, original = [], pandas.read_csv

    def counting(file, *args, **kwargs):
        parsed.append(Path(getattr(file, "name", str(file))).name)
        return original(file, *args, **kwargs)

    monkeypatch.setattr(pandas, "read_csv", counting)
    return parsed


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("command", ["sft", "ei"])  # ei: its prompt column alone read as written, by both settings
def test_a_table_named_by_both_settings_is_parsed_once(command, source, project, refusing_hub, monkeypatch, capsys):
    files, eval_split = SOURCES[source]
    dataset = _write(project, files)
    parsed = _parses(monkeypatch)
    code, err, _ = _run([command, "--dataset", dataset, "--eval-dataset", dataset, "--eval-dataset-split", eval_split,
                         "--eval-steps", "1", "--eval-max-examples", "1", "--output-dir", "out", "--no-export",
                         "--no-progress-bar", "--logging-steps", "0", *RUN_FLAGS[command]], capsys)
    assert code == 0, err
    assert (Path("out") / "eval" / "step-1_summary.json").is_file()  # it evaluated
    assert sorted(parsed) == sorted(Path(name).name for name in files), parsed  # each file once


def _config(dataset: str, eval_split: str) -> SFTConfig:
    return SFTConfig(dataset=dataset, eval_dataset=dataset, eval_dataset_split=eval_split, eval_steps=1,
                     response_column="answer", output_dir="out")


def _train_rows(config: SFTConfig, reads: DatasetReads) -> list[dict]:
    return [dict(row) for row in load_dataset(config, tokenizer=build_tokenizer(), reads=reads)]


def _eval_rows(config: SFTConfig, reads: DatasetReads) -> list[dict]:
    return [dict(row) for row in eval_rows(config, reads)]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("eval_first", [True, False], ids=["eval-first", "train-first"])
def test_each_setting_gets_the_rows_it_gets_alone(source, eval_first, tmp_path, monkeypatch):
    files, eval_split = SOURCES[source]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
    config = _config(_write(tmp_path, files), eval_split)
    alone = _train_rows(config, DatasetReads()), _eval_rows(config, DatasetReads())
    shared = DatasetReads()
    if eval_first:
        evaluated = _eval_rows(config, shared)
        together = _train_rows(config, shared), evaluated
    else:
        together = _train_rows(config, shared), _eval_rows(config, shared)
    assert together == alone
    trained, evaluated = alone
    # the response as written in both (the reference an evaluation's rewards get is the text trained on); the
    # score column as the csv builder infers it
    assert (trained[0]["answer"], trained[0]["score"]) == ("0001", 0), trained[0]
    assert evaluated[0]["answer"] in {"0001", "0003", "0010"}, evaluated[0]
    assert all(type(row["score"]) is int for row in trained + evaluated), (trained, evaluated)
