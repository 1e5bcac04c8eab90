"""A run folder from a user's side: what a damaged checkpoint, --overwrite-output-dir and a resume do to the files
in it. An FSDP2 checkpoint (Distributed Checkpoint's shards/ beside trainer_state.pt) is made here by
Distributed Checkpoint in one process, the format `fastgrpo eval --checkpoint` reads whole."""
import logging
import os
import warnings

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.checkpoint import (STATE_FILE, TornCheckpoint, load_checkpoint, load_latest_checkpoint, rng_states,
                                       save_checkpoint)
from fastgrpo.train.final_export import export_model
from fastgrpo.train.run_dir import RunDirectory
from fastgrpo.train.sharded_state import SHARDS, sharded_state


def _sharded_checkpoint(output_dir, step: int):
    """checkpoint-<step>/ as an FSDP2 run writes it: its weights in shards/, the rest in trainer_state.pt."""
    import torch.distributed.checkpoint as dcp

    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    model = default_task.build_model(default_task.build_tokenizer(), seed=step)
    with warnings.catch_warnings():  # no process group: one process writes every shard
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(sharded_state(model, None), checkpoint_id=folder / SHARDS)
    torch.save({"step": step, "rng": rng_states(), "sharded": True, "config": {}}, folder / STATE_FILE)
    return folder


def _shard_file(folder):
    return next(p for p in (folder / SHARDS).iterdir() if p.suffix == ".distcp")


