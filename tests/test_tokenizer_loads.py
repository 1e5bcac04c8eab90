"""Each command loads its model's tokenizer once (a 151K-token vocabulary: ~2 s a load) and hands it to what needs it:
the checks before the model loads (chat templates, prompt lengths, the periodic evaluation's rows), the model's load
and the trainer or evaluation. Each check loaded its own: 2-4 loads a run. The loader is counted, not replaced."""
from __future__ import annotations

import json

import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from tests.test_early_checks_tokenized import saved_chat_model

QUIET = ["--no-progress-bar", "--logging-steps", "0"]
SAMPLING = ["--reward-funcs", "fastgrpo.train.default_task:repeat_letter_reward", "--batch-size", "4",
            "--num-generations", "2", "--micro-batch-size", "4", "--max-prompt-length", "16",
            "--max-completion-length", "2"]
COMMANDS = {
    "train": [*SAMPLING, "--max-steps", "1", "--no-export", *QUIET],
    "ei": [*SAMPLING, "--ei-steps", "1", "--questions-per-step", "2", "--no-export", *QUIET],
    "sft": ["--batch-size", "4", "--micro-batch-size", "4", "--max-steps", "1", "--max-seq-length", "32",
            "--no-export", *QUIET],
    "eval": ["--reward-funcs", "fastgrpo.train.default_task:repeat_letter_reward", "--max-examples", "2",
             "--max-new-tokens", "2"],
}


@pytest.fixture
def model(tmp_path) -> str:
    return saved_chat_model(tmp_path / "model")


@pytest.fixture
def rows(tmp_path) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in default_task.build_sft_dataset(num_rows=4)))
    return str(path)


def _counted(monkeypatch, owner, name: str) -> list:
    """owner.name, still run, with each call appended to the list returned."""
    calls, real = [], getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_command_loads_its_models_tokenizer_once(monkeypatch, tmp_path, model, rows, command):
    from transformers import AutoTokenizer

    loads = _counted(monkeypatch, AutoTokenizer, "from_pretrained")
    # chat prompts: the dataset's check reads the template; train's periodic evaluation tokenizes its rows too
    evaluated = ["--eval-steps", "1", "--eval-dataset", rows, "--eval-max-examples", "2"] if command == "train" else []
    assert main([command, "--model", model, "--dataset", rows, "--prompt-format", "chat", *COMMANDS[command],
                 *evaluated, "--output-dir", str(tmp_path / "run")]) == 0
    assert len(loads) == 1


def test_the_builtin_models_tokenizer_is_built_once(monkeypatch, tmp_path):
    builds = _counted(monkeypatch, default_task, "build_tokenizer")
    assert main(["train", "--max-steps", "1", "--no-export", "--output-dir", str(tmp_path / "run"), *QUIET]) == 0
    assert len(builds) == 1
