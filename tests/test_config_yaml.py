"""A --config file / from_yaml: each problem of the file is one line naming the file (and the key)."""
import os

import pytest

from fastgrpo.train.cli import build_parser, main
from fastgrpo.train.commands import CONFIGS
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.sft_config import SFTConfig


@pytest.mark.parametrize("text, problem", [
    ("learning_rate: fast\n", "learning_rate: expected a number, got 'fast'"),
    ("learning_rate: [1.0e-5, 2.0e-5]\n", "learning_rate: expected a number, got [1e-05, 2e-05]"),
    ("learning_rate: null\n", "learning_rate: expected a number, got None"),
    ("max_steps: 2.5\n", "max_steps: expected an integer, got 2.5"),
    ("reward_funcs: {length: 1}\n", "reward_funcs: expected a list of strings, got {'length': 1}"),
    ("reward_funcs: [[length, format]]\n", "reward_funcs: expected a list of strings, got [['length', 'format']]"),
    ("dataset_config: 2023\n", "dataset_config: expected a string, got 2023 (read as a number: quote it)"),
    ("prompt_column: true\n", "prompt_column: expected a string, got True (read as a boolean: quote it)"),
])
def test_a_wrong_type_names_the_key_and_the_file(text, problem, tmp_path, capsys):
    _assert_refused_from_the_file(text, problem, tmp_path, capsys)


