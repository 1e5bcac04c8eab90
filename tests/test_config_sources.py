"""Where a refused setting came from: a config file (named), a flag (its name alone), a built-in preset or the default,
as the one line `fastgrpo <command>` prints it; a file's setting is named also where the run refuses it later."""
import json

import pytest

from fastgrpo.train.cli import main
from fastgrpo.train.commands import CONFIGS
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.sft_config import SFTConfig


def _error(argv, capsys) -> str:
    """The one line `fastgrpo ...` prints for bad input (exit 2), without its "fastgrpo <command>: error: "."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.removesuffix("\n").split(": error: ", 1)[1]


@pytest.fixture
def out(tmp_path):
    return ["--output-dir", str(tmp_path / "out")]


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
def test_a_value_the_file_gave_names_the_file(command, tmp_path, out, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: -1\nseed: 1\n")
    assert _error([command, "--config", str(path), *out], capsys) == (
        f"learning_rate (from {path}): expected a finite number >= 0, got -1.0")


def test_a_flag_over_the_files_key_is_named_as_the_flag(tmp_path, out, capsys):
    """The flag's value is the one refused: the file, which set the same key, is not where to change it."""
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 1.0e-5\n")
    assert _error(["train", "--config", str(path), "--learning-rate", "-2", *out], capsys) == (
        "learning_rate: expected a finite number >= 0, got -2.0")
    path.write_text("learning_rate: -1\n")  # the file's bad value, replaced by a good flag: no error from it
    assert _error(["train", "--config", str(path), "--learning-rate", "0.1", "--max-steps", "0", *out], capsys) == (
        "max_steps: expected >= 1, got 0")


def test_a_value_the_user_never_set_says_so(out, capsys):
    """--num-generations 3 refuses a batch size the user did not give: the preset's, or the default."""
    assert _error(["train", "--num-generations", "3", *out], capsys) == (
        "batch_size (the built-in model's setting): expected a multiple of num_generations (3), got 64")
    assert _error(["train", "--model", "/m", "--num-generations", "3", *out], capsys) == (
        "batch_size (the default): expected a multiple of num_generations (3), got 64")


def test_an_error_about_two_settings_names_each_ones_source(tmp_path, out, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("eval_max_examples: 0\n")
    assert _error(["train", "--config", str(path), "--eval-steps", "2", *out], capsys) == (
        f"eval_steps / eval_max_examples (from {path}): expected >= 0 / >= 1, got 2 / 0")


def test_a_setting_refused_later_in_the_run_names_the_file(tmp_path, out, capsys):
    """Checked once the config is built (the model folder): still the file's setting."""
    path = tmp_path / "run.yaml"
    missing = tmp_path / "no-model"
    path.write_text(f"model: {missing}\n")
    assert _error(["eval", "--config", str(path), *out], capsys) == f"model (from {path}): no such folder {missing}"


def test_from_yaml_names_the_file_for_its_values_not_for_the_keywords(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: -1\n")
    with pytest.raises(ValueError) as info:
        SFTConfig.from_yaml(path)
    assert str(info.value) == f"learning_rate (from {path}): expected a finite number >= 0, got -1.0"
    with pytest.raises(ValueError) as info:
        GRPOConfig.from_yaml(path, learning_rate=-2.0)
    assert str(info.value) == "learning_rate: expected a finite number >= 0, got -2.0"


@pytest.mark.parametrize("command", ["train", "sft", "ei", "eval"])
def test_an_unknown_key_names_the_file_and_the_closest_field(command, tmp_path, out, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 1\nmodle: m\n")
    expected = (f"config: {path}: unknown field 'modle' for `fastgrpo {command}` (did you mean model?); see "
                f"`fastgrpo {command} --help`")
    assert _error([command, "--config", str(path), *out], capsys) == expected
    with pytest.raises(ValueError) as info:
        CONFIGS[command].from_yaml(path)
    assert str(info.value) == expected


def test_another_commands_whole_config_is_one_short_line(tmp_path, out, capsys):
    """A train run's record given to eval: the first keys and how many more, not eighty notes."""
    path = tmp_path / "run_config.json"
    path.write_text(json.dumps(GRPOConfig().to_dict()))
    err = _error(["eval", "--config", str(path), *out], capsys)
    unknown = set(GRPOConfig().to_dict()) - set(CONFIGS["eval"]().to_dict())
    assert err.startswith(f"config: {path}: unknown fields for `fastgrpo eval`: 'adam_beta1' (a `fastgrpo train` / ")
    assert err.endswith(f", and {len(unknown) - 4} more; see `fastgrpo eval --help`") and len(err) < 500
