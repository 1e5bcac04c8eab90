"""What the configs of `fastgrpo sft`, `ei` and `eval` share with GRPOConfig: model-loading fields (same names,
defaults and help, so fastgrpo.train.loading builds the model from any of them) and checks (their YAML / dict I/O:
config_file.ConfigFile, which GRPOConfig has too).

Each config stays a flat dataclass (one field = one flag = one YAML key); `inherited` copies a GRPOConfig field
instead of restating its default and help text. Below them, what the trainers (GRPOTrainer, SFTTrainer) share as
Python objects: the check of the objects they are given, and how a second train() call knows its own run.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from fastgrpo._checks import check_choice
from fastgrpo.hf.peft import check_layer_adapters
from fastgrpo.train.checkpoint import latest_checkpoint
from fastgrpo.train.config import (DTYPES, LR_SCHEDULERS, MAX_SEED, REWARD_ERRORS, GRPOConfig, check_4bit_base,
                                   option)
from fastgrpo.train.input_checks import (
    check_adamw_options, check_at_least, check_lora_options, check_reward_names, check_reward_weights,
)
from fastgrpo.train.memory_options import check_activation_memory_options
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import PROMPT_FORMATS

_GRPO_FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig)}


def inherited(name: str, default=dataclasses.MISSING, help: str | None = None):
    """GRPOConfig's field `name` (default, --help text, run_control), optionally with another default or help."""
    field = _GRPO_FIELDS[name]
    if default is dataclasses.MISSING:
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    return option(default, help if help is not None else field.metadata["help"],
                  run_control=field.metadata.get("run_control", False))


def check_run_options(config) -> None:
    """The checks GRPOConfig makes of the seed and the output-folder fields, for a config that has them."""
    if not 0 <= config.seed < MAX_SEED:
        raise ValueError(f"seed: expected an int in [0, 2**32), got {config.seed}")
    if config.resume and config.overwrite_output_dir:
        raise ValueError("overwrite_output_dir: deletes the checkpoints that resume continues from; pass one of "
                         f"{setting('resume', True)} and {setting('overwrite_output_dir', True)}")
    if getattr(config, "save_total_limit", None) is not None and config.save_total_limit < 1:
        raise ValueError(f"save_total_limit: expected >= 1 or none (keep all), got {config.save_total_limit}")


def check_model_options(config) -> None:
    """The checks GRPOConfig makes of the model-loading fields, for a config that has them."""
    check_choice("dtype", config.dtype, DTYPES)
    check_lora_options(config)
    check_4bit_base(config)
    check_activation_memory_options(config)


def check_optimizer_options(config) -> None:
    check_choice("lr_scheduler", config.lr_scheduler, LR_SCHEDULERS)
    check_adamw_options(config)
    check_at_least(config, ("warmup_steps",), 0)


def check_scoring_options(config) -> None:
    """prompt_format, reward_errors, stop, reward_funcs, reward_weights and correct_threshold of a command that
    samples and scores (ei, eval)."""
    if config.prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format: expected one of {list(PROMPT_FORMATS)}, got {config.prompt_format!r}")
    if config.reward_errors not in REWARD_ERRORS:
        raise ValueError(f"reward_errors: expected one of {list(REWARD_ERRORS)}, got {config.reward_errors!r}")
    if config.stop is not None and not all(config.stop):
        raise ValueError(f"stop: expected non-empty strings (the EOS token always stops), got {config.stop!r}")
    check_reward_names(config.reward_funcs)
    check_reward_weights(config.reward_weights)
    if not math.isfinite(config.correct_threshold):  # nan / inf count no completion correct, -inf each
        raise ValueError(f"correct_threshold: expected a finite number, got {config.correct_threshold}")


# how an Interrupted raised by a trainer's train() says to continue from Python (the CLI puts its command line there)
CONTINUE_FROM_PYTHON = "train() on this trainer, or resume=True in a new one (with the same settings otherwise)"


