"""eval_dataset_split: the split a run's periodic evaluation reads (TRL's scripts' dataset_test_split). It was fixed
at 'test', so a folder of data files (which loads as the one split 'train') could not be an --eval-dataset."""
import json

import pytest

from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig, config_changes
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.loading import eval_rows
from fastgrpo.train.sft_config import SFTConfig

pytest.importorskip("datasets")


def _folder(path):
    path.mkdir()
    (path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i} say a"}) + "\n" for i in range(4)))
    return path


@pytest.mark.parametrize("config_class", [GRPOConfig, SFTConfig, EIConfig])
def test_a_folder_of_data_files_is_evaluated_on_its_train_split(tmp_path, config_class):
    folder = _folder(tmp_path / "eval")
    config = config_class(eval_dataset=str(folder), eval_dataset_split="train", eval_steps=1)
    assert [row["prompt"] for row in eval_rows(config)] == [f"{i} say a" for i in range(4)]


def test_the_default_split_is_test_and_a_missing_one_names_the_setting(tmp_path):
    folder = _folder(tmp_path / "eval")
    config = GRPOConfig(eval_dataset=str(folder), eval_steps=1)
    assert config.eval_dataset_split == "test"
    with pytest.raises(ValueError) as err:
        eval_rows(config)
    assert str(err.value) == (f"eval_dataset_split: no 'test' split in {folder}; its splits: ['train'] (pass "
                              "eval_dataset_split='train')")


def test_it_is_recorded_and_free_to_change_on_resume():
    saved = GRPOConfig(eval_dataset_split="validation").to_dict()
    assert saved["eval_dataset_split"] == "validation"
    assert config_changes(saved, GRPOConfig(eval_dataset_split="test")) == []


def test_train_evaluates_on_a_folder_given_its_split(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = _folder(tmp_path / "eval")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{i} say b"}) + "\n" for i in range(8)))
    assert main(["train", "--output-dir", "run", "--batch-size", "8", "--num-generations", "4", "--dataset",
                 "data.jsonl", "--max-steps", "1", "--eval-steps", "1", "--eval-dataset", str(folder),
                 "--eval-dataset-split", "train", "--eval-max-examples", "2"]) == 0
    assert (tmp_path / "run" / "eval" / "step-1_summary.json").is_file()


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
@pytest.mark.parametrize("field, value, kind", [("eval_dataset_split", "validation", "split"),
                                                ("eval_dataset_config", "main", "config")])
def test_a_split_or_config_of_the_built_in_tasks_rows_is_refused_before_the_run(tmp_path, capsys, command, field,
                                                                               value, kind):
    """The built-in task's held-out rows have neither: a split named was ignored (the run evaluated on them), a
    config named was refused by the trainer, but only once the model had loaded (a minute for a large one)."""
    run = tmp_path / "run"
    flag = "--" + field.replace("_", "-")
    assert main([command, "--output-dir", str(run), "--eval-steps", "1", flag, value]) == 2
    assert capsys.readouterr().err == (f"fastgrpo {command}: error: {field}: '{value}' names a {kind} of "
                                       "eval_dataset; the built-in task (no eval_dataset) has none\n")
    assert not run.exists()