# A copy cut short (a full disk, an interrupted rsync), `cp shards/*` (which leaves the hidden .metadata behind)
DAMAGES = {
    "shard cut short": lambda folder: os.truncate(_shard_file(folder), 100),
    "shard missing": lambda folder: _shard_file(folder).unlink(),
    "metadata missing": lambda folder: (folder / SHARDS / ".metadata").unlink(),
    "metadata cut short": lambda folder: os.truncate(folder / SHARDS / ".metadata", 50),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_resume_skips_a_sharded_checkpoint_whose_shards_are_damaged(tmp_path, caplog, damage):
    _sharded_checkpoint(tmp_path, 1)
    DAMAGES[damage](_sharded_checkpoint(tmp_path, 2))
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.checkpoint"):
        path, state = load_latest_checkpoint(tmp_path)
    assert (path.name, state["step"]) == ("checkpoint-1", 1)
    assert "skipped checkpoint-2, which is incomplete or damaged" in caplog.text, caplog.text


@pytest.mark.parametrize("damage", DAMAGES)
def test_loading_a_damaged_sharded_checkpoint_names_it_in_one_line(tmp_path, damage):
    folder = _sharded_checkpoint(tmp_path, 1)
    DAMAGES[damage](folder)
    model = default_task.build_model(default_task.build_tokenizer())
    with pytest.raises(TornCheckpoint, match=rf"^{folder / SHARDS}: ") as caught:
        load_checkpoint(folder, model)
    assert "\n" not in str(caught.value)


def test_a_sharded_checkpoint_whose_bytes_are_garbage_is_one_line_not_a_traceback(tmp_path):
    """Shards of the right size but damaged content pass the size check: Distributed Checkpoint's failure is a
    BaseException, which passed every handler of the CLI as a traceback."""
    folder = _sharded_checkpoint(tmp_path, 1)
    shard = _shard_file(folder)
    shard.write_bytes(bytes(shard.stat().st_size))
    model = default_task.build_model(default_task.build_tokenizer())
    with pytest.raises(ValueError, match=rf"^checkpoint: cannot load {folder / SHARDS} \(") as caught:
        load_checkpoint(folder, model)
    assert "\n" not in str(caught.value)


def _finished_run(output_dir):
    """A run's folder as `fastgrpo train` leaves it: a checkpoint, the metrics, the export in final/."""
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    save_checkpoint(output_dir / "checkpoint-2", model, {"step": 2, "config": {}})
    (output_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    export_model(model, tokenizer, output_dir / "final", run_config={}, step=2)


def test_overwrite_refuses_to_delete_the_files_a_user_put_in_final_as_the_export_does(tmp_path):
    """A second export refuses to delete the files a user put beside the exported model; --overwrite-output-dir
    deleted them with final/ (its refusal said it deletes "final", the run's export)."""
    _finished_run(tmp_path)
    (tmp_path / "final" / "README.md").write_text("my model card\n")
    with RunDirectory(tmp_path) as run_dir:
        with pytest.raises(ValueError, match=rf"^overwrite_output_dir: {tmp_path / 'final'} holds files the export "
                                             r"did not write \(README.md\), which starting afresh there would delete; "
                                             r"move them out of it, then start afresh with overwrite_output_dir=True$"):
            run_dir.prepare(resume=False, overwrite=True, command="train")
    assert (tmp_path / "final" / "README.md").read_text() == "my model card\n"
    assert (tmp_path / "checkpoint-2" / STATE_FILE).is_file() and (tmp_path / "metrics.jsonl").is_file()
    (tmp_path / "final" / "README.md").unlink()
    with RunDirectory(tmp_path) as run_dir:
        run_dir.prepare(resume=False, overwrite=True, command="train")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("folder", ["eval", "tensorboard"])
def test_a_users_own_eval_or_tensorboard_folder_is_not_a_run_and_never_deleted(tmp_path, folder):
    """A folder named as a run's (--eval-steps' eval/, tensorboard/) that holds none of a run's files is the user's:
    neither refused as another run nor deleted by --overwrite-output-dir (it was both)."""
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "my_script.py").write_text("print('mine')\n")
    with RunDirectory(tmp_path) as run_dir:
        run_dir.prepare(resume=False, overwrite=False, command="train")
        run_dir.prepare(resume=False, overwrite=True, command="train")
    assert (tmp_path / folder / "my_script.py").is_file()


@pytest.mark.parametrize("folder, runs_file", [("eval", "step-2_summary.json"),
                                               ("tensorboard", "events.out.tfevents.1.host.1.0")])
def test_overwrite_refuses_to_delete_a_users_files_beside_the_runs_in_eval_or_tensorboard(tmp_path, folder, runs_file):
    _finished_run(tmp_path)
    (tmp_path / folder).mkdir()
    (tmp_path / folder / runs_file).write_text("{}\n")
    (tmp_path / folder / "notes.txt").write_text("mine\n")
    with RunDirectory(tmp_path) as run_dir:
        with pytest.raises(ValueError, match=rf"^overwrite_output_dir: {tmp_path / folder} holds files the run did "
                                             r"not write \(notes.txt\), which starting afresh would delete; move them "
                                             r"out of it, then start afresh with overwrite_output_dir=True$"):
            run_dir.prepare(resume=False, overwrite=True, command="train")
    assert (tmp_path / folder / "notes.txt").is_file() and (tmp_path / "final").is_dir()


def test_an_output_dir_on_a_read_only_file_system_is_named(tmp_path, monkeypatch, capsys):
    """A folder that exists on a read-only mount (where root, whom permissions do not stop, gets EROFS rather than
    EACCES) printed `error: [Errno 30] Read-only file system: '<dir>/.fastgrpo.lock'`, naming no setting."""
    import errno

    from fastgrpo.train.cli import main
    from fastgrpo.train.run_dir import LOCK_FILE

    real_open = os.open

    def read_only(path, flags, *args, **kwargs):  # the kernel's answer there to a file created
        if str(path).endswith(LOCK_FILE) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    assert main(["train", "--output-dir", str(tmp_path), "--max-steps", "1", "--no-progress-bar"]) == 2
    assert capsys.readouterr().err == (f"fastgrpo train: error: output_dir: {tmp_path} is not writable (its lock "
                                       "file cannot be created: Read-only file system)\n")


def test_a_checkpoint_pruned_halfway_by_a_kill_leaves_no_checkpoint_folder(tmp_path, monkeypatch):
    """A kill while --save-total-limit deleted an old checkpoint left checkpoint-1/ holding run_config.json alone
    (its state went first): no prune deleted it again (it has no state), so the run kept it beside its newest ones.
    The folder is renamed to a hidden partial write's name first, which a resume deletes."""
    from fastgrpo.train.checkpoint import prune_checkpoints

    model = default_task.build_model(default_task.build_tokenizer())
    for step in (1, 2):
        save_checkpoint(tmp_path / f"checkpoint-{step}", model, {"step": step, "config": {}})
    real_unlink, deleted = os.unlink, []

    def killed_after_one_file(path, *args, **kwargs):  # the process stops in the middle of the deletion
        if deleted:
            raise KeyboardInterrupt
        deleted.append(path)
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", killed_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(tmp_path, 1, 2)
    monkeypatch.undo()
    assert not (tmp_path / "checkpoint-1").exists()
    with RunDirectory(tmp_path) as run_dir:
        run_dir.prepare(resume=True, overwrite=False, command="train")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


@pytest.mark.parametrize("name", ["eval", "final", "tensorboard"])
def test_a_users_file_named_like_a_runs_folder_is_refused_and_never_deleted(tmp_path, capsys, name):
    """A file where a run writes a folder is the user's (a script named eval, notes named final): it was refused as
    "holds another run (eval)", whose --overwrite-output-dir then deleted it."""
    from fastgrpo.train.cli import main

    (tmp_path / name).write_text("echo mine\n")
    line = (f"fastgrpo train: error: output_dir: {tmp_path / name} is a file, where a run writes a folder; move it "
            f"out of {tmp_path}, or pick another --output-dir\n")
    for flags in ([], ["--overwrite-output-dir"], ["--resume"]):
        assert main(["train", "--output-dir", str(tmp_path), "--max-steps", "1", "--no-progress-bar", *flags]) == 2
        assert capsys.readouterr().err == line
    assert (tmp_path / name).read_text() == "echo mine\n"


@pytest.mark.parametrize("below", ["", "run"])
def test_an_output_dir_through_a_broken_symlink_is_named_as_one(tmp_path, below):
    """A symlink to a folder that does not exist (a scratch disk not mounted on this node) was named "is a file"."""
    link = tmp_path / "scratch"
    link.symlink_to(tmp_path / "unmounted" / "me")
    with pytest.raises(ValueError, match=rf"^output_dir: {link} is a symlink to {tmp_path / 'unmounted' / 'me'}, "
                                         r"which does not exist; create that folder \(is its disk mounted\?\), or "
                                         r"pick another output_dir$"):
        with RunDirectory(link / below):
            pass
    assert not (tmp_path / "unmounted").exists()


def _unshare_mount_works() -> bool:
    import shutil
    import subprocess

    return os.geteuid() == 0 and shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1k tmpfs /mnt"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_mount_works(), reason="fills a small tmpfs: needs root and `unshare -m` (mounts)")
@pytest.mark.parametrize("size, written", [("600k", "checkpoint-1"), ("1100k", "final")])
def test_a_full_disk_is_one_line_and_the_run_folder_stays_whole(tmp_path, size, written):
    """torch.save on a full disk raised "unexpected pos 573632 vs 573524" and safetensors "Error while serializing":
    a traceback, as for a bug. The write stays atomic (no partial checkpoint) and the error says the disk is full."""
    import subprocess
    import sys

    run = tmp_path / "disk" / "run"
    run.parent.mkdir()
    command = (f"mount -t tmpfs -o size={size} tmpfs {run.parent} && {sys.executable} -m fastgrpo train --max-steps 1 "
               f"--no-progress-bar --output-dir {run}; echo exit $?; ls -A {run}")
    done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    *_, error = done.stderr.strip().splitlines()
    assert error == (f"fastgrpo train: error: {written}: not written, the disk of {run} is full; make room and run "
                     "again (--resume continues from the last checkpoint)"), done.stderr
    kept = ["metrics.jsonl"] if written == "checkpoint-1" else ["checkpoint-1", "metrics.jsonl"]
    assert done.stdout.split("\n")[-len(kept) - 2:] == ["exit 1", *kept, ""], done.stdout


def test_a_symlinked_final_is_refused_in_one_line(tmp_path, capsys):
    """final/ linked to another disk: a resumed run's export renamed the link aside and wrote its folder in its place,
    then failed with 'Cannot call rmtree on a symbolic link' (the link's target kept the old export); a fresh run
    named the empty link another run, whose --overwrite-output-dir failed alike."""
    from fastgrpo.train.cli import main

    target = tmp_path / "big" / "final"
    target.mkdir(parents=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "final").symlink_to(target)
    for flags in ([], ["--overwrite-output-dir"], ["--resume"]):
        assert main(["train", "--output-dir", str(run), "--max-steps", "1", "--no-progress-bar", *flags]) == 2
        assert capsys.readouterr().err == (
            f"fastgrpo train: error: output_dir: {run / 'final'} is a symlink, where a run writes a folder it replaces "
            "or deletes whole; make it a folder (or link the whole --output-dir to put the run on another disk)\n")
    assert (run / "final").is_symlink() and target.is_dir()


def test_a_folder_being_replaced_when_the_run_stopped_is_never_lost(tmp_path, monkeypatch):
    """atomic_directory replaces a folder (a checkpoint written again, final/) in two renames: the old one aside, the
    new one in place. A kill between them left neither at checkpoint-<step>/, and the resume deleted both hidden
    copies as partial writes: the checkpoint was lost. The resume now finishes the replacement (the new one was whole
    and fsynced); an exception between the renames puts the old one back."""
    import subprocess
    import sys
    from pathlib import Path

    from fastgrpo.train import atomic_folder

    script = ("import os, sys\n"
              "from fastgrpo.train.atomic_folder import atomic_directory\n"
              "real, calls = os.replace, []\n"
              "def replace(src, dst):\n"
              "    calls.append(src)\n"
              "    if len(calls) == 2:\n"
              "        os._exit(137)  # killed, as by SIGKILL: no finally runs\n"
              "    real(src, dst)\n"
              "os.replace = replace\n"
              "with atomic_directory(sys.argv[1]) as tmp:\n"
              "    (tmp / 'state').write_text('new')\n")
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    (folder / "state").write_text("old")
    killed = subprocess.run([sys.executable, "-c", script, str(folder)], cwd=Path(__file__).parents[1])
    assert killed.returncode == 137 and not folder.exists()
    RunDirectory(tmp_path).prepare(resume=True, overwrite=False)
    assert (folder / "state").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["checkpoint-2"]

    real, calls = os.replace, []

    def interrupted_second(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(atomic_folder.os, "replace", interrupted_second)
    with pytest.raises(KeyboardInterrupt):
        with atomic_folder.atomic_directory(folder) as tmp:
            (tmp / "state").write_text("newer")
    assert (folder / "state").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["checkpoint-2"]


def test_a_finished_run_resumed_applies_its_limit_but_keeps_the_damaged_checkpoint_it_skipped(tmp_path):
    """apply_save_limit (a resume with nothing to train) deletes past --save-total-limit up to the checkpoint it
    resumed from; a later, damaged one stays until the run saves one of its own, as a resume that trains keeps it."""
    from fastgrpo.train.checkpoint import apply_save_limit, list_checkpoints

    model = default_task.build_model(default_task.build_tokenizer())
    for step in (1, 2, 3):
        save_checkpoint(tmp_path / f"checkpoint-{step}", model, {"step": step, "config": {}})
    (tmp_path / "checkpoint-3" / STATE_FILE).write_bytes(b"torn")
    apply_save_limit(tmp_path, 1, 2)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 3]


def _killed_writer(tmp_path, folder, die_at_rename: int):
    """A process that writes `folder` with atomic_directory and is killed (os._exit) at its die_at_rename-th rename
    (0: while filling the folder); returns its pid, no longer running."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import os, sys\n"
              "from fastgrpo.train.atomic_folder import atomic_directory\n"
              "real, calls = os.replace, []\n"
              "def replace(src, dst):\n"
              "    calls.append(src)\n"
              f"    if len(calls) == {die_at_rename}:\n"
              "        os._exit(137)\n"
              "    real(src, dst)\n"
              "os.replace = replace\n"
              "with atomic_directory(sys.argv[1]) as tmp:\n"
              "    (tmp / 'model').write_text('new')\n"
              f"    {'os._exit(137)' if die_at_rename == 0 else 'pass'}\n")
    killed = subprocess.Popen([sys.executable, "-c", script, str(folder)], cwd=Path(__file__).parents[1])
    assert killed.wait() == 137
    return killed.pid


def test_an_export_killed_while_writing_leaves_no_copy_behind_once_the_path_is_written_again(tmp_path):
    """A killed export (`fastgrpo export --output PATH`, outside any run folder) left its partial copy of a whole model
    at .PATH.tmp-<pid> for good: no run folder's resume cleans there, and each later export wrote its own. The next
    write of PATH deletes the partial writes of processes no longer running; a running one's is not touched."""
    export = tmp_path / "exported"
    pid = _killed_writer(tmp_path, export, die_at_rename=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".exported.tmp-{pid}"]
    running = tmp_path / f".exported.tmp-{os.getppid()}"  # another export of PATH still writing
    running.mkdir()
    from fastgrpo.train.atomic_folder import atomic_directory

    with atomic_directory(export) as tmp:
        (tmp / "model").write_text("again")
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name, "exported"], list(tmp_path.iterdir())
    assert (export / "model").read_text() == "again"


def test_an_export_killed_between_its_renames_is_finished_not_lost_by_the_next_write(tmp_path, caplog):
    """Killed between the two renames, an export left no PATH: its old version at .PATH.old-<pid>, the new one (whole,
    fsynced) at .PATH.tmp-<pid>. The next write of PATH finishes that rename first, so a failure of that write
    leaves the whole copy at PATH, and deletes the old one."""
    from fastgrpo.train.atomic_folder import atomic_directory

    export = tmp_path / "exported"
    export.mkdir()
    (export / "model").write_text("old")
    pid = _killed_writer(tmp_path, export, die_at_rename=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".exported.old-{pid}", f".exported.tmp-{pid}"]
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.atomic_folder"):
        with pytest.raises(RuntimeError, match="export failed"):
            with atomic_directory(export):
                raise RuntimeError("export failed")
    assert (export / "model").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["exported"]
    assert "put back the whole copy a stopped process left" in caplog.text
