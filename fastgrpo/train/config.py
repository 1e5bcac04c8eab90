"""GRPOConfig: every setting of a GRPO run, loadable from YAML, each field a `fastgrpo train --flag`.

Precedence: dataclass defaults < the built-in task's preset (no --model) < YAML file < command-line flags.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

from fastgrpo._checks import check_choice
from fastgrpo.loss.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES
from fastgrpo.rollout.decode_weights import WEIGHTS
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.train.base_fingerprint import base_change, same_base
from fastgrpo.train.coercion import coerce_fields
from fastgrpo.train.config_file import INPUT_PATH_FIELDS, REWARD_FUNCTION_FIELDS, ConfigFile
from fastgrpo.train.dataset_fingerprint import FINGERPRINT_KEY as DATASET_FINGERPRINT_KEY
from fastgrpo.train.dataset_fingerprint import recorded_fingerprint as recorded_dataset_fingerprint
from fastgrpo.train.input_checks import (
    check_adamw_options, check_at_least, check_eval_split, check_lora_options, check_reward_names,
    check_reward_weights, check_save_minutes, greedy_copies,
)
from fastgrpo.train.loss_setup import check_loss_options
from fastgrpo.train.memory_options import check_activation_memory_options
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import PROMPT_FORMATS, stop_strings
from fastgrpo.train.rollout_options import ROLLOUT_ENGINES, check_rollout_options
from fastgrpo.train.run_kind import check_same_command
from fastgrpo.train.sources import function_file

logger = logging.getLogger(__name__)
LR_SCHEDULERS = ("constant", "linear", "cosine")
SCALE_REWARDS = ("group", "batch", "none")
DTYPES = ("auto", "float32", "bfloat16", "float16")
REWARD_ERRORS = ("raise", "skip")
# Seeds derive per-step generator seeds (seed * 1_000_003 + step, then * 131 + epoch) that must stay in int64.
MAX_SEED = 2**32
DDP_TIMEOUT_S = 1800  # HF TrainingArguments' ddp_timeout default (torch's own: 30 min for gloo, 10 min for NCCL)
# the largest ddp_timeout: torch's store and gloo count it in int64 nanoseconds (292 years); 9e9 s hung 2 gloo
# processes, 1e10 s failed the store's connect at once (torch 2.13); 4e9 s worked
MAX_DDP_TIMEOUT_S = 10**9


def option(default, help: str, *, run_control: bool = False):
    """A config field with its --help text; list defaults are copied per instance.

    run_control: the field says how a run is carried out or reported (steps, saving, logging, devices, memory
    knobs), not what it computes, so `--resume` accepts a new value. Every other field defines the run: a resumed
    run must match the checkpoint's value (config_changes), so a new field is compared unless it says otherwise.
    """
    metadata = {"help": help, "run_control": run_control}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check_ddp_timeout(config) -> None:
    """ddp_timeout of every command that joins torchrun's process group (fastgrpo.train.process_group)."""
    if not 1 <= config.ddp_timeout <= MAX_DDP_TIMEOUT_S:
        raise ValueError(f"ddp_timeout: expected seconds in [1, 10**9], got {config.ddp_timeout}")


def check_fsdp_options(config) -> None:
    """The fsdp_* fields (under torchrun, full fine-tuning) of GRPOConfig and SFTConfig."""
    check_at_least(config, ("fsdp_layers_per_group",), 1)
    if not config.fsdp_sync_every_micro_batch and config.fsdp_cpu_offload:
        raise ValueError("fsdp_sync_every_micro_batch: off keeps unsharded weights and gradients on the GPU, "
                         "which fsdp_cpu_offload moves to CPU memory; pass one of the two")


