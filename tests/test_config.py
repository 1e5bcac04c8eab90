"""GRPOConfig: validation naming the field, YAML loading, and one command-line flag per field."""
import argparse
import dataclasses

import pytest

from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.config_flags import add_config_arguments
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.naming import TRAINERS
from fastgrpo.train.sft_config import SFTConfig


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return vars(parser.parse_args(argv))


@pytest.mark.parametrize("fields, match", [
    (dict(num_generations=1, batch_size=4), "num_generations: expected >= 2"),
    (dict(num_generations=0), "num_generations: expected >= 2 \\(advantages compare completions"),  # one check
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
    (dict(beta=0.1, kl_target=0.0), "kl_target: expected a finite number > 0"),
    (dict(epsilon_low=-0.1), "epsilon_low: expected a finite number >= 0"),
    (dict(epsilon_low=1.0), "epsilon_low: expected < 1"),
    (dict(epsilon_high=-0.1), "epsilon_high"),
    (dict(learning_rate=-1e-6), "learning_rate"),
    (dict(learning_rate=float("inf")), "learning_rate: expected a finite number >= 0, got inf"),
    (dict(weight_decay=float("inf")), "weight_decay: expected a finite number >= 0, got inf"),
    (dict(adam_beta1=1.5), r"adam_beta1: expected a number in \[0, 1\), got 1.5"),
    (dict(adam_beta2=-1), r"adam_beta2: expected a number in \[0, 1\), got -1.0"),
    (dict(adam_beta2=float("nan")), r"adam_beta2: expected a number in \[0, 1\), got nan"),
    (dict(adam_epsilon=float("inf")), "adam_epsilon: expected a finite number >= 0, got inf"),
    (dict(adam_epsilon=-1e-8), "adam_epsilon: expected a finite number >= 0"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(kl_max_log_step=float("inf")), "kl_max_log_step: expected a finite number >= 0, got inf"),
    (dict(beta=0.1, kl_target=float("inf")), "kl_target: expected a finite number > 0"),
    (dict(reward_weights=[1.0, float("nan")]), r"reward_weights: expected finite numbers, got \[1.0, nan\]"),
    (dict(lora_rank=-1), "lora_rank"),
    (dict(lora_dropout=1.5), r"lora_dropout: expected a number in \[0, 1\), got 1.5"),
    (dict(lora_dropout=1.0), r"lora_dropout: expected a number in \[0, 1\), got 1.0"),  # PEFT's bound, but no learning
    (dict(lora_alpha=0), "lora_alpha: expected a finite number > 0, got 0"),  # scale alpha / r: adapters do nothing
    (dict(max_completion_length=0), "max_completion_length"),
    (dict(fsdp_layers_per_group=0), "fsdp_layers_per_group: expected >= 1, got 0"),
    (dict(fsdp_sync_every_micro_batch=False, fsdp_cpu_offload=True), "fsdp_sync_every_micro_batch: off keeps"),
    (dict(load_in_4bit=True, lora_rank=8), r"load_in_4bit: quantizes the weights of model as they load; the built-in "
                                           r"model \(no model\)"),
    (dict(model="/m", load_in_4bit=True), "load_in_4bit: a 4-bit base trains through LoRA"),
    (dict(seed=10**14), r"seed: expected an int in \[0, 2\*\*32\), got 100000000000000"),
    (dict(seed=-1), "seed: expected an int in"),
    (dict(stop=["</answer>", ""]), "stop: expected non-empty strings"),
    (dict(save_total_limit=0), "save_total_limit: expected >= 1 or none"),
    (dict(logging_steps=-1), "logging_steps: expected >= 0"),
    (dict(reward_errors="ignore"), "reward_errors: expected one of"),
    # the Python keywords, not the flags
    (dict(resume=True, overwrite_output_dir=True), "overwrite_output_dir: deletes the checkpoints that resume "
                                                   "continues from; pass one of resume=True and "
                                                   "overwrite_output_dir=True"),
    (dict(offload_activations=True, patch=False), r"offload_activations: .* \(pass patch=True\)"),
    (dict(learning_rate="fast"), "learning_rate: expected a number, got 'fast'"),
    (dict(max_steps=2.5), "max_steps: expected an integer, got 2.5"),
    (dict(patch="yes"), "patch: expected true or false, got 'yes'"),
    (dict(model=7), "model: expected a string, got 7"),
    (dict(reward_funcs={"a": 1}), "reward_funcs: expected a list of strings"),
])
def test_invalid_fields_raise_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**fields)


