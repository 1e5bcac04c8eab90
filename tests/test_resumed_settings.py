"""A --resume keeps the run's own run-control settings that no flag or config file sets (fastgrpo/train/
resumed_settings.py): a default must not undo what the run was told, such as keeping every checkpoint."""
import json

from fastgrpo.train.cli import main

FAST = ["--no-progress-bar", "--num-generations", "4", "--batch-size", "8", "--max-completion-length", "2"]


def _checkpoints(run):
    return sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))


def test_a_resume_keeps_the_runs_save_total_limit_where_no_flag_sets_one(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--max-steps", "2", "--save-steps", "1",
                 "--save-total-limit", "none", *FAST]) == 0
    capsys.readouterr()
    assert main(["train", "--output-dir", str(run), "--max-steps", "4", "--resume", *FAST]) == 0
    # the default limit (2) deleted checkpoint-1 and -2, which the run kept
    assert _checkpoints(run) == [1, 2, 3, 4], _checkpoints(run)
    assert "save_steps 1, save_total_limit None (from " in capsys.readouterr().err
    record = json.loads((run / "checkpoint-4" / "run_config.json").read_text())
    assert (record["save_total_limit"], record["save_steps"]) == (None, 1)


def test_a_flag_given_on_resume_still_changes_a_run_control_setting(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--max-steps", "2", "--save-steps", "1",
                 "--save-total-limit", "none", *FAST]) == 0
    assert main(["train", "--output-dir", str(run), "--max-steps", "3", "--resume", "--save-total-limit", "1",
                 *FAST]) == 0
    assert _checkpoints(run) == [3]


def test_a_resume_keeps_the_runs_max_steps_where_no_flag_sets_one(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--max-steps", "2", *FAST]) == 0
    capsys.readouterr()
    # without it the default 100 steps would train on
    assert main(["train", "--output-dir", str(run), "--resume", *FAST]) == 0
    said = capsys.readouterr()
    assert "max_steps 2" in said.err and "nothing to train: the run in" in said.out


def test_another_commands_run_lends_no_setting_and_is_refused_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["sft", "--output-dir", str(run), "--max-steps", "2", "--no-progress-bar"]) == 0
    capsys.readouterr()
    assert main(["train", "--output-dir", str(run), "--resume", *FAST]) == 2
    err = capsys.readouterr().err
    assert "is a `fastgrpo sft` run, not a `fastgrpo train` run" in err and len(err.strip().splitlines()) == 1, err