@dataclasses.dataclass
class GRPOConfig(ConfigFile):
    COMMAND = "train"  # its subcommand, in messages (not a field: no annotation)

    # Model and data.
    model: str | None = option(None, "HF model path or hub name; none: the built-in tiny model")
    dataset: str | None = option(None, "a .jsonl / .json (or .gz) file of rows; a .parquet / .csv / .tsv file, a "
                                       "folder of data files or of save_to_disk, or an HF dataset name (these need "
                                       "`datasets`); none: the built-in task")
    dataset_split: str = option("train", "split of an HF dataset or a folder; a file (or a save_to_disk folder of "
                                        "one Dataset) is read whole, under 'train', or sliced: 'train[:100]'")
    dataset_config: str | None = option(None, "config (subset) of an HF dataset that has several, as "
                                              "datasets.load_dataset(dataset, name) takes it: main for openai/gsm8k")
    prompt_column: str = option("prompt", "column with the prompt: text, or chat messages for the chat template")
    prompt_format: str = option("raw", f"one of {PROMPT_FORMATS} (fastgrpo.train.prompts); r1_zero: the R1-Zero "
                                "template around the text, generation stopping at </answer> unless --stop")
    reward_funcs: list[str] = option(["length"], "names in fastgrpo.rewards.REGISTRY, module:function (a module "
                                                 "in the current folder too) or path/to/file.py:function")
    reward_weights: list[float] | None = option(None, "one weight per reward function; none: all 1.0")
    dtype: str = option("auto", f"one of {DTYPES}; auto: bfloat16 on a GPU that has it, else float32")
    device: str = option("auto", "auto: cuda when available, else cpu; cpu, cuda or cuda:N", run_control=True)
    ddp_timeout: int = option(DDP_TIMEOUT_S, "under torchrun: seconds a collective waits for the other processes "
                                             "before each process that waited stops, saying one is stuck (HF's "
                                             "ddp_timeout); raise it where one process works alone longer (rank 0 "
                                             "saving a large checkpoint or export)", run_control=True)
    # Model set-up.
    lora_rank: int = option(0, "LoRA rank; 0: full fine-tuning (with a frozen reference copy when beta > 0)")
    lora_alpha: int = option(32, "LoRA alpha")
    lora_dropout: float = option(0.0, "LoRA dropout")
    lora_target_modules: list[str] = option(["all-linear"], "modules LoRA wraps")
    load_in_4bit: bool = option(False, "QLoRA: a 4-bit NF4 base (needs bitsandbytes, a GPU and lora_rank > 0)")
    patch: bool = option(True, "fastgrpo.patch_model: fused RMSNorm / RoPE / SwiGLU / LoRA (the loss is fused always)",
                         run_control=True)
    gradient_checkpointing: bool = option(False, "HF gradient checkpointing (non-reentrant)", run_control=True)
    fsdp_cpu_offload: bool = option(False, "under torchrun, full fine-tuning: FSDP2 keeps the weight, gradient and "
                                           "AdamW shards in CPU memory (the optimizer steps there)", run_control=True)
    fsdp_reshard_after_forward: bool = option(
        True, "under torchrun, full fine-tuning: FSDP2 frees each layer's gathered weights after its forward and "
              "gathers them again for the backward (off: keeps them until the backward, one all-gather fewer per "
              "layer and micro-batch for a full copy of the weights per GPU)", run_control=True)
    fsdp_sync_every_micro_batch: bool = option(
        True, "under torchrun, full fine-tuning: FSDP2 reduce-scatters each micro-batch's gradients and frees the "
              "gathered weights after each backward (off: keeps every group's weights gathered and its gradients "
              "unsharded until the minibatch's last backward, one all-gather and one reduce-scatter per group and "
              "minibatch, for a full copy of the weights and of the gradients per GPU)", run_control=True)
    fsdp_layers_per_group: int = option(
        1, "under torchrun, full fine-tuning: consecutive decoder layers that FSDP2 gathers, frees and reduces as one "
           "group (fewer, larger collectives and fewer of FSDP2's per-group hooks on the host, for more gathered "
           "weights held at a time; a frozen reference copy is grouped alike)", run_control=True)
    offload_activations: bool = option(False, "with patch: checkpointed layers keep their inputs in CPU memory",
                                       run_control=True)
    recompute_layers: int | None = option(
        None, "with gradient_checkpointing or offload_activations: only the first N decoder layers are recomputed in "
              "the backward; the later ones keep their activations on the GPU (a faster update for more memory, "
              "benchmarks/NOTES.md); none: every layer", run_control=True)
    fp8_base: bool = option(
        False, "with patch: the model's linears multiply in FP8, forward and input gradient (e4m3 rows with their "
               "own scales): with LoRA the frozen base (an e4m3 copy beside it), with lora_rank 0 every decoder "
               "linear (copies and their transposes kept, remade after each optimizer step; weight gradients in "
               "the model's dtype; pays only with long micro-batches); benchmarks/NOTES.md. It "
               "changes the model's numbers as a 4-bit base does; needs FP8 tensor cores (compute capability 8.9+)")
    offload_host_memory_gib: float | None = option(
        None, "with offload_activations: most pinned CPU memory the offloaded inputs may take, in GiB (a larger "
              "step is an error naming this field); none: what a step needs (8 x 8K tokens of Qwen2.5-1.5B: 7 GiB)",
        run_control=True)
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
    rollout_engine: str = option("builtin", f"one of {ROLLOUT_ENGINES}: builtin (the model's own modules) or vllm "
                                            "(vLLM in this process, sharing the weights; `pip install "
                                            "\"fastgrpo[vllm]\"`, a GPU)", run_control=True)
    rollout_attention: str = option("auto", "builtin: one-token attention, sdpa (one SDPA call over the padded "
                                            "cache), triton (a flash-decoding kernel reading only the filled "
                                            "slots) or auto (triton on a GPU)", run_control=True)
    rollout_weights: str = option("auto", f"builtin: the weights decoding multiplies, one of {WEIGHTS}: auto (on "
                                          "a GPU fused, else dense, when its copy fits the free memory, else nf4 "
                                          "for an NF4 base computing in 16 bits on sm80+, else model), model: the "
                                          "modules' own, fp8: an e4m3 copy of every linear (bf16 activations), "
                                          "w8a8: that with activations rounded to e4m3 per row (FP8 tensor cores), "
                                          "dense: a copy of LoRA-merged / 4-bit layers in the model's dtype (one "
                                          "GEMM each; costs their bytes during the rollout), fused: dense with plain "
                                          "q/k/v and gate/up stacked too (costs their bytes), nf4: a Triton kernel "
                                          "reading a bitsandbytes NF4 base (no copy)",
                                  run_control=True)
    rollout_kv_cache: str = option("model", "builtin: the decode KV cache, model (the model's dtype) or fp8 (e4m3, "
                                            "an fp32 scale per vector: 0.52x the memory at head_dim 128; log-probs "
                                            "move by the quantization; rollout_attention triton or auto, compute "
                                            "capability >= 8.9; fastest with rollout_weights w8a8)",
                                   run_control=True)
    vllm_gpu_memory_utilization: float | None = option(
        None, "vllm: vLLM's share of the GPU for its activations and KV cache (vLLM's gpu_memory_utilization); "
              "none: a KV cache for one batch of max_prompt_length + max_completion_length tokens", run_control=True)
    vllm_lora_sync: str = option("merge", "vllm: how the LoRA adapter reaches vLLM each step: merge (W + BA "
                                          "written into vLLM's own copy of each adapted weight; the faster) or "
                                          "adapter (vLLM's LoRA path: the base stored once, less memory)",
                                 run_control=True)
    vllm_execution: str = option("graphs", "vllm: graphs (CUDA-graphed decode, no torch.compile), compile (vLLM's "
                                           "default; minutes to start) or eager", run_control=True)
    # Policy update.
    num_iterations: int = option(1, "epochs over each rollout batch")
    num_minibatches: int = option(1, "optimizer steps per epoch")
    micro_batch_size: int = option(8, "completions per forward/backward; gradients accumulate over a minibatch",
                                   run_control=True)
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
    # Loss options from TRL 1.15 / 1.16, TRL's names and defaults (formulas: fastgrpo/loss/grpo.py), and the rollout
    # correction (TRL's vllm_importance_sampling_*) for any engine's log-probs (fastgrpo/loss/correction.py).
    sapo_temperature_pos: float = option(1.0, "sapo: gate temperature of tokens with A > 0")
    sapo_temperature_neg: float = option(1.05, "sapo: gate temperature of tokens with A <= 0")
    vespo_k_pos: float = option(2.0, "vespo: exponent k of phi(w) = e^lambda w^k e^(-lambda w) for A >= 0")
    vespo_lambda_pos: float = option(3.0, "vespo: decay lambda of phi(w) for A >= 0")
    vespo_k_neg: float = option(3.0, "vespo: exponent k for A < 0")
    vespo_lambda_neg: float = option(2.0, "vespo: decay lambda for A < 0")
    top_entropy_quantile: float = option(1.0, "the policy term keeps this top fraction of tokens by entropy (1: all)")
    off_policy_mask_threshold: float | None = option(
        None, "drop sequences with A < 0 whose mean log(pi_rollout / pi) over their tokens is above this "
              "(DeepSeek-V3.2's off-policy sequence mask); none: off")
    use_bias_correction_kl: bool = option(False, "multiply the KL term by the importance ratio (TRL's default: on)")
    entropy_coef: float = option(0.0, "subtract this x the mean entropy of the tokens the policy term acts on")
    use_adaptive_entropy: bool = option(False, "adapt entropy_coef toward entropy_target (applied only while the "
                                               "last step's entropy is <= entropy_target)")
    entropy_coef_min: float = option(0.0, "adaptive entropy: lowest coefficient")
    entropy_coef_max: float = option(1.0, "adaptive entropy: highest coefficient")
    entropy_coef_delta: float = option(0.005, "adaptive entropy: change of the coefficient per optimizer step")
    entropy_target: float = option(0.2, "adaptive entropy: target mean entropy")
    mask_truncated_completions: bool = option(False, "completions cut at max_completion_length add no loss (they "
                                                     "still count in their group's advantages)")
    multi_objective_aggregation: str = option(
        "sum_then_normalize", "several reward functions: sum_then_normalize (weighted sum, then scale_rewards) or "
                              "normalize_then_sum (GDPO: each standardized in its group, summed, then over the batch)")
    rollout_correction: str = option("none", "weight the policy term by pi_old / pi_rollout from the engine's "
                                             "log-probs: none, truncate (clamp) or mask (0 outside the clip range); "
                                             "pi_old from the loss's forward, or an old pass if the policy moves")
    rollout_correction_level: str = option("sequence", "rollout correction per token or per sequence")
    rollout_correction_clip_min: float | None = option(None, "rollout correction: lower bound; none: unbounded")
    rollout_correction_clip_max: float | None = option(3.0, "rollout correction: upper bound C; none: unbounded")
    # Optimizer (AdamW: fused on CUDA, foreach on the CPU).
    learning_rate: float = option(1e-6, "peak learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.99, "AdamW beta2")
    adam_epsilon: float = option(1e-8, "AdamW epsilon")
    max_grad_norm: float = option(1.0, "gradient clipping by global norm; inf: off")
    lr_scheduler: str = option("constant", f"after warm-up, one of {LR_SCHEDULERS}")
    warmup_steps: int = option(0, "linear warm-up, in optimizer steps")
    reward_errors: str = option(
        "raise", f"one of {REWARD_ERRORS}: a reward function that raises, returns the wrong count or NaN / inf "
                 "stops the run naming the function and the first bad row (raise), or scores those rows 0 and "
                 "logs reward_errors (skip)", run_control=True)
    seed: int = option(0, "seed of data order, sampling and initialization, in [0, 2**32)")
    # Run control and output: free to change on --resume.
    max_steps: int = option(100, "training steps (one rollout batch each); on --resume, a larger value extends "
                                 "the run (a linear / cosine schedule then decays over the new length)",
                            run_control=True)
    output_dir: str = option("fastgrpo_output", "metrics.jsonl, checkpoint-<step>/ and final/ go here; one run "
                                                "at a time (a lock file holds its PID)", run_control=True)
    overwrite_output_dir: bool = option(False, "start afresh in an output_dir that holds another run: its "
                                               "checkpoints, metrics and final/ are deleted first", run_control=True)
    # Periodic checkpoints bound what a crash or a kill without warning loses (SIGINT / SIGTERM save one anyway):
    # 50 steps is ~10 s of the built-in run and minutes to an hour of a real one; save_minutes caps the loss where
    # steps are slow (long completions), and save_total_limit keeps the disk bounded (a full fine-tuning checkpoint
    # holds the weights and two AdamW states).
    save_steps: int = option(50, "checkpoint every N steps, and at the end; 0: only at the end", run_control=True)
    save_minutes: float = option(30.0, "also checkpoint when this many minutes passed since the last one; 0: off",
                                 run_control=True)
    save_total_limit: int | None = option(2, "keep the newest N checkpoints, delete older ones; none: keep all",
                                          run_control=True)
    resume: bool = option(False, "continue from the newest complete checkpoint in output_dir; the settings that "
                                 "define the run must match its own (see resume_allow_changes)", run_control=True)
    resume_allow_changes: bool = option(False, "with resume: continue although settings that define the run "
                                               "(all but the run-control ones) differ from the checkpoint's",
                                        run_control=True)
    export: bool = option(True, "save an HF model directory to output_dir/final (a LoRA adapter merged into its "
                                "base, in the dtype the run trained in)", run_control=True)
    logging_steps: int = option(1, "print one line of metrics every N steps (their means); 0: none",
                                run_control=True)
    report_to: list[str] | None = option(None, "also log to wandb and/or tensorboard", run_control=True)
    progress_bar: bool = option(True, "tqdm progress bar between the lines, when stderr is a terminal or a "
                                      "Jupyter notebook's", run_control=True)
    # Periodic evaluation with the rollout engine (fastgrpo.train.periodic_eval): this run's rewards and sampling.
    eval_steps: int = option(0, "evaluate every N steps and at the end, into output_dir/eval/; 0: off",
                             run_control=True)
    eval_dataset: str | None = option(None, "rows to evaluate on (an HF dataset or a folder: its eval_dataset_split); "
                                            "none: the built-in task's held-out rows when training on the built-in "
                                            "task", run_control=True)
    eval_dataset_split: str = option("test", "split of an HF eval_dataset, or of a folder of data files (they load as "
                                             "'train'), to evaluate on; a file is read whole, or sliced: "
                                             "'test[:100]'", run_control=True)
    eval_dataset_config: str | None = option(None, "config of an HF eval_dataset that has several; none: "
                                                   "dataset_config when eval_dataset is the run's dataset",
                                             run_control=True)
    eval_max_examples: int = option(256, "evaluate on the first N rows, one completion each", run_control=True)

    def __post_init__(self):
        coerce_fields(self)
        if self.eval_steps < 0 or self.eval_max_examples < 1:
            raise ValueError(f"eval_steps / eval_max_examples: expected >= 0 / >= 1, got {self.eval_steps} / "
                             f"{self.eval_max_examples}")
        check_eval_split(self)
        check_at_least(self, ("batch_size", "max_prompt_length", "max_completion_length", "num_iterations",
                              "num_minibatches", "micro_batch_size", "max_steps"), 1)
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
        check_choice("reward_errors", self.reward_errors, REWARD_ERRORS)
        check_choice("prompt_format", self.prompt_format, PROMPT_FORMATS)
        if not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"seed: expected an int in [0, 2**32), got {self.seed}")
        if self.stop is not None and not all(self.stop):
            raise ValueError(f"stop: expected non-empty strings (the EOS token always stops), got {self.stop!r}")
        if greedy_copies(self) is not None:  # GRPO compares sampled completions (num_generations >= 2)
            raise ValueError(f"{greedy_copies(self)}: every advantage is 0, nothing is learned; expected a finite "
                             "number > 0")
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"temperature: expected a finite number > 0, got {self.temperature}")
        self.sampling()  # the rollout's checks of top_p / top_k / min_p / repetition_penalty, before any model loads
        check_at_least(self, ("beta", "epsilon_low", "epsilon_high", "kl_max_log_step", "warmup_steps", "save_steps",
                              "logging_steps"), 0)
        check_save_minutes(self)
        check_lora_options(self)
        check_adamw_options(self)
        check_reward_names(self.reward_funcs)
        check_reward_weights(self.reward_weights)
        if not self.epsilon_low < 1:
            raise ValueError(f"epsilon_low: expected < 1 (the lower clip 1 - epsilon_low > 0), got {self.epsilon_low}")
        if self.kl_target is not None and not 0 < self.kl_target < math.inf:
            raise ValueError(f"kl_target: expected a finite number > 0 (none: fixed beta), got {self.kl_target}")
        if self.kl_target is not None and self.beta == 0:
            raise ValueError("kl_target: adaptive beta needs an initial beta > 0, got beta=0")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ValueError(f"save_total_limit: expected >= 1 or none (keep all), got {self.save_total_limit}")
        if self.resume and self.overwrite_output_dir:
            raise ValueError("overwrite_output_dir: deletes the checkpoints that resume continues from; pass one of "
                             f"{setting('resume', True)} and {setting('overwrite_output_dir', True)}")
        check_fsdp_options(self)
        check_ddp_timeout(self)
        check_4bit_base(self)
        check_loss_options(self)  # the loss fields, as fastgrpo.GRPOLossConfig checks them
        check_rollout_options(self)
        check_activation_memory_options(self)

    def sampling(self) -> SamplingParams:
        """How every rollout of the run samples: one generation config for the whole batch."""
        return SamplingParams(max_new_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty)

    @property
    def stop_strings(self) -> list[str] | None:
        return stop_strings(self.stop, self.prompt_format)


