"""Which checkpoint a resume and a prune take, where the suite's runs (fewer than ten steps, one set of settings)
could not tell a mutant apart (found by the checkpoint mutation audit): steps past 9, a run whose settings changed
at a resume, a checkpoint pruned by a live run as a resume reads it. Tiny states, no trainer."""
import json

import pytest
import torch

from fastgrpo.train import checkpoint, default_task
from fastgrpo.train.checkpoint import (CONFIG_FILE, STATE_FILE, latest_checkpoint, list_checkpoints,
                                       newest_readable_checkpoint, prune_checkpoints, save_checkpoint)
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.resume_before_load import check_resume_before_load
from fastgrpo.train.resumed_settings import resumed_run_settings


def _save(folder, *steps):
    model = torch.nn.Linear(2, 2)
    for step in steps:
        save_checkpoint(folder / f"checkpoint-{step}", model, {"step": step})


def test_checkpoint_10_outranks_checkpoint_9_for_resume_and_prune(tmp_path):
    """checkpoint-10 is newer than checkpoint-9: sorting the names put 9 last, so a resume went back a step and a
    save_total_limit of 2 deleted checkpoint-10, the one just written."""
    _save(tmp_path, 2, 9, 10)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 9, 10]
    assert latest_checkpoint(tmp_path).name == "checkpoint-10"
    path, state, skipped = newest_readable_checkpoint(tmp_path)
    assert (path.name, state["step"], skipped) == ("checkpoint-10", 10, [])
    assert [p.name for p in prune_checkpoints(tmp_path, 2, 10)] == ["checkpoint-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-9"]


def test_a_resume_skips_a_checkpoint_a_live_run_pruned_as_it_was_read(tmp_path, monkeypatch):
    """A resume (or `fastgrpo eval` of a run still training) lists the checkpoints, then reads the newest: the run's
    prune may delete it in between. It is skipped as torn, and the next one loads; the state file's
    FileNotFoundError had stopped the resume with a traceback."""
    _save(tmp_path, 1, 2)
    listed = list_checkpoints(tmp_path)
    (tmp_path / "checkpoint-2" / STATE_FILE).unlink()  # the live run deletes it now
    monkeypatch.setattr(checkpoint, "list_checkpoints", lambda output_dir: listed)
    path, state, skipped = newest_readable_checkpoint(tmp_path)
    assert (path.name, state["step"]) == ("checkpoint-1", 1)
    assert len(skipped) == 1 and "skipped checkpoint-2" in skipped[0], skipped


def _records(tmp_path, older: dict, newer: dict):
    """checkpoint-9 and checkpoint-10 with these run configs (the states are not read)."""
    for step, record in ((9, older), (10, newer)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / STATE_FILE).write_bytes(b"")
        (folder / CONFIG_FILE).write_text(json.dumps(record))


def _config(tmp_path, **fields):
    return GRPOConfig(**{**default_task.PRESET, "output_dir": str(tmp_path), "resume": True, **fields})


def test_the_check_before_the_model_loads_reads_the_newest_checkpoints_record(tmp_path):
    """A run resumed at step 9 with --resume-allow-changes (a new learning rate) records it from checkpoint-10 on:
    resuming with it is the run's own settings. Checking the oldest record (or the last name, checkpoint-9) refused
    that resume before the model loaded."""
    config = _config(tmp_path, learning_rate=1e-3)
    record = config.to_dict()
    _records(tmp_path, {**record, "learning_rate": 3e-3}, record)
    check_resume_before_load(config)
    with pytest.raises(ValueError, match=r"checkpoint-10 was made with other settings: learning_rate: 0.001 in the "
                                         r"checkpoint, 0.003 now"):
        check_resume_before_load(_config(tmp_path, learning_rate=3e-3))


def test_a_resume_takes_its_settings_from_the_newest_record_and_never_export(tmp_path):
    """A bare --resume keeps the run's run-control settings as its newest checkpoint records them (the limit raised
    at step 9), not an older record's; export is this invocation's, whatever the run's last one said."""
    record = _config(tmp_path).to_dict()
    _records(tmp_path, {**record, "save_total_limit": 3, "export": False},
             {**record, "save_total_limit": 7, "export": False})
    taken = resumed_run_settings(GRPOConfig, {"resume": True, "output_dir": str(tmp_path)}, default_task.PRESET)
    assert taken["save_total_limit"] == 7 and "export" not in taken, taken


def test_a_checkpoint_folder_without_its_state_is_no_checkpoint(tmp_path):
    """checkpoint-3/ holding run_config.json alone (a copy cut short, a prune killed by an older fastgrpo) is not
    the newest checkpoint: not listed, not the one a resume reads or warns about, not where its settings come from."""
    record = _config(tmp_path).to_dict()
    _save(tmp_path, 1, 2)
    (tmp_path / "checkpoint-2" / CONFIG_FILE).write_text(json.dumps({**record, "save_total_limit": 5}))
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / CONFIG_FILE).write_text(json.dumps({**record, "save_total_limit": 9}))
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1, 2]
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"
    path, _, skipped = newest_readable_checkpoint(tmp_path)
    assert (path.name, skipped) == ("checkpoint-2", [])
    taken = resumed_run_settings(GRPOConfig, {"resume": True, "output_dir": str(tmp_path)}, default_task.PRESET)
    assert taken["save_total_limit"] == 5, taken


def test_a_checkpoint_keeps_the_rng_states_captured_at_the_steps_start(tmp_path):
    """A step abandoned by a signal (or a failing reward) is saved with the RNG states it began with, so the resume
    redoes it with the same draws: a reward function drawing from `random` or torch had moved them on. Saving the
    states of the moment (the built-in rollout's own generator hid it from the interrupt tests) redid it otherwise."""
    import random

    model = torch.nn.Linear(2, 2)
    began = checkpoint.rng_states()
    drawn = (random.random(), torch.rand(3))  # the abandoned step's reward function
    save_checkpoint(tmp_path / "checkpoint-1", model, {"step": 1, "rng": began})
    checkpoint.load_checkpoint(tmp_path / "checkpoint-1", model)
    again = (random.random(), torch.rand(3))
    assert again[0] == drawn[0] and torch.equal(again[1], drawn[1]), (drawn, again)
