"""Flags and YAML keys mean the same: a list flag's `none` unsets an optional list as the YAML's `none` does."""
import pytest

from fastgrpo.train import commands
from fastgrpo.train.cli import build_parser


def _config(command: str, argv: list[str]):
    args = build_parser().parse_args([command, *argv])
    return commands.config_from_args(command, args)


@pytest.mark.parametrize("command, field", [("train", "report_to"), ("train", "stop"), ("train", "reward_weights"),
                                            ("sft", "report_to"), ("ei", "stop"), ("eval", "stop")])
def test_none_unsets_an_optional_list_flag_as_in_yaml(command, field, tmp_path):
    # `--report-to none` (TRL's way to turn reporting off) was the reporter 'none'; `--stop none` the stop string
    path = tmp_path / "run.yaml"
    path.write_text(f"{field}: none\n")
    assert getattr(_config(command, ["--config", str(path)]), field) is None
    flag = f"--{field.replace('_', '-')}"
    assert getattr(_config(command, ["--config", str(path), flag, "none"]), field) is None
    assert getattr(_config(command, [flag, "None"]), field) is None


def test_none_among_other_values_is_a_value():
    assert _config("train", ["--stop", "none", "END"]).stop == ["none", "END"]
    assert _config("train", ["--reward-funcs", "length", "none"]).reward_funcs == ["length", "none"]


def test_the_help_of_an_optional_list_flag_says_none_unsets_it():
    usage = build_parser().command_parsers["train"].format_help()
    assert "space-separated; 'none' to unset" in " ".join(usage.split())


def test_a_bad_item_of_an_optional_list_flag_is_argparses_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["train", "--reward-weights", "1", "x"])
    assert info.value.code == 2
    assert "fastgrpo train: error: argument --reward-weights: invalid float value: 'x'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
def test_the_help_of_a_resumable_command_lists_what_may_change_on_resume(command):
    """train's --help listed them; sft's and ei's said nothing of which settings --resume takes anew."""
    from fastgrpo.train.commands import CONFIGS
    from fastgrpo.train.config import run_control_fields

    text = " ".join(build_parser().command_parsers[command].format_help().split())
    listed = text.split("these settings may change on resume, every other one must match the checkpoint's (or pass "
                        "--resume-allow-changes): ")[1].split(".")[0]
    assert listed.split(", ") == run_control_fields(CONFIGS[command])