def run_control_fields(config_class: type = None) -> list[str]:
    """The fields `--resume` lets change (option(..., run_control=True)); all others define the run."""
    return [f.name for f in dataclasses.fields(config_class or GRPOConfig) if f.metadata.get("run_control")]


def config_changes(saved: dict, config) -> list[str]:
    """`name: <saved> in the checkpoint, <now> now` for each run-defining field of `config` that differs from the
    checkpoint's resolved config `saved` (a field the checkpoint predates counts with its default)."""
    changes = []
    for field in dataclasses.fields(config):
        if field.metadata.get("run_control"):
            continue
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        before, now = saved.get(field.name, default), getattr(config, field.name)
        if _plain(before) != _plain(now) and not _same_local_path(field.name, before, now) \
                and not _same_reward_files(field.name, before, now) and not _same_model(field.name, saved, now) \
                and not _same_dataset(field.name, saved, config):
            changes.append(f"{field.name}: {before!r} in the checkpoint, {now!r} now")
    return changes


def _same_model(name: str, saved: dict, now) -> bool:
    """The very base model the checkpoint's run recorded (its fingerprint), at another path: moved or copied."""
    return name == "model" and same_base(saved, now)


def _same_dataset(name: str, saved: dict, config) -> bool:
    """The very bytes the checkpoint's run read (their recorded fingerprint), at another path: moved or copied."""
    recorded = (saved.get(DATASET_FINGERPRINT_KEY) or {}).get(name)
    return recorded is not None and (recorded_dataset_fingerprint(config) or {}).get(name) == recorded