@pytest.mark.parametrize("config_class, fields, match", [
    (SFTConfig, dict(lora_dropout=1.5), r"lora_dropout: expected a number in \[0, 1\), got 1.5"),
    (EIConfig, dict(lora_alpha=-16), "lora_alpha: expected a finite number > 0, got -16"),
    (EIConfig, dict(adam_beta1=1.0), r"adam_beta1: expected a number in \[0, 1\), got 1.0"),
    (SFTConfig, dict(adam_epsilon=float("nan")), "adam_epsilon: expected a finite number >= 0, got nan"),
    (SFTConfig, dict(learning_rate=float("inf")), "learning_rate: expected a finite number >= 0, got inf"),
    (EIConfig, dict(weight_decay=float("inf")), "weight_decay: expected a finite number >= 0, got inf"),
    (SFTConfig, dict(eval_temperature=float("inf")), "eval_temperature: expected a finite number >= 0, got inf"),
    (SFTConfig, dict(fsdp_layers_per_group=0), "fsdp_layers_per_group: expected >= 1, got 0"),
    (SFTConfig, dict(fsdp_sync_every_micro_batch=False, fsdp_cpu_offload=True), "fsdp_sync_every_micro_batch: off "
                                                                                "keeps"),
    (EIConfig, dict(correct_threshold=float("nan")), "correct_threshold: expected a finite number, got nan"),
    (EvalConfig, dict(correct_threshold=float("inf")), "correct_threshold: expected a finite number, got inf"),
    (EvalConfig, dict(reward_weights=[float("nan")]), r"reward_weights: expected finite numbers, got \[nan\]"),
    (EIConfig, dict(num_generations=0), "num_generations: expected >= 1, got 0"),
    (GRPOConfig, dict(temperature=float("inf")), "temperature: expected a finite number > 0, got inf"),
])
def test_sft_ei_eval_configs_name_bad_numbers(config_class, fields, match):
    with pytest.raises(ValueError, match=match):
        config_class(**fields)


@pytest.mark.parametrize("config_class, field", [
    (GRPOConfig, "reward_funcs"), (EIConfig, "reward_funcs"), (EvalConfig, "reward_funcs"),
    (SFTConfig, "eval_reward_funcs"),
])
@pytest.mark.parametrize("names", [[], ["length", " "]])
def test_no_reward_names_is_refused_with_the_config(config_class, field, names, tmp_path):
    """`reward_funcs: []` (or --reward-funcs with no name) failed only once the data had loaded, where the names
    are resolved; now the config refuses it, naming the file that gave it."""
    path = tmp_path / "run.yaml"
    path.write_text(f"{field}: {names}\n")
    with pytest.raises(ValueError) as info:
        config_class.from_yaml(path)
    assert str(info.value) == (f"{field} (from {path}): expected one or more reward names "
                               "(fastgrpo.rewards.REGISTRY's, module:function or path/to/file.py:function), got "
                               f"{names!r}")


def test_greedy_train_with_a_group_is_refused_naming_both_settings():
    """temperature 0 decodes greedily: a group's completions are one, every advantage 0 (train needs >= 2)."""
    with pytest.raises(ValueError) as info:
        GRPOConfig(temperature=0.0, num_generations=4, batch_size=8)
    assert str(info.value) == ("temperature: 0 samples greedily: with num_generations=4 the completions of a prompt "
                               "are identical: every advantage is 0, nothing is learned; expected a finite number > 0")


