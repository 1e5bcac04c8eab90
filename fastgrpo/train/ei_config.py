"""EIConfig: every setting of `fastgrpo ei` (expert iteration), loadable from YAML, each field a flag."""
from __future__ import annotations

import dataclasses
import logging

from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.train.coercion import coerce_fields
from fastgrpo.train.config import check_ddp_timeout, check_fsdp_options, option
from fastgrpo.train.config_file import ConfigFile
from fastgrpo.train.input_checks import check_at_least, check_eval_split, greedy_copies
from fastgrpo.train.options import (
    check_model_options, check_optimizer_options, check_run_options, check_scoring_options, inherited,
)
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import PROMPT_FORMATS, stop_strings
from fastgrpo.train.sft_config import SFTConfig

# Fields an EI run passes on to the SFT of each round under the same names.
_SFT_FIELDS = ("batch_size", "micro_batch_size", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
               "adam_epsilon", "max_grad_norm", "lr_scheduler", "warmup_steps", "dtype", "device", "ddp_timeout",
               "patch", "lora_rank", "output_dir", "fsdp_cpu_offload", "fsdp_reshard_after_forward",
               "fsdp_sync_every_micro_batch", "fsdp_layers_per_group")
_SFT_HELP = {f.name: f.metadata["help"] for f in dataclasses.fields(SFTConfig)}
logger = logging.getLogger(__name__)


def warn_greedy_copies(config) -> None:
    """temperature 0 with num_generations > 1: a round keeps one of a question's identical completions (its repeats
    are dropped), as with num_generations 1, at num_generations times the sampling: a warning, since nothing is lost."""
    said = greedy_copies(config)
    if said is not None:
        logger.warning("%s, and a round keeps one of them; %s samples the same rounds in 1/%d of the time", said,
                       setting("num_generations", 1), config.num_generations)