def check_trainer_objects(model, tokenizer, dataset, config, config_class: type) -> None:
    """A trainer's model, tokenizer, dataset and config are objects (the commands load them by name): a name, a dict
    or another object in their place is one ValueError naming the argument, before anything uses it. The rows
    themselves are checked where they are read (input_checks, sft_data)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        hint = "; fastgrpo.train.loading.load_model_and_tokenizer(config) loads one by name" \
            if isinstance(model, str) else ""
        raise ValueError(f"model: expected a loaded model (a torch.nn.Module), got {_given(model)}{hint}")
    if isinstance(tokenizer, str) or not hasattr(tokenizer, "pad_token_id"):
        raise ValueError("tokenizer: expected a loaded tokenizer (transformers.AutoTokenizer.from_pretrained(name)), "
                         f"got {_given(tokenizer)}")
    if config is not None and not isinstance(config, config_class):
        name = config_class.__name__
        hint = f"; build one from it: {name}(**values) or {name}.from_dict(values)" if isinstance(config, dict) else ""
        raise ValueError(f"config: expected a {name}, got {_given(config)}{hint}")
    check_dataset_kind(dataset)
    check_layer_adapters(model)


def _given(value) -> str:
    return f"the name {value!r}" if isinstance(value, str) else type(value).__name__


def check_dataset_kind(dataset) -> None:
    """A list (or tuple) of rows or a datasets.Dataset: what a trainer indexes and takes the length of (a dict of
    columns and None are named by input_checks). A name, a pandas DataFrame (frame[0] is a column), a generator or a streamed
    dataset is one ValueError saying what to give instead."""
    if dataset is None or isinstance(dataset, (list, tuple, dict)) or hasattr(dataset, "column_names") \
            and hasattr(dataset, "__len__"):
        return
    kind = type(dataset).__name__
    if isinstance(dataset, str):
        how = f"got the name {dataset!r}; fastgrpo.train.loading.load_rows(name) reads one"
    elif kind == "DataFrame":
        how = "got DataFrame; datasets.Dataset.from_pandas(frame) makes one"
    elif kind == "IterableDataset":
        how = "got IterableDataset, whose rows stream without a length; load it without streaming=True"
    else:
        how = f"got {kind}; list(rows) makes one"
    raise ValueError(f"dataset: expected a list of dict rows ({{'prompt': ...}}) or a datasets.Dataset, {how}")


def checkpoint_identity(path: Path | None) -> tuple[int, int] | None:
    """What tells the checkpoint folder `path` from one another run writes at the same path later (a new folder
    renamed into place): its inode and modification time; None where there is no such folder."""
    try:
        stat = os.stat(path)
    except (TypeError, OSError):
        return None
    return stat.st_ino, stat.st_mtime_ns


def check_own_run(output_dir: Path, saved: Path, identity: tuple[int, int] | None) -> None:
    """Before train() called again continues a trainer's run: the newest checkpoint of output_dir is still the one
    the trainer wrote (`saved`, `identity`). Another run started afresh there since (overwrite_output_dir), or the
    folder was emptied: continuing would take up that run's checkpoint and append to its log."""
    if latest_checkpoint(output_dir) != saved or checkpoint_identity(saved) != identity:
        raise ValueError(f"output_dir: {output_dir} no longer holds this trainer's {saved.name} (another run wrote "
                         "there since); build a new trainer to train there")


def restore_schedule(scheduler, state: dict) -> None:
    """Load a checkpoint's LR scheduler `state` and give each parameter group its schedule's LR at the restored
    position: the optimizer's saved LR is of the saved schedule, and where max_steps was raised since (a longer
    linear / cosine schedule) the first update would have taken the old one's (0 at a linear schedule's end)."""
    scheduler.load_state_dict(state)
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)


# the config fields a trainer reads again at each train() call; it applied the others as it was built
LIVE_FIELDS = ("max_steps", "num_epochs", "save_steps", "save_minutes", "save_total_limit", "logging_steps",
               "progress_bar", "export", "resume", "resume_allow_changes", "overwrite_output_dir")


def check_config_unchanged(built: dict, config) -> None:
    """Before train(): a field of trainer.config set since the trainer was built (`built`: its dataclasses.asdict
    then), other than LIVE_FIELDS, would be half applied (the prompts, the sampling, the output folder were made from
    the old value): one ValueError naming it."""
    now = dataclasses.asdict(config)
    for name, before in built.items():
        if name not in LIVE_FIELDS and now[name] != before:
            raise ValueError(f"config: {name} changed since the trainer was built ({before!r} then, {now[name]!r} "
                             "now), and the trainer applied it as it was built; build a new trainer for the new "
                             f"value ({setting('resume', True)} continues this run)")