def test_greedy_eval_of_several_samples_is_refused_naming_both_settings():
    with pytest.raises(ValueError) as info:
        EvalConfig(temperature=0.0, num_generations=8)
    assert str(info.value) == ("temperature: 0 samples greedily: with num_generations=8 the completions of a prompt "
                               "are identical (pass@8 would be pass@1); for greedy pass num_generations=1, or a "
                               "temperature > 0")
    assert EvalConfig(temperature=0.0).num_generations == 1  # greedy evaluation itself


def test_greedy_ei_with_several_samples_warns(caplog):
    """ei keeps one of a question's identical completions (the repeats are dropped): the rounds of num_generations 1,
    at G times the sampling; a warning, nothing is lost."""
    with caplog.at_level("WARNING", logger="fastgrpo"):
        EIConfig(temperature=0.0, num_generations=4)
        EIConfig(temperature=0.0, num_generations=1)
        EIConfig(temperature=0.5, num_generations=4)
    assert [r.getMessage() for r in caplog.records] == [
        "temperature: 0 samples greedily: with num_generations=4 the completions of a prompt are identical, and a "
        "round keeps one of them; num_generations=1 samples the same rounds in 1/4 of the time"]


def test_inf_where_it_means_off():
    """max_grad_norm inf: no clipping (nothing else turns it off); save_minutes inf: never by time, as 0."""
    for config_class in (GRPOConfig, SFTConfig):
        config = config_class(max_grad_norm=float("inf"), save_minutes=float("inf"))
        assert config.max_grad_norm == config.save_minutes == float("inf")
    assert EIConfig(num_generations=1, max_grad_norm=float("inf")).num_generations == 1  # no group: G = 1 is fine


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 2.0e-5\nreward_funcs: [r1_zero_math, length]\nreward_weights: [1.0, 0.1]\n"
                    "beta: 0.04\nstop: null\n")
    config = GRPOConfig.from_yaml(path, max_steps=7)
    assert config.learning_rate == 2e-5 and config.reward_funcs == ["r1_zero_math", "length"]
    assert config.reward_weights == [1.0, 0.1] and config.beta == 0.04 and config.max_steps == 7


def test_yaml_numeric_strings_take_the_field_type(tmp_path):
    path = tmp_path / "run.yaml"
    # PyYAML (YAML 1.1) reads 1e-6 and 5e3 as strings: a float needs a dot there
    path.write_text("learning_rate: 1e-6\nmax_steps: 5e3\nseed: '7'\nreward_weights: [1, '2e-1']\nstop: </a>\n")
    config = GRPOConfig.from_yaml(path)
    assert (config.learning_rate, config.max_steps, config.seed) == (1e-6, 5000, 7)
    assert type(config.max_steps) is int and config.reward_weights == [1.0, 0.2] and config.stop == ["</a>"]
    path.write_text("beta: [0.1\n")
    with pytest.raises(ValueError, match=rf"config: {path}:2:1: malformed YAML"):
        GRPOConfig.from_yaml(path)
    with pytest.raises(ValueError, match=f"config: no such file {tmp_path / 'none.yaml'}"):
        GRPOConfig.from_yaml(tmp_path / "none.yaml")


@pytest.mark.parametrize("saved_by", ["train", "sft", "ei"])
@pytest.mark.parametrize("resumed_by", ["train", "sft", "ei"])
def test_resume_refuses_another_commands_run(saved_by, resumed_by):
    from fastgrpo.train.config import check_resume
    from fastgrpo.train.ei_config import EIConfig
    from fastgrpo.train.run_kind import MARKERS
    from fastgrpo.train.sft_config import SFTConfig

    configs = {"train": GRPOConfig, "sft": SFTConfig, "ei": EIConfig}
    marker = MARKERS[saved_by]  # a field of that command's config, and of no other's
    assert [name for name, c in configs.items() if marker in {f.name for f in dataclasses.fields(c)}] == [saved_by]
    saved = configs[saved_by]().to_dict()
    if saved_by == resumed_by:
        del saved["seed"]  # an older checkpoint of the same command: a field it predates is no other command's
        check_resume(saved, configs[resumed_by](resume_allow_changes=True), "checkpoint-3")
        return
    with pytest.raises(ValueError, match=rf"resume: checkpoint-3 is a `fastgrpo {saved_by}` run, not a `fastgrpo "
                                         rf"{resumed_by}` run; continue it with fastgrpo.{TRAINERS[saved_by]} with "
                                         r"resume=True, or pick another output_dir"):
        check_resume(saved, configs[resumed_by](resume_allow_changes=True), "checkpoint-3")


