"""How messages spell a setting (the flag on the command line, the keyword from Python) and which command a record
belongs to (a mutation audit found both unchecked at the values tested here)."""
import pytest

from fastgrpo.train.naming import command_line, setting
from fastgrpo.train.run_kind import written_by


@pytest.mark.parametrize("value, on_command_line, from_python", [
    (True, "--export", "export=True"),
    (False, "--no-export", "export=False"),  # what argparse's BooleanOptionalAction takes
    ("skip", "--export skip", "export='skip'"),
])
def test_a_setting_is_spelt_as_the_user_gives_it(value, on_command_line, from_python):
    assert setting("export", value) == from_python
    with command_line():
        assert setting("export", value) == on_command_line


def test_a_record_with_the_marks_of_two_commands_is_no_ones():
    """A record holding two commands' marker fields says nothing of its command: a resume is not refused on a guess."""
    assert written_by({"beta": 0.0}) == "train"
    assert written_by({"beta": 0.0, "max_seq_length": 64}) is None
    assert written_by({}) is None


def test_the_resume_hint_continues_the_run_without_deleting_it():
    """An interrupted run started with --overwrite-output-dir is continued by its command with --resume in its place
    (the two together are refused: overwrite deletes the checkpoint resume continues from)."""
    from fastgrpo.train.interrupts import resume_command as make

    argv = ["train", "--overwrite-output-dir", "--stop", "</a b>", "--no-resume", "--max-steps", "3"]
    assert make(argv) == "fastgrpo train --stop '</a b>' --max-steps 3 --resume"
    assert make(["sft", "--resume"]) == "fastgrpo sft --resume"
