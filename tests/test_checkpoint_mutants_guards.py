"""The run folder's and the checkpoint's guards where the suite's other cases could not tell a mutant apart (found by
the checkpoint mutation audit): the fsyncs before atomic_directory's rename, a lock held on another host, a user's
own empty folder, the signal guard of several processes, the base model's fingerprint. No trainer."""
import json
import os
import signal

import pytest
import torch
from safetensors.torch import save_file

from fastgrpo.train import atomic_folder
from fastgrpo.train.base_fingerprint import fingerprint, recorded_fingerprint
from fastgrpo.train.config import GRPOConfig, config_changes
from fastgrpo.train.interrupts import InterruptGuard, Interrupted
from fastgrpo.train.run_dir import LOCK_FILE, RunDirectory, RunLock
from tests.test_run_safety import _dead_pid


def test_every_file_and_the_folder_are_fsynced_before_the_rename_that_publishes_them(tmp_path, monkeypatch):
    """A power loss after the rename but before the data reached the disk leaves checkpoint-<step>/ with empty
    files (or a subfolder without its entries), which the resume takes as the newest: each file and folder is
    fsynced first, then the rename."""
    events, real_replace = [], os.replace
    monkeypatch.setattr(atomic_folder, "fsync_path", lambda path: events.append(("fsync", path.name)))
    monkeypatch.setattr(atomic_folder.os, "replace", lambda src, dst: (events.append(("rename", dst.name)),
                                                                       real_replace(src, dst)))
    target = tmp_path / "checkpoint-3"
    with atomic_folder.atomic_directory(target) as tmp:
        (tmp / "trainer_state.pt").write_bytes(b"state")
        (tmp / "adapter").mkdir()
        (tmp / "adapter" / "weights").write_bytes(b"w")
    renamed = events.index(("rename", "checkpoint-3"))
    # the folder inside too (an FSDP2 run's shards/): its entries name its files
    names = ("trainer_state.pt", "adapter", "weights", f".checkpoint-3.tmp-{os.getpid()}")
    published = {("fsync", name) for name in names}
    assert published <= set(events[:renamed]), events
    assert events[renamed + 1:] == [("fsync", tmp_path.name)], events  # the rename itself made durable


def test_fsync_path_flushes_the_file_or_folder_it_names(tmp_path, monkeypatch):
    """The tests above count its calls; this, that a call reaches the disk's flush for the very file or folder."""
    flushed, real_fsync = [], os.fsync
    monkeypatch.setattr(atomic_folder.os, "fsync", lambda fd: (flushed.append(os.fstat(fd).st_ino), real_fsync(fd)))
    (tmp_path / "state.pt").write_bytes(b"state")
    for path in (tmp_path / "state.pt", tmp_path):
        atomic_folder.fsync_path(path)
    assert flushed == [(tmp_path / "state.pt").stat().st_ino, tmp_path.stat().st_ino]


def test_a_lock_held_on_another_host_is_never_taken_over_by_its_pid(tmp_path):
    """Without flock (a shared file system) the PID decides on its own host only: on another host the same number
    is another process, so a run there stays the folder's holder however dead that PID is here."""
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": _dead_pid(), "host": "another-host"}))
    with pytest.raises(ValueError, match=r"in use by another run \(PID \d+ on another-host\)"):
        RunLock(tmp_path, use_flock=False).acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "another-host"