def test_a_wrong_type_of_an_override_is_no_files(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("max_steps: 3\n")
    with pytest.raises(ValueError) as info:
        SFTConfig.from_yaml(path, learning_rate="fast")
    assert str(info.value) == "learning_rate: expected a number, got 'fast'"


@pytest.mark.parametrize("text, problem", [
    ("seed: 1\n1: 2\n", ":2: key 1 is no field name (expected text)"),
    ("true: 2\n", ":1: key True is no field name (expected text)"),
    ("? [a, b]\n: 1\n", ":1: key ['a', 'b'] is no field name (expected text)"),
])
def test_a_key_that_is_no_text_is_one_line(text, problem, tmp_path, capsys):
    path, message = _refusal(text, "sft", tmp_path, capsys)
    assert message == f"config: {path}{problem}"


def _assert_refused_from_the_file(text: str, problem: str, tmp_path, capsys) -> None:
    """`fastgrpo train --config <file of text>` refuses it with problem ("field: expected ...") naming the file."""
    path, message = _refusal(text, "train", tmp_path, capsys)
    field, expected = problem.split(": ", 1)
    assert message == f"{field} (from {path}): {expected}"


def _refusal(text: str, command: str, tmp_path, capsys) -> tuple:
    """(the file, the one line GRPOConfig.from_yaml raised for a config file of `text`), checked to be the line
    `fastgrpo <command> --config <file>` prints as it exits 2."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        GRPOConfig.from_yaml(path)
    assert main([command, "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"fastgrpo {command}: error: {info.value}\n"
    return path, str(info.value)


def test_paths_expand_the_home_folder_and_environment_variables(tmp_path, monkeypatch):
    """As a shell expands them on a command line; YAML does not."""
    monkeypatch.setenv("FASTGRPO_TEST_ROOT", str(tmp_path))
    monkeypatch.delenv("FASTGRPO_TEST_UNSET", raising=False)
    path = tmp_path / "run.yaml"
    path.write_text("dataset: $FASTGRPO_TEST_ROOT/d.jsonl\noutput_dir: ${FASTGRPO_TEST_ROOT}/out\n"
                    "eval_dataset: ~/e.jsonl\nprompt_column: $question\n")
    config = GRPOConfig.from_yaml(path)
    assert (config.dataset, config.output_dir) == (f"{tmp_path}/d.jsonl", f"{tmp_path}/out")
    assert config.eval_dataset.endswith("/e.jsonl") and "~" not in config.eval_dataset
    assert config.prompt_column == "$question"  # a column name, no path
    path.write_text("model: $FASTGRPO_TEST_UNSET/models/m\n")
    with pytest.raises(ValueError) as info:
        GRPOConfig.from_yaml(path)
    assert str(info.value) == (f"model (from {path}): environment variable FASTGRPO_TEST_UNSET is not set (in "
                               "'$FASTGRPO_TEST_UNSET/models/m')")


def test_a_folder_is_no_config_file_and_a_runs_names_its_record(tmp_path, capsys):
    run = tmp_path / "run"
    for step in (2, 10):  # checkpoint-10 is the newest, though it sorts first as text
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "run_config.json").write_text("{}")
    with pytest.raises(ValueError) as info:
        GRPOConfig.from_yaml(run)
    assert str(info.value) == (f"config: {run} is a folder, not a YAML file (the run's settings are in "
                               f"{run / 'checkpoint-10' / 'run_config.json'})")
    assert main(["eval", "--config", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"fastgrpo eval: error: config: {tmp_path} is a folder, not a YAML file\n"


def test_a_json_config_is_read_as_json(tmp_path):
    """JSON is YAML, except where YAML refuses it: a tab that indents (an editor's JSON), escaped surrogate pairs."""
    path = tmp_path / "run.json"
    path.write_text('{\n\t"learning_rate": 1e-5,\n\t"max_steps": 3,\n\t"stop": ["\\ud83d\\ude00"]\n}\n')
    config = GRPOConfig.from_yaml(path)
    assert (config.learning_rate, config.max_steps, config.stop) == (1e-5, 3, ["\U0001F600"])
    path.write_text('{"seed": 1,\n "seed": 2}')
    with pytest.raises(ValueError) as info:
        GRPOConfig.from_yaml(path)
    assert str(info.value) == f"config: {path}: 'seed' is given twice"
    path.write_text('{"seed": 1,\n "max_steps": }')
    with pytest.raises(ValueError) as info:
        GRPOConfig.from_yaml(path)
    assert str(info.value) == f"config: {path}:2:15: malformed JSON (Expecting value)"


def test_scale_rewards_takes_trls_booleans(tmp_path):
    """TRL's GRPOConfig reads scale_rewards true / false as group / none (Dr. GRPO recipes write `false`)."""
    path = tmp_path / "run.yaml"
    path.write_text("scale_rewards: false\n")
    assert GRPOConfig.from_yaml(path).scale_rewards == "none"
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"


def test_yaml_1_1s_surprises_read_as_the_author_meant(tmp_path):
    """PyYAML reads YAML 1.1: `010` in octal (8), `1:30` in base 60 (90), yes / no / on / off as booleans, `1e-5` as
    text. Read as YAML 1.2 (and a flag) does: 10, text, text (a bool field takes the words), a number."""
    path = tmp_path / "run.yaml"
    path.write_text("seed: 010\nprompt_column: no\nstop: [on, 'off', yes]\nexport: off\ngradient_checkpointing: Yes\n"
                    "scale_rewards: no\nlearning_rate: 1e-5\nreward_weights: [1e-1, 2]\nmax_steps: 1_000\n")
    config = GRPOConfig.from_yaml(path)
    assert (config.seed, config.prompt_column, config.stop) == (10, "no", ["on", "off", "yes"])
    assert (config.export, config.gradient_checkpointing, config.scale_rewards) == (False, True, "none")
    assert (config.learning_rate, config.reward_weights, config.max_steps) == (1e-5, [0.1, 2.0], 1000)
    path.write_text("learning_rate: 1e-5\nnum_epochs: 010\n")
    assert (SFTConfig.from_yaml(path).learning_rate, SFTConfig.from_yaml(path).num_epochs) == (1e-5, 10)


@pytest.mark.parametrize("text, problem", [
    ("save_minutes: 1:30\n", "save_minutes: expected a number, got '1:30'"),  # YAML 1.1: 90
    ("seed: 1:30\n", "seed: expected an integer, got '1:30'"),
    ("export: maybe\n", "export: expected true or false, got 'maybe'"),
    ("lr_scheduler: [linear]\n", "lr_scheduler: expected a string, got ['linear']"),
])
def test_a_value_yaml_1_1_would_misread_is_refused_in_one_line(text, problem, tmp_path, capsys):
    _assert_refused_from_the_file(text, problem, tmp_path, capsys)


@pytest.mark.parametrize("name, text, held", [
    ("run.yaml", "- learning_rate: 1.0e-5\n", "a list"),
    ("run.yaml", "learning_rate 1e-5\n", "text"),  # the colon forgotten
    ("run.json", "null", "null"),
])
def test_a_file_that_is_no_mapping_says_what_it_holds(name, text, held, tmp_path):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        GRPOConfig.from_yaml(path)
    assert str(info.value) == f"config: {path}: expected a mapping of field: value, got {held}"


@pytest.mark.parametrize("command, key, value, beside", [
    ("train", "dataset", "data/rows.jsonl", "data/rows.jsonl"),
    ("ei", "eval_dataset", "../rows.jsonl", "../rows.jsonl"),
    ("train", "reward_funcs", "[rewards.py:score]", "rewards.py"),
    ("eval", "checkpoint", "run/checkpoint-2", "run/checkpoint-2"),
])
def test_a_relative_path_beside_the_config_file_not_in_the_current_folder_is_one_line(
        command, key, value, beside, tmp_path, monkeypatch, capsys):
    """A config file's relative paths are read from the current folder, as a flag's (and TRL's and Axolotl's YAML
    paths): one the file's folder has and the current folder lacks says where it is, not `no such file`."""
    conf = tmp_path / "project" / "conf"
    (conf / beside).parent.mkdir(parents=True, exist_ok=True)
    (conf / beside).touch()
    path = conf / "run.yaml"
    path.write_text(f"{key}: {value}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([command, "--config", str(path)]) == 2
    shown = beside if key != "reward_funcs" else "rewards.py"
    assert capsys.readouterr().err == (
        f"fastgrpo {command}: error: {key} (from {path}): {shown} is not in the current folder ({elsewhere}), where "
        f"a config file's relative paths start, as a flag's do; it is beside the config file: write "
        f"{os.path.normpath(conf / shown)} or run from {conf}\n")
    with pytest.raises(ValueError, match=f"^{key} \\(from {path}\\): {shown} is not in the current folder"):
        CONFIGS[command].from_yaml(path)


def test_a_relative_path_read_from_the_current_folder_or_set_by_a_flag_is_taken(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "rows.jsonl").touch()
    path = conf / "run.yaml"
    path.write_text("dataset: data/rows.jsonl\n")
    monkeypatch.chdir(conf)  # run from the file's folder: read from there
    assert GRPOConfig.from_yaml(path).dataset == "data/rows.jsonl"
    monkeypatch.chdir(tmp_path)  # a flag replaces the file's path; an HF name is no local path
    assert GRPOConfig.from_yaml(path, dataset="other.jsonl").dataset == "other.jsonl"
    path.write_text("dataset: openai/gsm8k\n")
    assert GRPOConfig.from_yaml(path).dataset == "openai/gsm8k"


def test_the_help_of_config_says_where_relative_paths_start():
    for command in CONFIGS:
        text = " ".join(build_parser().command_parsers[command].format_help().split())
        assert "relative paths in it start from the current folder, as a flag's do" in text, command


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
@pytest.mark.parametrize("text, flags, problem", [
    ("lora_target_modules: q_proj,v_proj\n", ["--lora-target-modules", "q_proj,v_proj"],
     "'q_proj,v_proj' is no module name; names are separated by spaces, not commas (--lora-target-modules q_proj "
     "v_proj; in YAML, a list: [q_proj, v_proj])"),
    ("lora_target_modules: []\n", ["--lora-target-modules"],
     "expected one or more module names (all-linear: every linear layer), got []"),
])
def test_lora_target_modules_joined_by_commas_or_none_are_one_line(command, text, flags, problem, tmp_path, capsys):
    """Both were taken, and PEFT's load of the model failed on `no module ... is named 'q_proj,v_proj'` or ''."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    out = ["--output-dir", str(tmp_path / "out"), "--lora-rank", "8"]
    assert main([command, "--config", str(path), *out]) == 2
    assert capsys.readouterr().err == f"fastgrpo {command}: error: lora_target_modules (from {path}): {problem}\n"
    assert main([command, *flags, *out]) == 2
    assert capsys.readouterr().err == f"fastgrpo {command}: error: lora_target_modules: {problem}\n"