def _same_local_path(name: str, before, now) -> bool:
    """The same file or folder of an input path field (recorded absolute: ConfigFile.to_dict), spelt another way
    (data.jsonl, ./data.jsonl, its absolute path)."""
    if name not in INPUT_PATH_FIELDS or not isinstance(before, str) or not isinstance(now, str):
        return False
    return _same_file(Path(before).expanduser(), Path(now).expanduser())


def _same_file(before: Path, now: Path) -> bool:
    return before.exists() and now.exists() and before.resolve() == now.resolve()


def _same_reward_files(name: str, before, now) -> bool:
    """The same reward functions, a "path/to/file.py:function" entry's file (recorded absolute: ConfigFile.to_dict)
    spelt another way."""
    if name not in REWARD_FUNCTION_FIELDS or not isinstance(before, list) or not isinstance(now, list):
        return False
    return len(before) == len(now) and all(_same_function(name, b, n) for b, n in zip(before, now))


def _same_function(name: str, before: str, now: str) -> bool:
    if before == now:
        return True
    try:
        files = function_file(before, name), function_file(now, name)
    except ValueError:  # an unset variable: no file to compare
        return False
    return None not in files and before.rpartition(":")[2] == now.rpartition(":")[2] and _same_file(*files)


def check_4bit_base(config) -> None:
    if config.load_in_4bit and config.model is None:  # the built-in model is built, not loaded: nothing to quantize
        raise ValueError(f"load_in_4bit: quantizes the weights of {setting('model')} as they load; the built-in model "
                         f"(no {setting('model')}) has none")
    if config.load_in_4bit and config.lora_rank == 0:
        raise ValueError("load_in_4bit: a 4-bit base trains through LoRA; set lora_rank > 0")


