"""Which command a config key belongs to: the fixed table of every command's fields (command_fields.FIELDS, which
GRPOConfig.from_dict can read where it cannot import the configs built on its fields) is checked against the configs
here, and from Python a key of another command is named as the CLI names it."""
import dataclasses

import pytest

from fastgrpo.train.command_fields import FIELDS, fields
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.export_config import ExportConfig
from fastgrpo.train.sft_config import SFTConfig

CONFIGS = {"train": GRPOConfig, "sft": SFTConfig, "ei": EIConfig, "eval": EvalConfig, "export": ExportConfig}


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_the_table_is_each_commands_config(command):
    config = CONFIGS[command]
    assert config.COMMAND == command
    assert fields(command) == {f.name for f in dataclasses.fields(config)}
    assert set(FIELDS) == set(CONFIGS)


def test_from_yaml_names_the_command_a_key_belongs_to(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("max_seq_length: 512\nnum_epochs: 2\n")
    with pytest.raises(ValueError) as info:
        GRPOConfig.from_yaml(path)
    assert str(info.value) == (
        f"config: {path}: unknown fields for `fastgrpo train`: 'max_seq_length' (a `fastgrpo sft` setting; train "
        "bounds a sequence with max_prompt_length and max_completion_length), 'num_epochs' (a `fastgrpo sft` "
        "setting); see `fastgrpo train --help`")


@pytest.mark.parametrize("config, data, message", [
    (SFTConfig, {"beta": 0.1}, "config: unknown field 'beta' for `fastgrpo sft` (a `fastgrpo train` setting); see "
                               "`fastgrpo sft --help`"),
    (EIConfig, {"max_steps": 3}, "config: unknown field 'max_steps' for `fastgrpo ei` (a `fastgrpo train` / "
                                 "`fastgrpo sft` setting; ei counts rounds with ei_steps); see `fastgrpo ei --help`"),
    (EvalConfig, {"max_completion_length": 8}, "config: unknown field 'max_completion_length' for `fastgrpo eval` (a "
     "`fastgrpo train` / `fastgrpo ei` setting; eval caps generated tokens with max_new_tokens); see `fastgrpo eval "
     "--help`"),
    (GRPOConfig, {"learning_rte": 1.0}, "config: unknown field 'learning_rte' for `fastgrpo train` (did you mean "
                                        "learning_rate?); see `fastgrpo train --help`"),
])
def test_from_dict_names_the_command_a_key_belongs_to(config, data, message):
    with pytest.raises(ValueError) as info:
        config.from_dict(data)
    assert str(info.value) == message


_COMPLETIONS_LOGGED = "(an evaluation's completions: every one in its JSONL file, a few printed to the log)"


@pytest.mark.parametrize("config, key, note", [
    (GRPOConfig, "lr", "TRL's name; here learning_rate"),
    (SFTConfig, "model_name_or_path", "TRL's name; here model"),
    (GRPOConfig, "bf16", "TRL's name; here dtype: bfloat16"),
    (EvalConfig, "fp16", "TRL's name; here dtype: float16"),
    (EIConfig, "use_peft", "TRL's name; here lora_rank > 0"),
    (GRPOConfig, "use_vllm", "TRL's name; here rollout_engine: vllm"),
    (SFTConfig, "num_train_epochs", "TRL's name; here num_epochs"),  # not max_steps: sft has both
    (GRPOConfig, "num_train_epochs", "TRL's name; here max_steps"),  # a close match said num_iterations
    (GRPOConfig, "steps_per_generation", "TRL's name; here num_minibatches (optimizer steps per rollout batch)"),
    (SFTConfig, "gradient_accumulation_steps", "TRL's name; here micro_batch_size (gradients accumulate over a "
                                               "step's micro-batches)"),

    (SFTConfig, "use_liger_kernel", "TRL's name; here patch (on by default: fastgrpo's own fused kernels; the loss is "
                                    "fused always)"),
    (GRPOConfig, "vllm_mode", "TRL's name; here rollout_engine: vllm, always colocated: in this process, no server "
                              "mode"),
    (GRPOConfig, "dataset_text_field", "TRL's name; here prompt_column"),  # a close match said dataset_config
    (SFTConfig, "dataset_text_field", "TRL's name; a column named text is read as plain text, trained on every "
                                      "token"),
    (SFTConfig, "packing", "TRL's name; no packing here: a step's rows are sorted by length into micro-batches, "
                           "each padded to its longest"),
    (SFTConfig, "dataset_test_split", "TRL's name; here eval_dataset_split"),  # a close match said dataset_split
    (GRPOConfig, "epsilon", "TRL's name; here epsilon_low (and the upper clip, epsilon_high: TRL's epsilon sets "
                            "both)"),
    (GRPOConfig, "vllm_importance_sampling_correction", "TRL's name; here rollout_correction: truncate or mask"),
    (EIConfig, "deepspeed", "TRL's name; no DeepSpeed here: full fine-tuning under torchrun shards with FSDP2"),
    # a close match said max_completion_length
    (GRPOConfig, "log_completions", f"TRL's name; here eval_steps {_COMPLETIONS_LOGGED}"),
    (EvalConfig, "log_completions", f"TRL's name; here log_generations {_COMPLETIONS_LOGGED}"),
    # TRL's meaning under train: it said "a `fastgrpo ei` setting", whose generation_batch_size counts questions
    (GRPOConfig, "generation_batch_size", "TRL's name; here batch_size (the completions of one rollout batch)"),
    (EvalConfig, "generation_batch_size", "a `fastgrpo ei` setting; eval sets the prompts per rollout call with "
                                          "batch_size"),
])
def test_a_trl_name_names_fastgrpos(config, key, note, tmp_path):
    """A TrlParser YAML's keys that a close match would miss or mislead on name the setting that does it here."""
    path = tmp_path / "trl.yaml"
    path.write_text(f"{key}: 1\n")
    with pytest.raises(ValueError) as info:
        config.from_yaml(path)
    assert f"'{key}' for `fastgrpo {config.COMMAND}` ({note}); see" in str(info.value)


def test_a_trl_name_of_what_a_command_lacks_has_no_note():
    with pytest.raises(ValueError) as info:
        SFTConfig.from_dict({"use_vllm": True})
    assert str(info.value) == "config: unknown field 'use_vllm' for `fastgrpo sft`; see `fastgrpo sft --help`"


def test_trl_names_name_fields_and_are_none():
    from fastgrpo.train.command_fields import TRL_COMMANDS, TRL_NAMES, TRL_WITHOUT

    ours = set().union(*FIELDS.values())
    for name, (fields_, _) in TRL_NAMES.items():  # one limited to some commands: none of theirs
        theirs = set().union(*(FIELDS[c] for c in TRL_COMMANDS[name])) if name in TRL_COMMANDS else ours
        assert name not in theirs and set(fields_) <= ours, name
    for name, (commands, _) in TRL_WITHOUT.items():
        assert name not in ours and set(commands) <= set(FIELDS), name


def test_a_nested_mapping_of_fields_says_the_configs_are_flat(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  learning_rate: 1.0e-5\n  weight_decay: 0.1\n  betas: [0.9, 0.99]\n")
    with pytest.raises(ValueError) as info:
        SFTConfig.from_yaml(path)
    assert str(info.value) == (f"config: {path}: unknown field 'optimizer' for `fastgrpo sft` (a config is flat: write "
                               "learning_rate, weight_decay at the top level); see `fastgrpo sft --help`")


def test_a_nested_whole_config_is_named_in_a_short_note():
    with pytest.raises(ValueError) as info:
        EvalConfig.from_dict({"config": EvalConfig().to_dict()})  # summary.json's section, say
    assert str(info.value) == ("config: unknown field 'config' for `fastgrpo eval` (a config is flat: write model, "
                               "checkpoint, dataset, ... at the top level); see `fastgrpo eval --help`")


@pytest.mark.parametrize("config, key, note", [
    (GRPOConfig, "learning-rate", "write learning_rate: a key is the field's name, with underscores"),
    (SFTConfig, "max-seq-length", "write max_seq_length: a key is the field's name, with underscores"),
    (GRPOConfig, "max-seq-length", "a `fastgrpo sft` setting; train bounds a sequence with max_prompt_length and "
                                   "max_completion_length"),
    (GRPOConfig, "num-train-epochs", "TRL's name; here max_steps"),  # a close match said num_iterations
    (EIConfig, "use-peft", "TRL's name; here lora_rank > 0"),
])
def test_a_key_spelt_as_its_flag_with_dashes_names_the_field(config, key, note, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"{key}: 1\n")
    with pytest.raises(ValueError) as info:
        config.from_yaml(path)
    assert str(info.value) == (f"config: {path}: unknown field '{key}' for `fastgrpo {config.COMMAND}` ({note}); see "
                               f"`fastgrpo {config.COMMAND} --help`")