@dataclasses.dataclass
class EIConfig(ConfigFile):
    COMMAND = "ei"
    # Model and data.
    model: str | None = inherited("model")
    dataset: str | None = option(None, "question rows (with the reward's columns, e.g. answer) in a file, a "
                                       "folder or an HF dataset, as train's --dataset; none: the built-in task")
    dataset_split: str = inherited("dataset_split")
    dataset_config: str | None = inherited("dataset_config")
    prompt_column: str = option("prompt", "column with the question: text, or chat messages")
    prompt_format: str = option("r1_zero", f"one of {PROMPT_FORMATS} (fastgrpo.train.prompts)")
    reward_funcs: list[str] = option(["r1_zero_math"], "names in fastgrpo.rewards.REGISTRY, module:function or "
                                                       "path/to/file.py:function")
    reward_weights: list[float] | None = inherited("reward_weights")
    correct_threshold: float = option(1.0, "a completion is kept when its (weighted) reward is >= this")
    reward_errors: str = inherited("reward_errors")
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
    fsdp_sync_every_micro_batch: bool = inherited("fsdp_sync_every_micro_batch",
                                                  help=_SFT_HELP["fsdp_sync_every_micro_batch"])
    fsdp_layers_per_group: int = inherited("fsdp_layers_per_group")
    # Sampling.
    questions_per_step: int = option(512, "questions sampled per round (a seeded walk through the dataset)")
    num_generations: int = option(4, "completions sampled per question (G)")
    generation_batch_size: int = option(64, "questions per rollout-engine call (its KV cache holds this many x "
                                            "num_generations sequences)", run_control=True)
    max_prompt_length: int = inherited("max_prompt_length")
    truncate_prompts: bool = inherited("truncate_prompts")
    max_completion_length: int = option(1024, "tokens generated per completion at most")
    temperature: float = inherited("temperature", help="sampling temperature of each round's completions and of its "
                                                    "evaluations; 0: greedy (the fine-tuning loss is plain "
                                                    "cross-entropy, at temperature 1)")
    top_p: float = inherited("top_p")
    stop: list[str] | None = option(None, "stop strings (EOS always stops); none: </answer> under the r1_zero "
                                          "prompt format")
    # The SFT of each round (a fresh AdamW and schedule per round: its data are new each time).
    sft_epochs: int = option(1, "passes over a round's kept completions")
    batch_size: int = option(32, "kept completions per optimizer step")
    micro_batch_size: int = option(4, "completions per forward/backward; gradients accumulate over the step",
                                   run_control=True)
    learning_rate: float = option(1e-5, "peak learning rate of each round's SFT")
    weight_decay: float = inherited("weight_decay")
    adam_beta1: float = inherited("adam_beta1")
    adam_beta2: float = inherited("adam_beta2")
    adam_epsilon: float = inherited("adam_epsilon")
    max_grad_norm: float = inherited("max_grad_norm")
    lr_scheduler: str = inherited("lr_scheduler")
    warmup_steps: int = inherited("warmup_steps")
    seed: int = inherited("seed")
    # Run control and output: free to change on --resume.
    ei_steps: int = option(5, "rounds of sample -> keep the correct -> SFT; on --resume, a larger value extends "
                              "the run", run_control=True)
    output_dir: str = option("fastgrpo_ei_output", "metrics.jsonl (one line per round), checkpoint-<round>/, eval/ "
                                                   "and final/ go here; one run at a time", run_control=True)
    overwrite_output_dir: bool = inherited("overwrite_output_dir")
    save_steps: int = inherited("save_steps", default=1, help="checkpoint every N rounds, and at the end; 0: only "
                                                              "at the end")
    save_total_limit: int | None = inherited("save_total_limit")
    resume: bool = inherited("resume")
    resume_allow_changes: bool = inherited("resume_allow_changes")
    export: bool = inherited("export")
    logging_steps: int = inherited("logging_steps", help="print one line of metrics every N rounds; 0: none")
    report_to: list[str] | None = inherited("report_to")
    progress_bar: bool = inherited("progress_bar")
    eval_steps: int = option(0, "evaluate every N rounds (before the first one too) and at the end; 0: off",
                             run_control=True)
    eval_dataset: str | None = option(None, "rows to evaluate on with the same prompt format and rewards (an HF "
                                            "dataset or a folder: its eval_dataset_split); none: the built-in task's "
                                            "held-out rows when training on the built-in task", run_control=True)
    eval_dataset_split: str = inherited("eval_dataset_split")
    eval_dataset_config: str | None = inherited("eval_dataset_config")
    eval_max_examples: int = option(256, "evaluate on the first N rows", run_control=True)

    def __post_init__(self):
        coerce_fields(self)
        check_at_least(self, ("ei_steps", "questions_per_step", "num_generations", "generation_batch_size",
                              "max_prompt_length", "max_completion_length", "sft_epochs", "batch_size",
                              "micro_batch_size", "eval_max_examples"), 1)
        check_at_least(self, ("eval_steps", "save_steps", "logging_steps"), 0)
        check_eval_split(self)
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"micro_batch_size: expected a divisor of batch_size ({self.batch_size}), "
                             f"got {self.micro_batch_size}")
        check_scoring_options(self)
        warn_greedy_copies(self)
        self.sampling()
        check_run_options(self)
        check_model_options(self)
        check_optimizer_options(self)
        check_fsdp_options(self)
        check_ddp_timeout(self)

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_completion_length, temperature=self.temperature,
                              top_p=self.top_p)

    @property
    def stop_strings(self) -> list[str] | None:
        return stop_strings(self.stop, self.prompt_format)

    def sft_config(self, round_index: int) -> SFTConfig:
        """The SFT of round `round_index`: this run's batching and optimizer, sft_epochs passes, its own seed."""
        return SFTConfig(
            **{name: getattr(self, name) for name in _SFT_FIELDS},
            max_seq_length=self.max_prompt_length + self.max_completion_length, num_epochs=self.sft_epochs,
            seed=(self.seed * 1_000_003 + round_index) % 2**32, progress_bar=False, export=False,
            logging_steps=0, save_steps=0,
        )
