"""A resumed run's checkpoint rotation, found by the checkpoint mutation audit: a checkpoint of the history a resume
went back over (it fell back past a damaged one) between the checkpoint it resumed from and its first own one."""
import logging
import shutil

from fastgrpo.train.checkpoint import list_checkpoints
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
