"""Settings a model cannot take are refused from its config.json (transformers.AutoConfig), before its weights load:
prompt + completion lengths (train, ei) and sft's max_seq_length against max_position_embeddings. The model folder
here has a config.json and no weights: a check left to after the load would meet the missing weights first."""
from __future__ import annotations

import pytest

from fastgrpo.train.cli import main

OVER = ("max_prompt_length + max_completion_length (24 + 16) exceeds the model's max_position_embeddings (32): lower "
        "max_completion_length to 8 or less or max_prompt_length to 16 or less")


@pytest.fixture
def config_only(tmp_path) -> str:
    """A model folder of a tiny Qwen2 config with 32 positions, and no weights."""
    from transformers import Qwen2Config

    folder = tmp_path / "model"
    Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=32).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("command, argv, message", [
    ("train", ["--max-prompt-length", "24", "--max-completion-length", "16"], OVER),
    ("ei", ["--max-prompt-length", "24", "--max-completion-length", "16"], OVER),
    ("sft", ["--max-seq-length", "64"], "max_seq_length: 64 exceeds the model's max_position_embeddings (32)"),
])
def test_lengths_over_the_models_positions_are_refused_before_its_weights_load(config_only, tmp_path, capsys,
                                                                               monkeypatch, command, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main([command, "--model", config_only, *argv]) == 2
    assert capsys.readouterr().err == f"fastgrpo {command}: error: {message}\n"


def test_lengths_within_the_positions_pass_to_the_load(config_only, tmp_path, capsys, monkeypatch):
    # the check reads the positions and lets a run that fits go on: the load then finds no tokenizer (nor weights)
    monkeypatch.chdir(tmp_path)
    assert main(["sft", "--model", config_only, "--max-seq-length", "32"]) == 2
    err = capsys.readouterr().err
    assert "max_seq_length" not in err and f"model: cannot load {config_only!r}" in err, err


@pytest.mark.parametrize("command", ["train", "ei", "eval"])
def test_a_reward_the_builtin_rows_cannot_feed_says_no_dataset_was_given(tmp_path, capsys, monkeypatch, command):
    # `--reward-funcs r1_zero_math` without --dataset: "dataset: ... lacks" read as if the user's data were at fault
    monkeypatch.chdir(tmp_path)
    assert main([command, "--reward-funcs", "r1_zero_math"]) == 2
    columns = ["prompt", "letter", "response"] if command == "eval" else ["prompt", "letter"]  # eval's: sft's rows
    assert capsys.readouterr().err == (
        f"fastgrpo {command}: error: dataset (none given: the built-in task's rows): reward function "
        f"r1_zero_math_reward needs columns ['answer'], which the dataset lacks (columns: {columns})\n")
    assert list(tmp_path.iterdir()) == []
