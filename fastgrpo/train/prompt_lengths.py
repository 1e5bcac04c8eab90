"""The prompts of `fastgrpo train`, `ei` and `eval` checked against the run's lengths before the model loads: the
commands tokenize them with the model's tokenizer alone, which loads in well under a second where the model can take
minutes (a prompt over max_prompt_length, or past the model's positions with eval's new tokens, stopped a run only
once the model had loaded). The trainers tokenize again with the tokenizer they are given, through the same
function (grpo_data.prompt_token_ids), so the two agree; eval evaluates the ids tokenized here."""
from __future__ import annotations

from pathlib import Path

from fastgrpo.train import default_task
from fastgrpo.train.eval_model import evaluated_model
from fastgrpo.train.evaluate import EvalTask, build_eval_task
from fastgrpo.train.grpo_data import prompt_token_ids
from fastgrpo.train.input_checks import positions_before_load
from fastgrpo.train.loading import load_tokenizer
from fastgrpo.train.sources import naming_the_model


def tokenizer_before_load(model: str | None):
    """The tokenizer loading.load_model_and_tokenizer gives with `model` (None: the built-in model's)."""
    if model is None:
        return default_task.build_tokenizer()
    with naming_the_model(model):
        return load_tokenizer(model)


def check_prompts_before_load(config, rows) -> None:
    """train, ei: every row's prompt tokenized as the trainer will, one over max_prompt_length refused (unless
    truncate_prompts: the trainer truncates it then, and says so)."""
    prompt_token_ids(rows, tokenizer_before_load(config.model), config, warn=False)


def eval_task_before_load(config, rows, reward_funcs: list, checkpoint: Path | None) -> EvalTask:
    """eval: the task of its first max_examples rows (evaluate.build_eval_task), tokenized with the evaluated model's
    tokenizer and checked against its positions as its config.json gives them: --model's, or for a --checkpoint
    without one its run's model. The positions of the model loaded are checked again (the built-in model's, first)."""
    model = evaluated_model(config.model, checkpoint)
    return build_eval_task(rows, tokenizer_before_load(model), prompt_column=config.prompt_column,
                           prompt_format=config.prompt_format, reward_funcs=reward_funcs,
                           reward_weights=config.reward_weights, correct_threshold=config.correct_threshold,
                           max_examples=config.max_examples, max_positions=positions_before_load(model),
                           max_new_tokens=config.max_new_tokens, field="dataset")
