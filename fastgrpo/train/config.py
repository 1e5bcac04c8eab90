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
from fastgrpo.loss.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES
from fastgrpo.rollout.sampling import SamplingParams

LR_SCHEDULERS = ("constant", "linear", "cosine")
SCALE_REWARDS = ("group", "batch", "none")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def option(default, help: str):
    """A config field with its --help text; list defaults are copied per instance."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class GRPOConfig:
    # Model and data.
    model: str | None = option(None, "HF model path or hub name; none: the built-in tiny model")
    dataset: str | None = option(None, "a .jsonl / .json file of rows, or an HF dataset name (needs `datasets`); "
                                       "none: the built-in task")
    dataset_split: str = option("train", "split of an HF dataset")
    prompt_column: str = option("prompt", "column with the prompt: text, or chat messages for the chat template")
    reward_funcs: list[str] = option(["length"], "names in fastgrpo.rewards.REGISTRY or module:function")
    reward_weights: list[float] | None = option(None, "one weight per reward function; none: all 1.0")
    dtype: str = option("auto", f"one of {DTYPES}; auto: bfloat16 on a GPU that has it, else float32")
    device: str = option("auto", "auto: cuda when available, else cpu")
    # Model set-up.
    lora_rank: int = option(0, "LoRA rank; 0: full fine-tuning (with a frozen reference copy when beta > 0)")
    lora_alpha: int = option(32, "LoRA alpha")
    lora_dropout: float = option(0.0, "LoRA dropout")
    lora_target_modules: list[str] = option(["all-linear"], "modules LoRA wraps")
    load_in_4bit: bool = option(False, "QLoRA: a 4-bit NF4 base (needs bitsandbytes, a GPU and lora_rank > 0)")
    patch: bool = option(True, "fastgrpo.patch_model: fused RMSNorm / RoPE / SwiGLU / LoRA (the loss is fused always)")
    gradient_checkpointing: bool = option(False, "HF gradient checkpointing (non-reentrant)")
    offload_activations: bool = option(False, "with patch: checkpointed layers keep their inputs in CPU memory")
    offload_host_memory_gib: float | None = option(
        None, "with offload_activations: most pinned CPU memory the offloaded inputs may take, in GiB (a larger "
              "step is an error naming this field); none: what a step needs (8 x 8K tokens of Qwen2.5-1.5B: 7 GiB)")
    # Rollout.
    batch_size: int = option(64, "completions per step, in groups of num_generations completions of one prompt")
    num_generations: int = option(8, "completions per prompt (the group of the advantage)")
    max_prompt_length: int = option(512, "longest prompt in tokens")
    truncate_prompts: bool = option(False, "left-truncate longer prompts with a warning (default: an error)")
    max_completion_length: int = option(256, "tokens generated per completion at most")
    temperature: float = option(1.0, "sampling temperature (also divides the logits of the loss)")
    top_p: float = option(1.0, "nucleus sampling; 1: off")
    top_k: int = option(0, "top-k sampling; 0: off")
    min_p: float = option(0.0, "min-p sampling; 0: off")
    repetition_penalty: float = option(1.0, "HF-style repetition penalty; 1: off")
    stop: list[str] | None = option(None, "stop strings (the EOS token always stops)")
    # Policy update.
    num_iterations: int = option(1, "epochs over each rollout batch")
    num_minibatches: int = option(1, "optimizer steps per epoch")
    micro_batch_size: int = option(8, "completions per forward/backward; gradients accumulate over a minibatch")
    loss_type: str = option("dapo", f"aggregation, one of {LOSS_TYPES}")
    importance_sampling_level: str = option("token", f"ratio per token or per sequence {IMPORTANCE_SAMPLING_LEVELS}")
    epsilon_low: float = option(0.2, "lower clip: ratio >= 1 - epsilon_low")
    epsilon_high: float = option(0.28, "upper clip: ratio <= 1 + epsilon_high (DAPO's clip-higher)")
    delta: float | None = option(None, "cap on the unclipped ratio (two-sided clipping); none: off")
    scale_rewards: str = option("group", "advantages: group: (r - mean) / group std; batch: / batch std; "
                                         "none: r - mean")
    beta: float = option(0.0, "k3 KL weight; 0: no reference log-probs at all")
    kl_target: float | None = option(None, "adaptive beta toward this KL (needs beta > 0); none: fixed beta")
    kl_max_log_step: float = option(0.2, "adaptive beta changes by at most exp(+-this) per step")
    # Optimizer (AdamW: fused on CUDA, foreach on the CPU).
    learning_rate: float = option(1e-6, "peak learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.99, "AdamW beta2")
    adam_epsilon: float = option(1e-8, "AdamW epsilon")
    max_grad_norm: float = option(1.0, "gradient clipping by global norm")
    lr_scheduler: str = option("constant", f"after warm-up, one of {LR_SCHEDULERS}")
    warmup_steps: int = option(0, "linear warm-up, in optimizer steps")
    # Run control and output.
    max_steps: int = option(100, "training steps (one rollout batch each)")
    seed: int = option(0, "seed of data order, sampling and initialization")
    output_dir: str = option("fastgrpo_output", "metrics.jsonl, checkpoint-<step>/ and final/ go here")
    save_steps: int = option(0, "checkpoint every N steps; 0: only at the end")
    resume: bool = option(False, "continue from the latest checkpoint in output_dir")
    export: bool = option(True, "save an HF model directory to output_dir/final (LoRA merged into a bf16 base)")
    report_to: list[str] | None = option(None, "also log to wandb and/or tensorboard")
    progress_bar: bool = option(True, "tqdm progress bar")

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
        # the rollout's checks of top_p / top_k / min_p / repetition_penalty, before any model is loaded
        SamplingParams(max_new_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p,
                       top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty)
        for name in ("beta", "epsilon_low", "epsilon_high", "kl_max_log_step", "learning_rate", "weight_decay",
                     "warmup_steps", "save_steps", "lora_rank", "lora_dropout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if not self.epsilon_low < 1:
            raise ValueError(f"epsilon_low: expected < 1 (the lower clip 1 - epsilon_low > 0), got {self.epsilon_low}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: expected > 0, got {self.max_grad_norm}")
        if self.kl_target is not None and not self.kl_target > 0:
            raise ValueError(f"kl_target: expected > 0 (none: fixed beta), got {self.kl_target}")
        if self.kl_target is not None and self.beta == 0:
            raise ValueError("kl_target: adaptive beta needs an initial beta > 0, got beta=0")
        if self.load_in_4bit and self.lora_rank == 0:
            raise ValueError("load_in_4bit: a 4-bit base trains through LoRA; set lora_rank > 0")
        if self.offload_host_memory_gib is not None:
            if not self.offload_host_memory_gib > 0:
                raise ValueError(f"offload_host_memory_gib: expected > 0 or none, got {self.offload_host_memory_gib}")
            if not (self.offload_activations and self.patch):
                raise ValueError("offload_host_memory_gib: bounds the memory of offload_activations, which is off "
                                 "(it needs patch and offload_activations)")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> GRPOConfig:
        """Fields from a YAML mapping, then `overrides`; unknown keys are an error naming them."""
        return cls.from_dict({**read_yaml(path), **overrides})

    @classmethod
    def from_dict(cls, data: dict) -> GRPOConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"config: unknown fields {unknown}; see `fastgrpo train --help`")
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def read_yaml(path: str | Path) -> dict:
    """The {field: value} mapping of a YAML config file (an empty file is {})."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config: expected a YAML mapping of field: value in {path}, got {type(data).__name__}")
    return data


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
        help_text = f"{field.metadata.get('help', '')} (default: {default})"
        if scalar is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        elif is_list:
            parser.add_argument(flag, nargs="*", type=_parser_for(scalar, False), default=argparse.SUPPRESS,
                                help=help_text + ", space-separated")
        else:
            parser.add_argument(flag, type=_parser_for(scalar, optional), default=argparse.SUPPRESS,
                                help=help_text + (", 'none' to unset" if optional else ""))
