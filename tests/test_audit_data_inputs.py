"""A user's own data and reward functions, as `fastgrpo train / sft / ei / eval` take them."""
from __future__ import annotations

import pytest

from fastgrpo.rewards.scoring import score
from fastgrpo.train.loading import load_rows


def test_a_folder_written_by_save_to_disk_loads(tmp_path):
    # datasets.load_dataset refuses such a folder ("use load_from_disk"), which a command-line user cannot call
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "what is 1 plus 1", "answer": "2"}, {"prompt": "what is 2 plus 2", "answer": "4"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    loaded = load_rows(str(tmp_path / "saved"))
    assert [dict(loaded[i]) for i in range(len(loaded))] == rows


def test_a_reward_function_returning_none_is_named_as_returning_it():
    # it raised nothing: "raised TypeError: 'NoneType' object is not iterable" sent the user looking for an exception
    def forgot_return(prompts, completions, **columns):
        [len(c) for c in completions]

    rewards, failures = score([forgot_return], ["p", "p"], ["a", "b"], {})
    assert failures["forgot_return"] == "returned None, expected a list of 2 rewards (one per completion)"
    assert rewards.tolist() == [[0.0], [0.0]]


def test_a_reward_function_returning_one_number_is_named_as_returning_it():
    rewards, failures = score([lambda prompts, completions, **columns: 1.0], ["p", "p"], ["a", "b"], {})
    assert failures["<lambda>"] == "returned 1.0, expected a list of 2 rewards (one per completion)"
