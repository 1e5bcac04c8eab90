"""SFTConfig: every setting of `fastgrpo sft`, loadable from YAML, each field a flag.

Run-control fields (how the run is carried out or reported) may change on --resume; the others define the run and
must match the checkpoint's, as for `fastgrpo train` (fastgrpo.train.config.check_resume).
"""
from __future__ import annotations

import dataclasses

from fastgrpo._checks import check_choice
from fastgrpo.train.coercion import coerce_fields
from fastgrpo.train.config import REWARD_ERRORS, check_ddp_timeout, check_fsdp_options, option
from fastgrpo.train.config_file import ConfigFile
from fastgrpo.train.input_checks import check_at_least, check_eval_split, check_reward_names, check_save_minutes
from fastgrpo.train.options import (
    check_model_options, check_optimizer_options, check_run_options, inherited,
)
from fastgrpo.train.prompts import PROMPT_FORMATS


@dataclasses.dataclass
class SFTConfig(ConfigFile):
    COMMAND = "sft"
    # Model and data.
    model: str | None = inherited("model")
    dataset: str | None = option(None, "rows of prompt/response (or TRL's prompt/completion, a messages (or "
                                       "ShareGPT conversations) list ending in the assistant's turn, or plain text: "
                                       "a text column, trained on every token) in a file, a folder or an HF dataset, "
                                       "as train's --dataset; none: the built-in task")
    dataset_split: str = inherited("dataset_split")
    dataset_config: str | None = inherited("dataset_config")
    prompt_column: str = option("prompt", "column with the prompt: text, or chat messages")
    response_column: str = option("response", "column with the target response text")
    prompt_format: str = option("auto", f"one of {PROMPT_FORMATS}: auto uses the tokenizer's chat template when "
                                        "it has one (fastgrpo.train.prompts)")
    max_seq_length: int = option(2048, "longest prompt + response in tokens")
    truncate_sequences: bool = option(False, "cut longer rows to max_seq_length (the response's end goes) with a "
                                             "warning (default: an error naming the row)")
    dtype: str = inherited("dtype")
    device: str = inherited("device")
    ddp_timeout: int = inherited("ddp_timeout")
    # Model set-up.
    lora_rank: int = inherited("lora_rank", help="LoRA rank; 0: full fine-tuning")
    lora_alpha: int = inherited("lora_alpha")
    lora_dropout: float = inherited("lora_dropout")
    lora_target_modules: list[str] = inherited("lora_target_modules")
    load_in_4bit: bool = inherited("load_in_4bit")
    patch: bool = inherited("patch")
    gradient_checkpointing: bool = inherited("gradient_checkpointing")
    offload_activations: bool = inherited("offload_activations")
    recompute_layers: int | None = inherited("recompute_layers")
    fp8_base: bool = inherited("fp8_base")
    offload_host_memory_gib: float | None = inherited("offload_host_memory_gib")
    fsdp_cpu_offload: bool = inherited("fsdp_cpu_offload")
    fsdp_reshard_after_forward: bool = inherited("fsdp_reshard_after_forward")
    fsdp_sync_every_micro_batch: bool = inherited(
        "fsdp_sync_every_micro_batch",
        help="under torchrun, full fine-tuning: FSDP2 reduce-scatters each micro-batch's gradients and frees the "
             "gathered weights after each backward (off: keeps every group's weights gathered and its gradients "
             "unsharded until the step's last backward, for a full copy of the weights and of the gradients per GPU)")
    fsdp_layers_per_group: int = inherited("fsdp_layers_per_group")
    # Batching and optimizer. micro_batch_size does not change the gradient (the loss is normalised by the step's
    # response tokens), so it may change on --resume.
    batch_size: int = option(32, "rows per optimizer step (sorted by length, then cut into micro-batches)")
    micro_batch_size: int = option(4, "rows per forward/backward; gradients accumulate over the step",
                                   run_control=True)
    learning_rate: float = option(1e-5, "peak learning rate")
    weight_decay: float = inherited("weight_decay")
    adam_beta1: float = inherited("adam_beta1")
    adam_beta2: float = inherited("adam_beta2")
    adam_epsilon: float = inherited("adam_epsilon")
    max_grad_norm: float = inherited("max_grad_norm")
    lr_scheduler: str = inherited("lr_scheduler")
    warmup_steps: int = inherited("warmup_steps")
    seed: int = inherited("seed")
    # Run control and output: free to change on --resume.
    num_epochs: int = option(1, "passes over the data (when max_steps is 0)", run_control=True)
    max_steps: int = option(0, "optimizer steps; 0: num_epochs passes", run_control=True)
    output_dir: str = option("fastgrpo_sft_output", "metrics.jsonl, checkpoint-<step>/, eval/ and final/ go here; "
                                                    "one run at a time", run_control=True)
    overwrite_output_dir: bool = inherited("overwrite_output_dir")
    save_steps: int = inherited("save_steps")
    save_minutes: float = inherited("save_minutes")
    save_total_limit: int | None = inherited("save_total_limit")
    resume: bool = inherited("resume")
    resume_allow_changes: bool = inherited("resume_allow_changes")
    export: bool = inherited("export")
    logging_steps: int = inherited("logging_steps")
    report_to: list[str] | None = inherited("report_to")
    progress_bar: bool = inherited("progress_bar")
    # Periodic evaluation with the rollout engine (fastgrpo.train.periodic_eval).
    eval_steps: int = option(0, "evaluate every N steps and at the end; 0: off", run_control=True)
    eval_dataset: str | None = option(None, "rows with prompt_column (or TRL's messages, evaluated on the turns "
                                            "before the assistant's) and the reward's columns (an HF dataset or a "
                                            "folder: its eval_dataset_split); none: the built-in task's held-out "
                                            "rows when training on the built-in task", run_control=True)
    eval_dataset_split: str = inherited("eval_dataset_split")
    eval_dataset_config: str | None = inherited("eval_dataset_config")
    eval_max_examples: int = option(256, "evaluate on the first N rows", run_control=True)
    eval_reward_funcs: list[str] = option(["r1_zero_math"], "rewards that grade the generations", run_control=True)
    eval_max_new_tokens: int = option(1024, "tokens generated per evaluation prompt at most", run_control=True)
    eval_temperature: float = option(1.0, "sampling temperature of the evaluation; 0: greedy", run_control=True)
    reward_errors: str = inherited("reward_errors")

    def __post_init__(self):
        coerce_fields(self)
        check_at_least(self, ("max_seq_length", "batch_size", "micro_batch_size", "num_epochs",
                              "eval_max_examples", "eval_max_new_tokens"), 1)
        check_at_least(self, ("max_steps", "save_steps", "logging_steps", "eval_steps", "eval_temperature"), 0)
        check_eval_split(self)
        check_save_minutes(self)
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"micro_batch_size: expected a divisor of batch_size ({self.batch_size}), "
                             f"got {self.micro_batch_size}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format: expected one of {list(PROMPT_FORMATS)}, got {self.prompt_format!r}")
        check_choice("reward_errors", self.reward_errors, REWARD_ERRORS)
        check_reward_names(self.eval_reward_funcs, "eval_reward_funcs")
        check_run_options(self)
        check_model_options(self)
        check_optimizer_options(self)
        check_fsdp_options(self)
        check_ddp_timeout(self)