def test_resume_compares_the_run_defining_fields():
    from fastgrpo.train.config import config_changes, run_control_fields

    saved = GRPOConfig().to_dict()
    assert config_changes(saved, GRPOConfig()) == []
    changed = GRPOConfig(learning_rate=0.5, seed=3, max_steps=7, save_steps=3, logging_steps=5, output_dir="x")
    assert config_changes(saved, changed) == ["learning_rate: 1e-06 in the checkpoint, 0.5 now",
                                              "seed: 0 in the checkpoint, 3 now"]
    # What may change: how the run is carried out and reported, not what it computes.
    control = set(run_control_fields())
    assert {"max_steps", "save_steps", "logging_steps", "output_dir", "resume", "micro_batch_size"} <= control
    assert not {"model", "dataset", "reward_funcs", "seed", "learning_rate", "beta", "loss_type", "temperature",
                "num_generations", "batch_size", "max_completion_length", "lora_rank", "dtype"} & control
    # A checkpoint older than a field counts with the field's default.
    del saved["top_k"]
    assert config_changes(saved, GRPOConfig()) == [] and config_changes(saved, GRPOConfig(top_k=5)) == [
        "top_k: 0 in the checkpoint, 5 now"]


def test_yaml_unknown_key_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rte: 1.0\nzzz: 1\n")
    with pytest.raises(ValueError) as info:
        GRPOConfig.from_yaml(path)
    assert str(info.value) == (f"config: {path}: unknown fields for `fastgrpo train`: 'learning_rte' (did you mean "
                               "learning_rate?), 'zzz'; see `fastgrpo train --help`")
    with pytest.raises(ValueError) as info:
        SFTConfig.from_dict({"max_seq_len": 8})
    assert str(info.value) == ("config: unknown field 'max_seq_len' for `fastgrpo sft` (did you mean "
                               "max_seq_length?); see `fastgrpo sft --help`")
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        GRPOConfig.from_yaml(path)


@pytest.mark.parametrize("command, text, message", [
    ("ei", "max_steps: 3\n", "config: unknown field 'max_steps' for `fastgrpo ei` (a `fastgrpo train` / `fastgrpo "
                             "sft` setting; ei counts rounds with ei_steps); see `fastgrpo ei --help`"),
    ("train", "ei_steps: 3\nlearning_rte: 1\n", "config: unknown fields for `fastgrpo train`: 'ei_steps' (a "
     "`fastgrpo ei` setting; train counts optimizer steps with max_steps), 'learning_rte' (did you mean "
     "learning_rate?); see `fastgrpo train --help`"),
    ("sft", "max_completion_length: 64\n", "config: unknown field 'max_completion_length' for `fastgrpo sft` (a "
     "`fastgrpo train` / `fastgrpo ei` setting; sft bounds prompt + response with max_seq_length); see `fastgrpo sft "
     "--help`"),
    ("eval", "eval_steps: 5\n", "config: unknown field 'eval_steps' for `fastgrpo eval` (a `fastgrpo train` / "
                                "`fastgrpo sft` / `fastgrpo ei` setting); see `fastgrpo eval --help`"),
])
def test_yaml_key_of_another_command_names_that_command(command, text, message, tmp_path):
    from fastgrpo.train.commands import CONFIGS

    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        CONFIGS[command].file_settings(str(path))
    assert str(info.value) == message.replace("config: ", f"config: {path}: ", 1)


def test_counterparts_are_fields_of_their_commands():
    from fastgrpo.train.command_fields import COUNTERPARTS, fields

    for row in COUNTERPARTS:
        for command, (_, names) in row.items():
            assert set(names) <= fields(command), (command, names)


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
