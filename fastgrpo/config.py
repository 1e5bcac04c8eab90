"""GRPOConfig: every setting of a GRPO run, loadable from YAML, each field a `fastgrpo train --flag`.

Precedence: dataclass defaults < the built-in task's preset (no --model) < YAML file < command-line flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path

from fastgrpo._checks import check_choice
from fastgrpo.algorithms import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES

LR_SCHEDULERS = ("constant", "linear", "cosine")
SCALE_REWARDS = ("group", "batch", "none")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclasses.dataclass
class GRPOConfig:
    # Model and data. model=None: the built-in tiny model and synthetic task (fastgrpo.default_task).
    model: str | None = None
    dataset: str | None = None  # a local .jsonl / .json file, or a Hugging Face dataset name (needs `datasets`)
    dataset_split: str = "train"
    prompt_column: str = "prompt"
    reward_funcs: list[str] = dataclasses.field(default_factory=lambda: ["length"])
    reward_weights: list[float] | None = None  # one per reward function (the trainer checks); None: all 1.0
    dtype: str = "auto"  # auto: bfloat16 on a GPU that has it, float32 on the CPU
    device: str = "auto"
    # LoRA (lora_rank=0: full fine-tuning with a frozen reference copy when beta > 0).
    lora_rank: int = 0
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])
    load_in_4bit: bool = False  # QLoRA base (needs bitsandbytes and a GPU)
    patch: bool = True  # fastgrpo.patch_model: fused kernels (the loss is fused either way)
    gradient_checkpointing: bool = False
    offload_activations: bool = False  # with patch: checkpointed layers keep their inputs in CPU memory
    # Rollout: batch_size completions per step, in groups of num_generations completions of one prompt.
    batch_size: int = 64
    num_generations: int = 8
    max_prompt_length: int = 512
    truncate_prompts: bool = False  # False: longer prompts are an error; True: left-truncated with a warning
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | None = None
    # Policy update: num_iterations epochs over the batch, num_minibatches optimizer steps per epoch,
    # micro_batch_size completions per forward/backward (gradient accumulation inside a minibatch).
    num_iterations: int = 1
    num_minibatches: int = 1
    micro_batch_size: int = 8
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    delta: float | None = None
    scale_rewards: str = "group"  # group: (r - mean) / std per group; batch: std over the batch; none: r - mean
    beta: float = 0.0  # k3 KL weight; 0: no reference model
    kl_target: float | None = None  # adaptive beta toward this KL (needs beta > 0)
    kl_max_log_step: float = 0.2  # beta changes by at most exp(+-0.2) per step
    # Optimizer.
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0  # optimizer steps
    # Run control and output.
    max_steps: int = 100
    seed: int = 0
    output_dir: str = "fastgrpo_output"
    save_steps: int = 0  # checkpoint every N steps (0: only at the end)
    resume: bool = False  # continue from the latest checkpoint in output_dir
    export: bool = True  # save an HF model directory at the end (LoRA merged into a bf16 base)
    report_to: list[str] | None = None  # "wandb" and/or "tensorboard"
    progress_bar: bool = True

    def __post_init__(self):
        for name in ("batch_size", "num_generations", "max_prompt_length", "max_completion_length",
                     "num_iterations", "num_minibatches", "micro_batch_size", "max_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations: expected >= 2 (advantages compare completions of a group), "
                             f"got {self.num_generations}")
        if self.batch_size % self.num_generations:
            raise ValueError(f"batch_size: expected a multiple of num_generations ({self.num_generations}), "
                             f"got {self.batch_size}")
        if self.batch_size % self.num_minibatches:
            raise ValueError(f"num_minibatches: expected a divisor of batch_size ({self.batch_size}), "
                             f"got {self.num_minibatches}")
        minibatch = self.batch_size // self.num_minibatches
        if minibatch % self.micro_batch_size:
            raise ValueError(f"micro_batch_size: expected a divisor of the minibatch size ({minibatch}), "
                             f"got {self.micro_batch_size}")
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        check_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        check_choice("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        check_choice("dtype", self.dtype, DTYPES)
        if not self.temperature > 0:
            raise ValueError(f"temperature: expected > 0, got {self.temperature}")
        if self.beta < 0:
            raise ValueError(f"beta: expected >= 0, got {self.beta}")
        if self.kl_target is not None and self.beta == 0:
            raise ValueError("kl_target: adaptive beta needs an initial beta > 0, got beta=0")
        if self.load_in_4bit and self.lora_rank == 0:
            raise ValueError("load_in_4bit: a 4-bit base trains through LoRA; set lora_rank > 0")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> GRPOConfig:
        """Fields from a YAML mapping, then `overrides`; unknown keys are an error naming them."""
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config: expected a YAML mapping of field: value in {path}, got {type(data).__name__}")
        return cls.from_dict({**data, **overrides})

    @classmethod
    def from_dict(cls, data: dict) -> GRPOConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"config: unknown fields {unknown}; see `fastgrpo train --help`")
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _base_type(annotation) -> tuple[type, bool, bool]:
    """(scalar type, is_list, is_optional) of a field annotation such as `list[str] | None`."""
    hint = annotation
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True, optional
    return hint, False, optional


def _parser_for(scalar: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() in ("none", "null"):
            return None
        return scalar(text)

    parse.__name__ = scalar.__name__
    return parse


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--field-name` flag per GRPOConfig field; unset flags stay absent from the parsed namespace."""
    hints = typing.get_type_hints(GRPOConfig)
    for field in dataclasses.fields(GRPOConfig):
        scalar, is_list, optional = _base_type(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        help_text = f"default: {default}"
        if scalar is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        elif is_list:
            parser.add_argument(flag, nargs="*", type=_parser_for(scalar, False), default=argparse.SUPPRESS,
                                help=help_text + " (space-separated)")
        else:
            parser.add_argument(flag, type=_parser_for(scalar, optional), default=argparse.SUPPRESS,
                                help=help_text + (" ('none' to unset)" if optional else ""))
