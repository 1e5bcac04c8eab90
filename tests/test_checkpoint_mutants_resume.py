"""A resumed run's checkpoint rotation, found by the checkpoint mutation audit: a checkpoint of the history a resume
went back over (it fell back past a damaged one) between the checkpoint it resumed from and its first own one."""
import logging
import shutil

from fastgrpo.train.checkpoint import list_checkpoints
from fastgrpo.train.cli import main
from tests.test_ei_resume import SMALL as SMALL_EI
from tests.test_run_safety import _trainer


def test_a_damaged_checkpoint_the_resume_went_back_over_leaves_the_rotation_at_the_runs_next_save(tmp_path, caplog):
    """checkpoint-2 damaged, the resume goes back to checkpoint-1 and saves next at step 3 (save_steps 3 now; or
    save_minutes' time): checkpoint-2 is no step of this run's. Kept, it counted in save_total_limit in place of
    checkpoint-1 (the limit of 2 then held one checkpoint a resume can read) and lay in wait for a --resume whose
    newer checkpoint is torn in turn. Only one of a later step than the new checkpoint was deleted."""
    _trainer(tmp_path, max_steps=1, save_total_limit=None).train()
    shutil.copytree(tmp_path / "checkpoint-1", tmp_path / "checkpoint-2")  # a step 2 saved, then damaged
    state = tmp_path / "checkpoint-2" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.checkpoint"):
        resumed = _trainer(tmp_path, max_steps=3, save_steps=3, save_total_limit=2, resume=True).train()
    assert [m["step"] for m in resumed] == [2, 3]
    assert "deleted checkpoint-2, left by the steps this run went back over" in caplog.text, caplog.text
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1, 3]


def test_expert_iterations_rounds_leave_a_damaged_checkpoint_the_resume_went_back_over_out_of_the_rotation(
        tmp_path, capsys):
    """The same history under `fastgrpo ei`, whose rounds are its steps: its checkpoints were untracked, so the
    damaged checkpoint-2 stayed and save_total_limit 2 deleted checkpoint-1, the only one a resume could read."""
    argv = ["ei", "--output-dir", str(tmp_path), *SMALL_EI, "--max-completion-length", "8"]
    assert main([*argv, "--ei-steps", "1"]) == 0
    shutil.copytree(tmp_path / "checkpoint-1", tmp_path / "checkpoint-2")  # a round 2 saved, then damaged
    state = tmp_path / "checkpoint-2" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    capsys.readouterr()
    assert main([*argv, "--ei-steps", "3", "--save-steps", "3", "--save-total-limit", "2", "--resume"]) == 0
    err = capsys.readouterr().err  # the CLI's log lines
    assert "deleted checkpoint-2, left by the steps this run went back over" in err, err
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1, 3]
