"""Which command a setting belongs to, for the one-line error of a YAML key or flag given to another command:
`max_steps` under `fastgrpo ei` is 'a `fastgrpo train` / `fastgrpo sft` setting; ei counts rounds with ei_steps'
(a close match would name save_steps); and the other notes on a key that is no field (unknown_key_notes): a name
TRL's configs use, a nested section.

FIELDS is every command's fields written out, not read from the configs: ConfigFile.from_dict (which GRPOConfig has)
names the command of a key from it, and it cannot import the configs built on GRPOConfig's fields (a cycle).
tests/test_config_commands.py checks it against the configs, so a field added to a config and not here fails there.
"""
from __future__ import annotations

from fastgrpo.train.naming import flag

# Fields by the commands that have them (each command's config lists them in its own order).
_OWNERS = {
    ("train", "sft", "ei", "eval", "export"): ("model", "dtype", "device", "output_dir", "overwrite_output_dir"),
    ("train", "sft", "ei", "eval"): ("dataset", "dataset_split", "dataset_config", "prompt_column", "prompt_format",
                                     "batch_size", "seed", "reward_errors", "ddp_timeout"),
    ("train", "sft", "ei"): (
        "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit", "patch",
        "gradient_checkpointing", "fsdp_cpu_offload", "fsdp_reshard_after_forward", "fsdp_sync_every_micro_batch",
        "fsdp_layers_per_group", "offload_activations", "recompute_layers", "fp8_base", "offload_host_memory_gib",
        "micro_batch_size", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
        "max_grad_norm", "lr_scheduler", "warmup_steps", "save_steps", "save_total_limit", "resume",
        "resume_allow_changes", "export", "logging_steps", "report_to", "progress_bar", "eval_steps", "eval_dataset",
        "eval_dataset_split", "eval_dataset_config", "eval_max_examples"),
    ("train", "ei", "eval"): ("reward_funcs", "reward_weights", "num_generations", "temperature", "top_p", "stop"),
    ("train", "ei"): ("max_prompt_length", "truncate_prompts", "max_completion_length"),
    ("train", "sft"): ("max_steps", "save_minutes"),
    ("ei", "eval"): ("correct_threshold",),
    ("train",): (
        "top_k", "min_p", "repetition_penalty", "rollout_engine", "rollout_attention",
        "rollout_weights", "rollout_kv_cache", "vllm_gpu_memory_utilization", "vllm_lora_sync", "vllm_execution",
        "num_iterations", "num_minibatches", "loss_type", "importance_sampling_level", "epsilon_low", "epsilon_high",
        "delta", "scale_rewards", "beta", "kl_target", "kl_max_log_step", "sapo_temperature_pos",
        "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
        "top_entropy_quantile", "off_policy_mask_threshold", "use_bias_correction_kl", "entropy_coef",
        "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
        "mask_truncated_completions", "multi_objective_aggregation", "rollout_correction", "rollout_correction_level",
        "rollout_correction_clip_min", "rollout_correction_clip_max"),
    ("sft",): ("response_column", "max_seq_length", "truncate_sequences", "num_epochs", "eval_reward_funcs",
               "eval_max_new_tokens", "eval_temperature"),
    ("ei",): ("questions_per_step", "generation_batch_size", "sft_epochs", "ei_steps"),
    ("eval", "export"): ("checkpoint",),
    ("eval",): ("max_examples", "max_new_tokens", "log_generations"),
}
FIELDS = {command: frozenset(name for owners, names in _OWNERS.items() if command in owners for name in names)
          for command in ("train", "sft", "ei", "eval", "export")}

