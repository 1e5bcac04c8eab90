"""A split named for the built-in task (no --dataset), which has none, is refused as its config is: `eval
--dataset-split 'test[:2]'` evaluated every built-in row without a word."""
import pytest

from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.loading import load_dataset


def test_a_split_of_the_built_in_task_is_one_line(tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "--dataset-split", "test[:2]", "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err == ("fastgrpo eval: error: dataset_split: 'test[:2]' names a split of dataset; the "
                                       "built-in task (no dataset) has none\n")
    assert not out.exists()
    with pytest.raises(ValueError, match=r"^dataset_split: 'train\[:2\]' names a split of dataset; the built-in"):
        load_dataset(GRPOConfig(dataset_split="train[:2]"))
    assert len(load_dataset(GRPOConfig(dataset_split="train"))) > 0  # its default: the built-in rows