def check_resume(saved: dict, config, checkpoint: str, warn: bool = True, base: bool = True) -> None:
    """Raise a ValueError naming every run-defining field whose value differs from the checkpoint's config `saved`;
    with config.resume_allow_changes, log them as a warning instead. Another command's run is always refused.
    base: check the base model's files too (check_resumed_base); off for a run that may load no model."""
    check_same_command(saved, config, checkpoint)
    if base:
        check_resumed_base(saved, config, checkpoint, warn)
    changes = config_changes(saved, config)
    if not changes:
        return
    if getattr(config, "resume_allow_changes", False):
        if warn:  # warn=False: a check before the model loads, which the trainer's own check repeats
            logger.warning("resume: continuing %s with changed settings: %s", checkpoint, "; ".join(changes))
        return
    raise ValueError(f"resume: {checkpoint} was made with other settings: {'; '.join(changes)}; resume with the "
                     f"run's own settings ({checkpoint}/run_config.json holds them all), or pass "
                     f"{setting('resume_allow_changes', True)} to continue with the new ones")


def check_resumed_base(saved: dict, config, checkpoint: str, warn: bool = True) -> None:
    """A ValueError where config.model is not the base model the checkpoint's run trained on (base_change: a folder
    exported again since, say); with config.resume_allow_changes, a warning instead."""
    change = base_change(saved, config.model, resuming=True, say=warn)
    if change is None:
        return
    said = f"model: {config.model} is not the base model {checkpoint} was trained on (its files changed since: " \
           f"{change})"
    if getattr(config, "resume_allow_changes", False):
        if warn:
            logger.warning("resume: continuing %s on other base weights: %s", checkpoint, said)
        return
    raise ValueError(f"{said}; pass that base (or a copy of it) as {setting('model')}, or "
                     f"{setting('resume_allow_changes', True)} to continue on these weights")


def _plain(value):
    """Lists and tuples compare alike (a config read back from JSON has lists)."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value