# One setting under each command's own name(s): {command: (what the command does, with the fields)}. A key that is
# another command's field of a row is answered with this command's entry of the first such row.
_STEPS = ("counts optimizer steps with", ("max_steps",))
_LENGTHS = ("bounds a sequence with", ("max_prompt_length", "max_completion_length"))
_TRUNCATE_PROMPTS = ("left-truncates long prompts with", ("truncate_prompts",))
_NEW_TOKENS = ("caps generated tokens with", ("max_completion_length",))
_EVAL_ROWS = ("evaluates the first N rows with", ("eval_max_examples",))
_EVAL_DATA = ("evaluates on", ("eval_dataset",))
_EVAL_CONFIG = ("names its eval dataset's config with", ("eval_dataset_config",))
COUNTERPARTS = (
    {"train": _STEPS, "sft": _STEPS, "ei": ("counts rounds with", ("ei_steps",))},
    {"sft": ("counts passes over the data with", ("num_epochs",)),
     "ei": ("counts passes over each round's completions with", ("sft_epochs",))},
    {"train": _LENGTHS, "ei": _LENGTHS, "sft": ("bounds prompt + response with", ("max_seq_length",))},
    {"train": _NEW_TOKENS, "ei": _NEW_TOKENS, "eval": ("caps generated tokens with", ("max_new_tokens",)),
     "sft": ("caps its evaluation's generated tokens with", ("eval_max_new_tokens",))},
    {"train": _TRUNCATE_PROMPTS, "ei": _TRUNCATE_PROMPTS,
     "sft": ("truncates long rows with", ("truncate_sequences",))},
    {"train": _EVAL_ROWS, "sft": _EVAL_ROWS, "ei": _EVAL_ROWS, "eval": ("evaluates the first N rows with",
                                                                      ("max_examples",))},
    {"train": ("samples at", ("temperature",)), "ei": ("samples at", ("temperature",)),
     "eval": ("samples at", ("temperature",)), "sft": ("samples its evaluation at", ("eval_temperature",))},
    {"train": ("scores with", ("reward_funcs",)), "ei": ("scores with", ("reward_funcs",)),
     "eval": ("scores with", ("reward_funcs",)), "sft": ("scores its evaluation with", ("eval_reward_funcs",))},
    {"train": _EVAL_DATA, "sft": _EVAL_DATA, "ei": _EVAL_DATA, "eval": ("evaluates on", ("dataset",))},
    {"train": _EVAL_CONFIG, "sft": _EVAL_CONFIG, "ei": _EVAL_CONFIG,
     "eval": ("names its dataset's config with", ("dataset_config",))},
    {"ei": ("sets the questions per rollout call with", ("generation_batch_size",)),
     "eval": ("sets the prompts per rollout call with", ("batch_size",))},
)


# Names TRL's configs (a TrlParser YAML) give settings that fastgrpo names otherwise, where a close match would miss or
# mislead (num_train_epochs -> num_iterations): {TRL's name: (fastgrpo's fields, the first a command has, and how)}.
TRL_NAMES = {
    "lr": (("learning_rate",), ""),
    "model_name_or_path": (("model",), ""),
    "bf16": (("dtype",), ": bfloat16"),
    "fp16": (("dtype",), ": float16"),
    "use_peft": (("lora_rank",), " > 0"),
    "use_vllm": (("rollout_engine",), ": vllm"),
    "num_train_epochs": (("num_epochs", "sft_epochs", "max_steps"), ""),
    "steps_per_generation": (("num_minibatches",), " (optimizer steps per rollout batch)"),
    "gradient_accumulation_steps": (("micro_batch_size",), " (gradients accumulate over a step's micro-batches)"),
    "use_liger_kernel": (("patch",), " (on by default: fastgrpo's own fused kernels; the loss is fused always)"),
    "vllm_mode": (("rollout_engine",), ": vllm, always colocated: in this process, no server mode"),
    "dataset_text_field": (("prompt_column",), ""),  # a close match said dataset_config; sft: TRL_WITHOUT
    "dataset_test_split": (("eval_dataset_split",), ""),  # a close match said dataset_split
    "data_seed": (("seed",), ""),  # a close match said dataset
    "epsilon": (("epsilon_low",), " (and the upper clip, epsilon_high: TRL's epsilon sets both)"),
    "warmup_ratio": (("warmup_steps",), " (in optimizer steps, not a fraction of the run)"),
    "resume_from_checkpoint": (("resume",), " (the newest complete checkpoint in output_dir)"),
    "activation_offloading": (("offload_activations",), ""),
    "vllm_importance_sampling_correction": (("rollout_correction",), ": truncate or mask"),  # not the ratio's level
    "vllm_importance_sampling_mode": (("rollout_correction",), " (truncate or mask; token or sequence: "
                                                               "rollout_correction_level)"),
    "vllm_importance_sampling_cap": (("rollout_correction_clip_max",), ""),
    # rollouts' completions are not logged; an evaluation's are (a close match said max_completion_length)
    "log_completions": (("eval_steps", "log_generations"), " (an evaluation's completions: every one in its JSONL "
                                                           "file, a few printed to the log)"),
    "generation_batch_size": (("batch_size",), " (the completions of one rollout batch)"),  # TRL GRPOConfig's
    # HF TrainingArguments' and TRL's ScriptArguments' names, which no close match found
    "per_device_train_batch_size": (("micro_batch_size",), " (per forward/backward; a step's rows: batch_size)"),
    "dataset_name": (("dataset",), ""),
    "eval_strategy": (("eval_steps",), " (N > 0: every N, and at the end; 0: off)"),
    "save_strategy": (("save_steps",), " (N > 0: every N, and at the end; 0: only at the end)"),
    "logging_strategy": (("logging_steps",), ""),
}
# TRL_NAMES keys that mean their field only under these commands (elsewhere another command's field, or another
# meaning): ei's own generation_batch_size counts questions per engine call, eval's batch_size prompts per call.
TRL_COMMANDS = {"generation_batch_size": ("train",)}

