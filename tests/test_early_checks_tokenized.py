"""train and ei tokenize every prompt once: the command hands the trainer the ids its early check (before the model
loads) made, whole, which the trainer checks and truncates as it does its own. The trainer tokenized them all again:
5,000 prompts took 1-3 s of a CPU core."""
from __future__ import annotations

import collections
import json
import logging

import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.early_checks import check_sampling_before_load
from fastgrpo.train.grpo_data import prompt_token_ids
from fastgrpo.train.loading import load_tokenizer
from fastgrpo.train.trainer import GRPOTrainer

PROMPTS = [f"{i} say a" for i in range(4)]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}:{% endfor %}"


def saved_chat_model(folder) -> str:
    """A tiny Qwen2 model of the built-in tokenizer, saved to folder with its (random) weights and a chat template."""
    tokenizer = default_task.build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    default_task.build_model(tokenizer).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def model(tmp_path) -> str:
    return saved_chat_model(tmp_path / "model")


@pytest.fixture
def tokenized(monkeypatch) -> collections.Counter:
    """How many times each text was tokenized (transformers' tokenizer call, counted)."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    counts, call = collections.Counter(), PreTrainedTokenizerBase.__call__

    def counting(self, text=None, *args, **kwargs):
        counts.update([text] if isinstance(text, str) else [])
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", counting)
    return counts


@pytest.mark.parametrize("command", ["train", "ei"])
def test_a_run_tokenizes_each_prompt_once(model, tmp_path, tokenized, command):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "letter": "a"}) + "\n" for p in PROMPTS))
    steps = ["--max-steps", "1"] if command == "train" else ["--ei-steps", "1", "--questions-per-step", "2"]
    assert main([command, "--model", model, "--dataset", str(data), "--reward-funcs",
                 "fastgrpo.train.default_task:repeat_letter_reward", "--prompt-format", "raw", "--batch-size", "4",
                 "--num-generations", "2", "--micro-batch-size", "4", "--max-prompt-length", "16",
                 "--max-completion-length", "2", *steps, "--output-dir", str(tmp_path / "run"), "--no-progress-bar",
                 "--no-export"]) == 0
    assert {p: tokenized[p] for p in PROMPTS} == dict.fromkeys(PROMPTS, 1)


def _config(**fields) -> GRPOConfig:
    return GRPOConfig(**{"prompt_format": "chat", "max_prompt_length": 16, "batch_size": 4, "num_generations": 2,
                         "micro_batch_size": 4, "max_completion_length": 2, **fields})


def _rows(prompts=PROMPTS) -> list[dict]:
    return [{"prompt": p, "letter": "a"} for p in prompts]


def test_the_early_checks_ids_are_those_the_trainer_would_tokenize(model, tokenized):
    tokenizer, config = load_tokenizer(model), _config()
    ids = check_sampling_before_load(config, _rows(), [default_task.repeat_letter_reward], tokenizer)
    assert {p: tokenized[p + ":"] for p in PROMPTS} == dict.fromkeys(PROMPTS, 1)
    assert ids == prompt_token_ids(_rows(), tokenizer, config)  # tokenized here (again)
    trainer = GRPOTrainer(default_task.build_model(tokenizer), tokenizer, default_task.repeat_letter_reward, _rows(),
                          config, prompt_ids=ids)
    assert trainer.prompts == ids
    assert {p: tokenized[p + ":"] for p in PROMPTS} == dict.fromkeys(PROMPTS, 2)  # not by the trainer


def test_the_trainers_call_still_truncates_and_says_so(model, caplog):
    """The early check hands the ids whole and says nothing; the trainer's call truncates them and warns, as when it
    tokenized them itself."""
    rows, tokenizer = _rows(["1 say a", "1234 say a"]), load_tokenizer(model)
    config = _config(prompt_format="raw", max_prompt_length=7, truncate_prompts=True)
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.grpo_data"):
        ids = check_sampling_before_load(config, rows, [default_task.repeat_letter_reward], tokenizer)
        assert [len(i) for i in ids] == [7, 10] and not caplog.records
        ids = prompt_token_ids(rows, tokenizer, config, prompt_ids=ids)
    assert [len(i) for i in ids] == [7, 7]
    assert [r.getMessage() for r in caplog.records] == [
        "dataset: 1 of 2 prompts over max_prompt_length (7) left-truncated to their last 7 tokens "
        "(truncate_prompts=True): rows 1"]


def test_prompt_ids_of_other_rows_are_refused(model):
    tokenizer, config = load_tokenizer(model), _config()
    ids = prompt_token_ids(_rows(), tokenizer, config)
    with pytest.raises(ValueError, match=r"^prompt_ids: expected the ids of each of the dataset's 4 rows, got 3$"):
        GRPOTrainer(default_task.build_model(tokenizer), tokenizer, default_task.repeat_letter_reward, _rows(), config,
                    prompt_ids=ids[:3])
