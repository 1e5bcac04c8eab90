"""A Hub dataset's config (its subset: `openai/gsm8k` needs `main`), TRL's dataset_config: a field, flag and YAML key
of every command that reads a --dataset, recorded and compared on --resume as the dataset is, passed to
datasets.load_dataset; a missing or wrong one is one line listing the dataset's configs. No network here: a local
folder whose README.md lists `configs:` is what `datasets` reads as a dataset of several configs."""
from __future__ import annotations

import json

import pytest

from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig, config_changes
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.loading import eval_rows, load_dataset, load_rows
from fastgrpo.train.sft_config import SFTConfig

pytest.importorskip("datasets")

README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
  - split: test
    path: main/test.jsonl
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train.jsonl
---
"""


@pytest.fixture
def gsm(tmp_path) -> str:
    """A folder of two configs, as openai/gsm8k has: main (train, test) and socratic (train)."""
    for config, split, prompt in [("main", "train", "1+1"), ("main", "test", "2+2"), ("socratic", "train", "3+3")]:
        (tmp_path / config).mkdir(exist_ok=True)
        row = {"prompt": prompt, "response": "x", "answer": "2"}
        (tmp_path / config / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "README.md").write_text(README)
    return str(tmp_path)


def _prompts(rows) -> list[str]:
    return [row["prompt"] for row in rows]


@pytest.mark.parametrize("config_class", [GRPOConfig, SFTConfig, EIConfig, EvalConfig])
def test_each_command_reads_the_named_config(gsm, config_class):
    config = config_class(dataset=gsm, dataset_config="socratic", dataset_split="train")
    assert _prompts(load_dataset(config)) == ["3+3"]
    assert config.to_dict()["dataset_config"] == "socratic"  # recorded with the run


def test_the_flag_and_the_yaml_key(gsm, tmp_path):
    from fastgrpo.train.commands import config_from_args
    from fastgrpo.train.cli import parse_command_line

    _, _, args = parse_command_line(["eval", "--dataset", gsm, "--dataset-config", "main"])
    assert config_from_args("eval", args).dataset_config == "main"
    path = tmp_path / "run.yaml"
    path.write_text(f"dataset: {gsm}\ndataset_config: main\n")
    assert GRPOConfig.from_yaml(path).dataset_config == "main"


def test_a_missing_or_wrong_config_lists_the_datasets_configs(gsm):
    with pytest.raises(ValueError) as info:
        load_rows(gsm)
    assert str(info.value) == (f"dataset_config: {gsm} has several configs, ['main', 'socratic']: name one "
                               "(dataset_config='main')")
    with pytest.raises(ValueError) as info:
        load_rows(gsm, config_name="Main")
    assert str(info.value) == f"dataset_config: no config 'Main' in {gsm}; its configs: ['main', 'socratic']"
    with pytest.raises(ValueError) as info:  # the split's line names the config whose splits it lists
        load_rows(gsm, "test", config_name="socratic")
    assert str(info.value) == (f"dataset_split: no 'test' split in {gsm} (config 'socratic'); its splits: "
                               "['train'] (pass dataset_split='train')")


def test_the_command_line_error_is_one_line_before_the_model_loads(gsm, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--dataset", gsm, "--dataset-config", "nope"]) == 2
    assert capsys.readouterr().err == (f"fastgrpo eval: error: dataset_config: no config 'nope' in {gsm}; its "
                                       "configs: ['main', 'socratic']\n")
    assert not (tmp_path / "fastgrpo_eval_output").exists()


def test_a_config_of_what_has_none_is_refused(gsm, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError) as info:
        load_rows(str(rows), config_name="main")
    assert str(info.value) == (f"dataset_config: names a config of an HF dataset (or of a folder whose README.md "
                               f"lists configs); {rows} is one file")
    with pytest.raises(ValueError) as info:
        load_dataset(GRPOConfig(dataset_config="main"))
    assert str(info.value) == "dataset_config: names a config of dataset; the built-in task (no dataset) has none"


def test_the_eval_dataset_takes_the_runs_config_when_it_is_the_runs_dataset(gsm):
    run = dict(dataset=gsm, dataset_config="main", eval_dataset=gsm, eval_steps=1)
    assert _prompts(eval_rows(GRPOConfig(**run))) == ["2+2"]  # main's test split
    with pytest.raises(ValueError, match=r"^eval_dataset_split: no 'test' split in .* \(config 'socratic'\)"):
        eval_rows(SFTConfig(**run, eval_dataset_config="socratic"))
    with pytest.raises(ValueError, match="^eval_dataset_config: .* has several configs"):
        eval_rows(EIConfig(eval_dataset=gsm, eval_steps=1))  # another dataset than the run's: its own config


def test_resume_compares_the_config_as_it_compares_the_dataset(gsm):
    saved = GRPOConfig(dataset=gsm, dataset_config="main").to_dict()
    assert config_changes(saved, GRPOConfig(dataset=gsm, dataset_config="main")) == []
    assert config_changes(saved, GRPOConfig(dataset=gsm, dataset_config="socratic")) == [
        "dataset_config: 'main' in the checkpoint, 'socratic' now"]
    older = {k: v for k, v in saved.items() if k != "dataset_config"}  # a checkpoint from before the field
    assert config_changes(older, GRPOConfig(dataset=gsm)) == []
    # the eval dataset's is run control, as the eval dataset is
    assert config_changes(saved, GRPOConfig(dataset=gsm, dataset_config="main", eval_dataset_config="main")) == []
