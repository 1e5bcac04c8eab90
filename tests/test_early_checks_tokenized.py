"""train and ei tokenize every prompt once: the trainer takes the ids the early check (before the model loads) made,
where they are of the same prompts, format and tokenizer state. The trainer tokenized them all again: 5,000 prompts
took 1-3 s of a CPU core. Another tokenizer, format or rows get their own ids, as before."""
from __future__ import annotations

import collections
import json
import logging

import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.grpo_data import prompt_token_ids
from fastgrpo.train.loading import load_tokenizer

PROMPTS = [f"{i} say a" for i in range(4)]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}:{% endfor %}"


@pytest.fixture
def model(tmp_path) -> str:
    """A tiny Qwen2 model of the built-in tokenizer, saved with its (random) weights and a chat template."""
    folder = tmp_path / "model"
    tokenizer = default_task.build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    default_task.build_model(tokenizer).save_pretrained(folder)
    return str(folder)


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
    return GRPOConfig(**{"prompt_format": "chat", "max_prompt_length": 16, **fields})


def test_the_ids_kept_are_taken_for_the_same_prompts_format_and_tokenizer_state(model, tokenized):
    rows = [{"prompt": p} for p in PROMPTS]
    kept = prompt_token_ids(rows, load_tokenizer(model), _config(), keep=True)
    assert prompt_token_ids(rows, load_tokenizer(model), _config()) == kept  # another load of the same files
    assert {p: tokenized[p + ":"] for p in PROMPTS} == dict.fromkeys(PROMPTS, 1)


@pytest.mark.parametrize("change", ["tokenizer", "format", "rows"])
def test_ids_of_another_tokenizer_format_or_rows_are_their_own(model, change):
    rows = [{"prompt": p} for p in PROMPTS]
    prompt_token_ids(rows, load_tokenizer(model), _config(), keep=True)
    tokenizer, config = load_tokenizer(model), _config()
    if change == "tokenizer":
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    elif change == "format":
        config = _config(prompt_format="raw")
    else:
        rows = [{"prompt": p + "b"} for p in PROMPTS]
    expected = prompt_token_ids(rows, tokenizer, config)  # nothing kept now: tokenized here
    prompt_token_ids([{"prompt": p} for p in PROMPTS], load_tokenizer(model), _config(), keep=True)
    assert prompt_token_ids(rows, tokenizer, config) == expected


def test_the_trainers_call_still_truncates_and_says_so(model, caplog):
    """The early check keeps the ids whole and says nothing (warn=False); the trainer's call truncates them and warns,
    as when it tokenized them itself."""
    rows = [{"prompt": p} for p in ("1 say a", "1234 say a")]
    config = _config(prompt_format="raw", max_prompt_length=7, truncate_prompts=True)
    prompt_token_ids(rows, load_tokenizer(model), config, warn=False, keep=True)
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.grpo_data"):
        ids = prompt_token_ids(rows, load_tokenizer(model), config)
    assert [len(i) for i in ids] == [7, 7]
    assert [r.getMessage() for r in caplog.records] == [
        "dataset: 1 of 2 prompts over max_prompt_length (7) left-truncated to their last 7 tokens "
        "(truncate_prompts=True): rows 1"]
