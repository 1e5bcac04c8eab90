"""GRPOConfig: validation naming the field, YAML loading, and one command-line flag per field."""
import argparse
import dataclasses

import pytest

from fastgrpo.train.config import GRPOConfig, add_config_arguments


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return vars(parser.parse_args(argv))


@pytest.mark.parametrize("fields, match", [
    (dict(num_generations=1, batch_size=4), "num_generations: expected >= 2"),
    (dict(batch_size=60, num_generations=8), "batch_size: expected a multiple of num_generations"),
    (dict(batch_size=16, num_generations=4, num_minibatches=3), "num_minibatches: expected a divisor"),
    (dict(batch_size=16, num_generations=4, micro_batch_size=3), "micro_batch_size: expected a divisor"),
    (dict(loss_type="ppo"), "loss_type: expected one of"),
    (dict(scale_rewards="yes"), "scale_rewards"),
    (dict(lr_scheduler="step"), "lr_scheduler"),
    (dict(temperature=0.0), "temperature"),
    (dict(top_p=1.5), "top_p: expected a number in \\(0, 1\\]"),
    (dict(top_k=-1), "top_k: expected an int >= 0"),
    (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(beta=-1.0), "beta"),
    (dict(kl_target=0.1), "kl_target"),
    (dict(beta=0.1, kl_target=0.0), "kl_target: expected > 0"),
    (dict(epsilon_low=-0.1), "epsilon_low: expected >= 0"),
    (dict(epsilon_low=1.0), "epsilon_low: expected < 1"),
    (dict(epsilon_high=-0.1), "epsilon_high"),
    (dict(learning_rate=-1e-6), "learning_rate"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(lora_rank=-1), "lora_rank"),
    (dict(max_completion_length=0), "max_completion_length"),
    (dict(load_in_4bit=True), "load_in_4bit"),
])
def test_invalid_fields_raise_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**fields)


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 2.0e-5\nreward_funcs: [r1_zero_math, length]\nreward_weights: [1.0, 0.1]\n"
                    "beta: 0.04\nstop: null\n")
    config = GRPOConfig.from_yaml(path, max_steps=7)
    assert config.learning_rate == 2e-5 and config.reward_funcs == ["r1_zero_math", "length"]
    assert config.reward_weights == [1.0, 0.1] and config.beta == 0.04 and config.max_steps == 7


def test_yaml_unknown_key_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rte: 1.0\n")
    with pytest.raises(ValueError, match="learning_rte"):
        GRPOConfig.from_yaml(path)
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        GRPOConfig.from_yaml(path)


def test_every_field_is_a_flag():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(GRPOConfig)} <= flags
    assert all(f.metadata.get("help") for f in dataclasses.fields(GRPOConfig))
    assert GRPOConfig().reward_funcs is not GRPOConfig().reward_funcs  # list defaults are not shared


def test_flags_parse_to_field_types():
    args = _parse(["--learning-rate", "3e-4", "--num-generations", "4", "--reward-funcs", "length", "ifeval",
                   "--reward-weights", "1", "0.5", "--no-patch", "--resume", "--delta", "2.5", "--kl-target",
                   "none", "--model", "/m"])
    assert args == dict(learning_rate=3e-4, num_generations=4, reward_funcs=["length", "ifeval"],
                        reward_weights=[1.0, 0.5], patch=False, resume=True, delta=2.5, kl_target=None, model="/m")
    assert _parse([]) == {}  # unset flags stay absent, so YAML values are not overwritten by defaults
    GRPOConfig.from_dict(args)


def test_bad_flag_value_is_an_error():
    with pytest.raises(SystemExit):
        _parse(["--num-generations", "four"])
