"""One data file as `--dataset` / `--eval-dataset`, in the formats datasets.load_dataset(builder, data_files=...)
reads: what a user of TRL / HF brings."""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from fastgrpo.train.loading import load_rows
from fastgrpo.train.sources import DATA_FILE_FORMS

# text answers: a CSV column of numbers is read as numbers (datasets' csv builder infers types), as TRL's users get
ROWS = [{"prompt": "what is 1 plus 1", "answer": "two"}, {"prompt": "what is 2 plus 2", "answer": "four"}]


def as_list(rows) -> list[dict]:
    return [dict(rows[i]) for i in range(len(rows))]


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".tsv"])
def test_a_table_file_loads(tmp_path, suffix):
    # refused with "expected a .jsonl or .json file", while the folder holding the same file loaded
    datasets = pytest.importorskip("datasets")
    path = tmp_path / f"data{suffix}"
    table = datasets.Dataset.from_list(ROWS)
    if suffix == ".parquet":
        table.to_parquet(str(path))
    else:
        table.to_csv(str(path), index=False, sep="\t" if suffix == ".tsv" else ",")
    assert as_list(load_rows(str(path))) == ROWS
    # one file is its only split, read whole under eval_dataset_split's default too
    assert as_list(load_rows(str(path), "test", field="eval_dataset", default_split="test")) == ROWS


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".json.gz"])
def test_a_gzipped_json_file_loads(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    text = json.dumps(ROWS) if suffix == ".json.gz" else "".join(json.dumps(row) + "\n" for row in ROWS)
    path.write_bytes(gzip.compress(text.encode()))
    assert load_rows(str(path)) == ROWS


def test_a_bad_row_of_a_gzipped_jsonl_file_is_named_by_its_line(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n{"prompt": \n'))
    with pytest.raises(ValueError, match=r"data\.jsonl\.gz:2: invalid JSON in dataset "):
        load_rows(str(path))


def test_a_file_of_another_kind_is_refused_naming_the_forms_taken(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("what is 1 plus 1\n")
    with pytest.raises(ValueError) as err:
        load_rows(str(path))
    assert str(err.value) == (f"dataset: expected a .jsonl, .json, .parquet, .csv or .tsv file (.jsonl.gz, .csv.gz "
                              f"too), a folder of them or a Hugging Face dataset name; got {path}")


@pytest.mark.parametrize("name", ["data.parquet", "data.csv", "data.jsonl.gz"])
def test_a_missing_data_file_in_the_current_folder_is_no_such_file(tmp_path, monkeypatch, name):
    # a bare name with a data file's suffix is the user's file, not a Hub dataset to retry for half a minute
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        load_rows(name, field="eval_dataset")
    assert str(err.value) == (f"eval_dataset: no such file or folder {name} (resolved: {Path.cwd() / name}); "
                              f"eval_dataset takes a {DATA_FILE_FORMS}")


def test_a_table_file_datasets_cannot_read_is_one_line_naming_it(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "data.parquet"
    path.write_bytes(b"not a parquet file")
    with pytest.raises(ValueError) as err:
        load_rows(str(path))
    message = str(err.value)
    assert message.startswith(f"dataset: datasets.load_dataset could not read the file {path}: ")
    assert "\n" not in message


def test_a_spark_style_folder_named_like_a_file_loads_as_a_folder(tmp_path):
    # Spark writes data.parquet/ as a folder of part files
    datasets = pytest.importorskip("datasets")
    (tmp_path / "data.parquet").mkdir()
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "data.parquet" / "part-0.parquet"))
    assert as_list(load_rows(str(tmp_path / "data.parquet"))) == ROWS


def test_a_split_the_folder_lacks_names_the_split_setting_and_the_splits(tmp_path):
    # "datasets.load_dataset could not read the folder ...: ValueError: Unknown split ...", naming no setting
    pytest.importorskip("datasets")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    with pytest.raises(ValueError) as err:
        load_rows(str(tmp_path), "validation")
    assert str(err.value) == (f"dataset_split: no 'validation' split in {tmp_path}; its splits: ['train'] (pass "
                              "dataset_split='train')")
    with pytest.raises(ValueError) as err:  # an evaluation's split is eval_dataset_split
        load_rows(str(tmp_path), "test", field="eval_dataset")
    assert str(err.value) == (f"eval_dataset_split: no 'test' split in {tmp_path}; its splits: ['train'] (pass "
                              "eval_dataset_split='train')")


def test_a_json_file_holding_json_lines_loads(tmp_path):
    # datasets' Dataset.to_json("data.json") writes one object per line, which load_dataset("json") reads; it was
    # refused as "data.json:2: invalid JSON in dataset (Extra data, column 1)"
    path = tmp_path / "data.json"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert load_rows(str(path)) == ROWS
    path.write_text(json.dumps(ROWS[0]) + "\n{\n")  # a bad line of it is still named
    with pytest.raises(ValueError, match=r"data\.json:2: invalid JSON in dataset "):
        load_rows(str(path))


def test_a_name_neither_here_nor_on_the_hub_is_one_line_naming_the_field(tmp_path, monkeypatch, capsys):
    # `--dataset mydata` (a folder's name mistyped) was datasets' "Couldn't reach 'mydata' on the Hub", exit 1, not
    # naming --dataset; HF_HUB_OFFLINE answers at once where the unreachable Hub took 26 s of datasets' retries. Now it
    # says which cache it looked in, and offers the folder meant
    datasets = pytest.importorskip("datasets")

    from fastgrpo.train.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_data").mkdir()
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    assert main(["train", "--dataset", "mydata"]) == 2
    assert capsys.readouterr().err == (
        f"fastgrpo train: error: dataset: no such file or folder mydata (resolved: {tmp_path / 'mydata'}; did you mean "
        f"my_data?), and the Hub dataset mydata is not in datasets' cache ({tmp_path / 'cache'}) while HF_HUB_OFFLINE "
        "is set\n")
