"""Which command a config key belongs to: the fixed table of every command's fields (command_fields.FIELDS, which
GRPOConfig.from_dict can read where it cannot import the configs built on its fields) is checked against the configs
here, and from Python a key of another command is named as the CLI names it."""
import dataclasses

import pytest

from fastgrpo.train.command_fields import FIELDS, fields
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.sft_config import SFTConfig

CONFIGS = {"train": GRPOConfig, "sft": SFTConfig, "ei": EIConfig, "eval": EvalConfig}


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
        "config: unknown fields for `fastgrpo train`: 'max_seq_length' (a `fastgrpo sft` setting; train bounds a "
        "sequence with max_prompt_length and max_completion_length), 'num_epochs' (a `fastgrpo sft` setting); see "
        "`fastgrpo train --help`")


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
