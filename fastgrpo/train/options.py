"""What the configs of `fastgrpo sft`, `ei` and `eval` share with GRPOConfig: model-loading fields (same names,
defaults and help, so fastgrpo.train.loading builds the model from any of them) and checks (their YAML / dict I/O:
config_file.ConfigFile, which GRPOConfig has too).

Each config stays a flat dataclass (one field = one flag = one YAML key); `inherited` copies a GRPOConfig field
instead of restating its default and help text.
"""
from __future__ import annotations

import dataclasses
import math

from fastgrpo._checks import check_choice
from fastgrpo.train.config import (DTYPES, LR_SCHEDULERS, MAX_SEED, REWARD_ERRORS, GRPOConfig, check_4bit_base,
                                   option)
from fastgrpo.train.input_checks import check_adamw_options, check_at_least, check_lora_options, check_reward_weights
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
    """prompt_format, reward_errors, stop, reward_weights and correct_threshold of a command that samples and
    scores (ei, eval)."""
    if config.prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format: expected one of {list(PROMPT_FORMATS)}, got {config.prompt_format!r}")
    if config.reward_errors not in REWARD_ERRORS:
        raise ValueError(f"reward_errors: expected one of {list(REWARD_ERRORS)}, got {config.reward_errors!r}")
    if config.stop is not None and not all(config.stop):
        raise ValueError(f"stop: expected non-empty strings (the EOS token always stops), got {config.stop!r}")
    check_reward_weights(config.reward_weights)
    if not math.isfinite(config.correct_threshold):  # nan / inf count no completion correct, -inf each
        raise ValueError(f"correct_threshold: expected a finite number, got {config.correct_threshold}")