# TRL's names of what fastgrpo does in one way only, or not at all, by command: {TRL's name: (commands, why)}.
_NO_PACKING = "no packing here: a step's rows are sorted by length into micro-batches, each padded to its longest"
TRL_WITHOUT = {
    "packing": (("sft",), _NO_PACKING),
    "padding_free": (("sft",), _NO_PACKING),
    "dataset_text_field": (("sft",), "a column named text is read as plain text, trained on every token"),
    "completion_only_loss": (("sft",), "the loss is on the response tokens always"),
    "assistant_only_loss": (("sft",), "the loss is on the last assistant turn always"),
    "optim": (("train", "sft", "ei"), "AdamW always: fused on CUDA, foreach on the CPU"),
    "deepspeed": (("train", "sft", "ei"), "no DeepSpeed here: full fine-tuning under torchrun shards with FSDP2"),
}


def fields(command: str) -> frozenset[str]:
    return FIELDS[command]


def elsewhere(name: str, command: str, as_flag: bool = False) -> str | None:
    """For a field `name` that `command`'s config lacks and others have: 'a `fastgrpo train` setting; ei counts
    rounds with ei_steps' (as_flag: 'a `fastgrpo train` flag; ei counts rounds with --ei-steps'); None otherwise."""
    owners = [other for other in FIELDS if other != command and name in fields(other)]
    if name in fields(command) or not owners:
        return None
    note = f"a {' / '.join(f'`fastgrpo {owner}`' for owner in owners)} {'flag' if as_flag else 'setting'}"
    for row in COUNTERPARTS:
        if command in row and any(name in names for _, names in row.values()):
            does, names = row[command]
            return f"{note}; {command} {does} {' and '.join(flag(n) if as_flag else n for n in names)}"
    return note


def trl_counterpart(name: str, command: str) -> tuple[str, str] | None:
    """For a TRL_NAMES key: (the field of `command` that does its job, how: ": bfloat16", " > 0", " (a note)", "");
    None for another name, or where `command` has no such field or TRL_WITHOUT says why it needs none."""
    if trl_without(name, command) is not None or command not in TRL_COMMANDS.get(name, (command,)):
        return None
    ours, how = TRL_NAMES.get(name, ((), ""))
    field = next((f for f in ours if f in fields(command)), None)
    return (field, how) if field is not None else None


def trl_without(name: str, command: str) -> str | None:
    """For a TRL_WITHOUT key of `command`: "TRL's name; AdamW always: ..."; None otherwise."""
    commands, why = TRL_WITHOUT.get(name, ((), ""))
    return f"TRL's name; {why}" if command in commands else None


def trl_name(name: str, command: str) -> str | None:
    """For a TRL_NAMES key: "TRL's name; here dtype: bfloat16" where `command` has the setting; for a TRL_WITHOUT
    one, why it needs none; None otherwise."""
    found = trl_counterpart(name, command)
    return f"TRL's name; here {found[0]}{found[1]}" if found is not None else trl_without(name, command)


def unknown_key_notes(data: dict, command: str) -> dict[str, str]:
    """check_known_fields' notes on the keys of `data`: a field spelt as its flag (`learning-rate`), another
    command's field (elsewhere), a TRL name, or a section of fields (`optimizer: {learning_rate: ...}`); a key with
    dashes gets the note of its name with underscores."""
    notes = {key: _key_note(key.replace("-", "_") if isinstance(key, str) else key, value, command)
             for key, value in data.items()}
    return {key: note for key, note in notes.items() if note is not None}


def _key_note(name, value, command: str) -> str | None:
    if name in fields(command):  # only a dashed key gets here: its field's own name is no unknown key
        return f"write {name}: a key is the field's name, with underscores"
    return trl_name(name, command) or elsewhere(name, command) or _nested(value, command)  # the CLI's order


def _nested(value, command: str) -> str | None:
    nested = [name for name in value if name in fields(command)] if isinstance(value, dict) else []
    listed = ", ".join(nested[:3]) + (", ..." if len(nested) > 3 else "")  # a whole config nested: one line still
    return f"a config is flat: write {listed} at the top level" if nested else None
