"""What the commands check of a run's inputs before its model loads, where the tokenizer alone (it loads in well
under a second, where a model can take minutes) or the model's config.json tells: train and ei's reward functions,
weights and rows, with every prompt tokenized against max_prompt_length; sft's rows against max_seq_length; eval's
prompts with its new tokens against the model's positions (a run's periodic evaluation rows: loading.
load_eval_dataset); train's rollout engine installed, and train, sft and ei's LoRA targets against the model's
modules. These were found once the model had loaded. Each takes the tokenizer its command loaded once (loading.
tokenizer_before_load). train and ei train on the prompt ids tokenized here, eval evaluates them, and sft trains on
the examples tokenized here."""
from __future__ import annotations

from pathlib import Path

import torch

from fastgrpo.train.eval_model import evaluated_model
from fastgrpo.train.evaluate import EvalTask, build_eval_task
from fastgrpo.train.grpo_data import prompt_token_ids, tokenized_prompts
from fastgrpo.train.input_checks import (
    check_reward_rows, check_reward_setup, check_same_columns, positions_before_load,
)
from fastgrpo.train.loading import lora_model, lora_target_problem
from fastgrpo.train.rollout_options import check_engine_installed, check_kv_cache_before_load
from fastgrpo.train.sft_data import SFTExample, tokenize_rows


def check_sampling_before_load(config, rows, reward_funcs: list, tokenizer) -> list[list[int]]:
    """train, ei: what input_checks.check_sampling_inputs checks without a model: the reward functions and weights,
    the rows, their columns (what the rewards read; the same in every row), and every row's prompt tokenized, one
    over max_prompt_length refused (unless truncate_prompts: the trainer truncates it then, and says so); train's
    rollout engine installed and its KV cache's kind against the model's attention, and the LoRA targets (check_lora_targets_before_load). Returns the prompts' ids, whole,
    for the trainer to take (its prompt_ids) rather than tokenize them again (5,000 prompts: 1-3 s of a CPU core)."""
    if hasattr(config, "rollout_engine"):  # train's; ei samples with the built-in engine
        check_engine_installed(config)
        check_kv_cache_before_load(config)
    check_lora_targets_before_load(config)
    check_reward_setup(reward_funcs, config.reward_weights)
    check_reward_rows(rows, config.prompt_column, reward_funcs, rows_field(config))
    check_same_columns(rows)
    ids = tokenized_prompts(rows, tokenizer, config)
    prompt_token_ids(rows, tokenizer, config, warn=False, prompt_ids=ids)  # the lengths; the trainer's call warns
    return ids


def check_sft_rows_before_load(config, rows, tokenizer) -> list[SFTExample]:
    """sft: every row tokenized (sft_data.tokenize_rows), one over max_seq_length refused (unless truncate_sequences:
    it is truncated, with a warning); the LoRA targets (check_lora_targets_before_load). Returns the rows' examples for
    the trainer to take (its `examples`) rather than tokenize the rows again."""
    check_lora_targets_before_load(config)
    return tokenize_rows(rows, tokenizer, prompt_column=config.prompt_column,
                         response_column=config.response_column, prompt_format=config.prompt_format,
                         max_seq_length=config.max_seq_length, truncate=config.truncate_sequences)


def check_lora_targets_before_load(config) -> None:
    """lora_target_modules against config.model's modules, built from its config.json on the meta device (no weights:
    well under a second for an 8B model), wrapped by PEFT itself as the load wraps them (loading.lora_model), so that
    the two agree on what matches ("all-linear", a name or the end of one): targets the load would refuse (loading.
    lora_target_problem) are refused now, in its words. The built-in model (it loads at once), a config that cannot
    be read or built and PEFT's other refusals are left to the load, which reports them."""
    if config.lora_rank == 0 or config.model is None:
        return
    model = model_without_weights(config.model)
    if model is None:
        return
    try:
        lora_model(model, config, low_cpu_mem_usage=True)  # the adapters on the meta device too
    except ValueError as err:
        problem = lora_target_problem(model, config.lora_target_modules)
        if problem is not None:
            raise ValueError(f"lora_target_modules: {problem}") from err
    except Exception:  # noqa: BLE001 - PEFT failing otherwise on a model without weights: the load decides
        return


def model_without_weights(model: str) -> torch.nn.Module | None:
    """The model load_model_and_tokenizer builds of `model` (AutoModelForCausalLM's class for its config.json), on the
    meta device: its modules, without weights or memory; None where its config cannot be read or built."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    except Exception:  # noqa: BLE001 - whatever it is, loading the model reports it
        return None


def eval_task_before_load(config, rows, reward_funcs: list, checkpoint: Path | None, tokenizer) -> EvalTask:
    """eval: the task of its first max_examples rows (evaluate.build_eval_task), tokenized with the evaluated model's
    tokenizer and checked against its positions as its config.json gives them: --model's, or for a --checkpoint
    without one its run's model. The positions of the model loaded are checked again (the built-in model's, first)."""
    model = evaluated_model(config.model, checkpoint)
    return build_eval_task(rows, tokenizer, prompt_column=config.prompt_column,
                           prompt_format=config.prompt_format, reward_funcs=reward_funcs,
                           reward_weights=config.reward_weights, correct_threshold=config.correct_threshold,
                           max_examples=config.max_examples, max_positions=positions_before_load(model),
                           max_new_tokens=config.max_new_tokens, field=rows_field(config))


def rows_field(config) -> str:
    """How errors name the rows: "dataset", or without one the built-in task's (a reward they cannot feed, as
    `--reward-funcs r1_zero_math` without --dataset, read as if the user's data lacked its column)."""
    return "dataset" if config.dataset is not None else "dataset (none given: the built-in task's rows)"