def test_an_empty_folder_the_user_made_stays_after_a_run_that_wrote_nothing(tmp_path):
    """Only a folder the run created is removed when the run leaves it empty; the user's own stays."""
    mine = tmp_path / "mine"
    mine.mkdir()
    with RunDirectory(mine):
        pass
    with RunDirectory(tmp_path / "created"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_leftover_of_another_users_running_process_is_not_deleted(tmp_path, monkeypatch):
    """os.kill(pid, 0) on another user's process raises PermissionError: it runs, its partial write stays."""
    theirs = tmp_path / f".final.tmp-{_dead_pid()}"
    theirs.mkdir()

    def not_permitted(pid, signum):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(atomic_folder.os, "kill", not_permitted)
    with atomic_folder.atomic_directory(tmp_path / "final") as tmp:
        (tmp / "model").write_text("new")
    assert theirs.is_dir()


def test_the_guard_of_several_processes_only_notes_a_first_signal_and_restores_the_handlers():
    """With several processes (deferred) the first signal raises nothing, even before the update (the others would
    wait in the step's collectives), and is not one to act on alone; a second one stops at once. On exit the
    previous handlers are back."""
    before = signal.getsignal(signal.SIGTERM)
    with InterruptGuard(deferred=True) as guard:
        guard.abandonable = True
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except Interrupted:  # a KeyboardInterrupt: uncaught, it would stop pytest itself
            pytest.fail("the first signal of a deferred guard raised")
        assert guard.requested == signal.SIGTERM and guard.arrived_alone() == 0
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before
    with InterruptGuard() as alone:
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # in an update (not abandonable): noted, the step finishes
        except Interrupted:
            pytest.fail("a first signal in the middle of an update raised")
        assert alone.arrived_alone() == signal.SIGTERM


def test_the_recorded_fingerprint_follows_the_configs_model(tmp_path):
    """A config whose model is set to another folder records that folder's fingerprint, not the first one's."""
    for name, value in (("a", 0.0), ("b", 1.0)):
        (tmp_path / name).mkdir()
        save_file({"w": torch.full((4,), value)}, tmp_path / name / "model.safetensors")
    config = GRPOConfig(model=str(tmp_path / "a"))
    assert recorded_fingerprint(config) == fingerprint(str(tmp_path / "a"))
    config.model = str(tmp_path / "b")
    assert recorded_fingerprint(config) == fingerprint(str(tmp_path / "b")) != fingerprint(str(tmp_path / "a"))


def test_another_hub_model_is_a_change_without_fingerprints():
    """Two Hub names have no fingerprint: neither is the other's base moved, so a resume onto the other is a
    change of the run-defining model (its adapter would go on other weights)."""
    saved = GRPOConfig(model="org/model-a").to_dict()
    changes = config_changes(saved, GRPOConfig(model="org/model-b"))
    assert any(change.startswith("model: 'org/model-a' in the checkpoint") for change in changes), changes


def test_files_put_in_an_exports_folder_as_the_checkpoint_loads_are_refused_not_replaced(tmp_path, monkeypatch, capsys):
    """`fastgrpo export` checks its output folder again once the model has loaded (minutes for a large one): files
    put there meanwhile are the user's, which the atomic replacement deleted without a word."""
    from fastgrpo.train import default_task, export_command
    from fastgrpo.train.checkpoint import save_checkpoint
    from fastgrpo.train.cli import main

    run, out = tmp_path / "run", tmp_path / "model"
    config = GRPOConfig(**{**default_task.PRESET, "output_dir": str(run)})
    model = default_task.build_model(default_task.build_tokenizer(), seed=config.seed)
    save_checkpoint(run / "checkpoint-1", model, {"step": 1, "config": config.to_dict()})
    real_load = export_command._load

    def user_writes_as_it_loads(*args):
        loaded = real_load(*args)
        (out / "notes.txt").write_text("mine")
        return loaded

    monkeypatch.setattr(export_command, "_load", user_writes_as_it_loads)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err == (f"fastgrpo export: error: output_dir: {out} is not empty (notes.txt); pick "
                                       "another --output-dir\n")
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_a_resume_with_steps_left_checks_the_base_its_adapter_goes_on(tmp_path):
    """The trainer's own check of the checkpoint it resumes (from Python there is no check before the load): a LoRA
    run whose base folder was exported again since is refused while it has steps left; once finished it trains
    nothing and says so whatever its base."""
    from fastgrpo.train.resume_checks import check_resumed_checkpoint

    base = tmp_path / "base"
    base.mkdir()
    save_file({"w": torch.zeros(4)}, base / "model.safetensors")
    config = GRPOConfig(model=str(base), lora_rank=4, export=False, max_steps=2, output_dir=str(tmp_path / "run"))
    state = {"step": 1, "config": config.to_dict()}
    save_file({"w": torch.ones(4)}, base / "model.safetensors")  # another run's final/ exported again there
    with pytest.raises(ValueError, match=r"model: .* is not the base model checkpoint-1 was trained on \(its files "
                                         r"changed since: model.safetensors differs\)"):
        check_resumed_checkpoint(state, config, tmp_path / "run" / "checkpoint-1", 2, evaluates=False)
    check_resumed_checkpoint({**state, "step": 2}, config, tmp_path / "run" / "checkpoint-2", 2, evaluates=False)
