"""A run folder holds one run: another run's files stop a fresh run (or are deleted with overwrite), a second
concurrent run is refused by the lock, a stale lock is taken over; checkpoints are written atomically and read
with weights_only; a torn or crafted checkpoint never loads; resume refuses changed run-defining settings."""
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.checkpoint import list_checkpoints, read_run_config, save_checkpoint
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.metrics_log import MetricsLog
from fastgrpo.train.run_dir import LOCK_FILE, RunDirectory, RunLock
from fastgrpo.train.trainer import GRPOTrainer

TINY = dict(batch_size=8, num_generations=4, micro_batch_size=8, max_completion_length=4, export=False,
            progress_bar=False, logging_steps=0)


def _trainer(tmp_path, reward=default_task.repeat_letter_reward, **fields):
    config = GRPOConfig(**{**default_task.PRESET, **TINY, "output_dir": str(tmp_path), **fields})
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer, seed=1)
    return GRPOTrainer(model, tokenizer, reward, default_task.build_dataset(32), config)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("use_flock", [True, False], ids=["flock", "pid-only"])
def test_second_run_is_refused_and_a_stale_lock_taken_over(tmp_path, caplog, use_flock):
    held = RunLock(tmp_path, use_flock=use_flock)
    held.acquire()
    with pytest.raises(ValueError, match=rf"in use by another run \(PID {os.getpid()} on "):
        RunLock(tmp_path, use_flock=use_flock).acquire()
    held.release()
    assert not (tmp_path / LOCK_FILE).exists()
    # A run killed without releasing leaves its lock file: its PID no longer runs (and it holds no flock).
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": _dead_pid(), "host": os.uname().nodename}))
    lock = RunLock(tmp_path, use_flock=use_flock)
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.run_dir"):
        lock.acquire()
    assert "stale" in caplog.text or "ended without releasing" in caplog.text, caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_two_runs_taking_over_a_stale_lock_at_once_without_flock_do_not_both_hold_it(tmp_path, monkeypatch):
    """Without flock, a stale lock was deleted by each run that found it stale: one starting at the same moment had
    deleted it and made its own lock by then, and the second run's unlink deleted that one: both held the folder.
    The second now sees the lock is no longer the stale one, leaves it, and is refused."""
    from fastgrpo.train import run_dir

    stale = {"pid": _dead_pid(), "host": os.uname().nodename}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    first = RunLock(tmp_path, use_flock=False)
    read_holder = run_dir._read_holder_at

    def first_run_takes_it_meanwhile(path):
        holder = read_holder(path)
        if holder == stale and first._fd is None:  # the other run deletes the stale lock and makes its own now
            path.unlink()
            first.acquire()
        return holder

    monkeypatch.setattr(run_dir, "_read_holder_at", first_run_takes_it_meanwhile)
    with pytest.raises(ValueError, match=rf"in use by another run \(PID {os.getpid()} on "):
        RunLock(tmp_path, use_flock=False).acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]
    first.release()


def test_fresh_run_refuses_another_runs_folder_and_overwrite_deletes_it(tmp_path):
    first = _trainer(tmp_path, max_steps=3, save_steps=1, save_total_limit=None).train()
    (tmp_path / "run.yaml").write_text("seed: 0\n")  # the user's own file stays
    with pytest.raises(ValueError, match=r"holds another run \(checkpoint-1, checkpoint-2, checkpoint-3, "
                                         r"metrics.jsonl\); continue it with resume=True, or start afresh with "
                                         r"overwrite_output_dir=True"):
        _trainer(tmp_path, max_steps=2).train()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # untouched
    second = _trainer(tmp_path, max_steps=2, overwrite_output_dir=True).train()
    assert [m["step"] for m in second] == [1, 2] and second[0]["reward"] == first[0]["reward"]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2]  # the old run's 1 and 3 are gone
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (tmp_path / "run.yaml").exists() and not (tmp_path / LOCK_FILE).exists()
    with pytest.raises(ValueError, match="overwrite_output_dir: deletes the checkpoints that resume continues"):
        RunDirectory(tmp_path).prepare(resume=True, overwrite=True)


def test_save_total_limit_keeps_the_newest(tmp_path):
    _trainer(tmp_path, max_steps=4, save_steps=1, save_total_limit=2).train()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3, 4]


def test_a_failed_write_leaves_no_checkpoint_and_the_old_one_whole(tmp_path):
    model = default_task.build_model(default_task.build_tokenizer())
    save_checkpoint(tmp_path / "checkpoint-1", model, {"step": 1})
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        save_checkpoint(tmp_path / "checkpoint-1", model, {"step": 1, "bad": lambda: None})  # fails mid-write
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        save_checkpoint(tmp_path / "checkpoint-2", model, {"step": 2, "bad": lambda: None})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # no checkpoint-2, no temporary folder
    assert torch.load(tmp_path / "checkpoint-1" / "trainer_state.pt", weights_only=True)["step"] == 1


class _CreatesAFile:
    """Unpickling this calls open(path, "w"): code run by loading a checkpoint."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_crafted_checkpoint_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "out" / "checkpoint-1"
    folder.mkdir(parents=True)
    torch.save({"step": 1, "config": {}, "payload": _CreatesAFile(marker)}, folder / "trainer_state.pt")
    assert not marker.exists()
    trainer = _trainer(tmp_path / "out", max_steps=2, resume=True)
    with pytest.raises(ValueError, match="holds objects other than tensors and plain containers; refused"):
        trainer.train()
    with pytest.raises(ValueError, match="refused"):
        read_run_config(folder)  # `fastgrpo eval --checkpoint` reads the config the same way
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"<html>404 Not Found</html>", b"\0" * 64, b"version https://git-lfs"],
                         ids=["html", "zeros", "lfs-pointer"])
def test_a_damaged_checkpoint_is_named_unreadable_not_crafted(tmp_path, content):
    # a file torch.save did not write (a download's error page, a Git LFS pointer, zeros after a crash) was refused as
    # "holds objects other than tensors...; could run code": a damaged file, not a crafted one
    from fastgrpo.train.checkpoint import TornCheckpoint, read_checkpoint

    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "trainer_state.pt").write_bytes(content)
    state = folder / "trainer_state.pt"
    with pytest.raises(TornCheckpoint, match=rf"^{state}: not a file torch.save wrote \(File is not a zip file\)$"):
        read_checkpoint(folder)
    with pytest.raises(ValueError, match=rf"^checkpoint: cannot read {state}: not a file torch.save wrote"):
        read_run_config(folder)  # `fastgrpo eval --checkpoint` reads the config the same way


def test_resume_names_each_changed_setting(tmp_path, caplog):
    _trainer(tmp_path, max_steps=1).train()
    with pytest.raises(ValueError, match=r"resume: checkpoint-1 was made with other settings: temperature: 1.0 in "
                                         r"the checkpoint, 0.5 now; learning_rate: 0.003 in the checkpoint, 0.5 now;"
                                         r" seed: 0 in the checkpoint, 3 now; resume with the run's own settings "
                                         r"\(checkpoint-1/run_config.json holds them all\), or "
                                         r"pass resume_allow_changes=True"):
        _trainer(tmp_path, max_steps=2, resume=True, learning_rate=0.5, seed=3, temperature=0.5).train()
    # Run-control settings may change; the run continues where it was.
    history = _trainer(tmp_path, max_steps=2, resume=True, save_steps=7, logging_steps=3, micro_batch_size=4).train()
    assert [m["step"] for m in history] == [2]
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.config"):
        history = _trainer(tmp_path, max_steps=3, resume=True, learning_rate=0.5, resume_allow_changes=True).train()
    assert [m["step"] for m in history] == [3] and "learning_rate: 0.003 in the checkpoint, 0.5 now" in caplog.text


def test_a_damaged_run_config_is_named(tmp_path, capsys):
    from fastgrpo.train.cli import main

    assert main(["train", "--output-dir", str(tmp_path), "--max-steps", "1", "--no-progress-bar", "--no-export"]) == 0
    config = tmp_path / "checkpoint-1" / "run_config.json"
    config.write_text('{"seed": 0,\n')  # cut short
    capsys.readouterr()
    assert main(["train", "--output-dir", str(tmp_path), "--max-steps", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint: {config} is damaged (" in err and err.count("\n") == 1, err


def test_allowed_changes_are_warned_about_once(tmp_path, capsys):
    from fastgrpo.train.cli import main

    argv = ["train", "--output-dir", str(tmp_path), "--no-progress-bar", "--no-export", "--max-steps"]
    assert main([*argv, "1"]) == 0
    capsys.readouterr()
    assert main([*argv, "2", "--resume", "--learning-rate", "0.01", "--resume-allow-changes"]) == 0
    err = capsys.readouterr().err
    assert err.count("with changed settings: learning_rate: 0.003 in the checkpoint, 0.01 now") == 1, err


def test_resuming_a_finished_run_says_so_without_training(tmp_path, capsys):
    from fastgrpo.train.cli import main

    argv = ["train", "--output-dir", str(tmp_path), "--no-progress-bar", "--max-steps", "1"]
    assert main(argv) == 0
    metrics = (tmp_path / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    out = capsys.readouterr().out
    assert out == (f"fastgrpo train: nothing to train: the run in {tmp_path} is at step 1 (checkpoint-1) of "
                   f"--max-steps 1, exported to {tmp_path / 'final'}; pass a larger --max-steps to train on\n"), out
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    shutil.rmtree(tmp_path / "final")  # stopped before its export: the resume exports, training nothing
    assert main([*argv, "--resume"]) == 0
    assert "nothing to train" not in capsys.readouterr().out and (tmp_path / "final" / "config.json").is_file()
    assert (tmp_path / "metrics.jsonl").read_text() == metrics


def test_report_to_is_checked_also_when_a_resume_finds_nothing_to_train(tmp_path, capsys):
    """A finished run resumed skips the trainer, whose metrics log checked report_to: a bad name passed silently
    there (exit 0) and failed a resume that trains on. Both fail alike, before the model loads."""
    from fastgrpo.train.cli import main

    argv = ["train", "--output-dir", str(tmp_path), "--no-progress-bar", "--no-export", "--max-steps"]
    assert main([*argv, "1"]) == 0
    capsys.readouterr()
    line = "fastgrpo train: error: report_to: expected one of ['wandb', 'tensorboard'], got 'wandbb'\n"
    for max_steps in ("1", "2"):  # nothing left to train; a step left
        assert main([*argv, max_steps, "--resume", "--report-to", "wandbb"]) == 2
        assert capsys.readouterr().err == line
    assert list_checkpoints(tmp_path)[-1][0] == 1


def test_a_finished_run_resumed_from_python_says_so(tmp_path, caplog):
    """GRPOTrainer.train() with resume=True on a run at max_steps returns [] with a warning naming the step and the
    keyword to raise (the CLI's line, in Python's names); it returned [] silently."""
    import logging

    _trainer(tmp_path, max_steps=1).train()
    with caplog.at_level(logging.WARNING, logger="fastgrpo"):
        assert _trainer(tmp_path, max_steps=1, resume=True).train() == []
    assert (f"nothing to train: the run in {tmp_path} is at step 1 of max_steps=1; pass a larger max_steps to train "
            "on") in caplog.text, caplog.text


def test_a_finished_run_resumed_keeps_no_more_checkpoints_than_its_limit(tmp_path, capsys):
    """A resume with nothing to train saves no checkpoint, after which it pruned: a --save-total-limit lowered since
    went unapplied, the run keeping a checkpoint more than the limit said. It applies now, as at a run's next save,
    and says what it deleted; from the CLI (no model loaded) and from Python."""
    from fastgrpo.train.cli import main

    cli, python = tmp_path / "cli", tmp_path / "python"
    argv = ["train", "--output-dir", str(cli), "--no-progress-bar", "--no-export", "--max-steps", "3", "--save-steps",
            "1"]
    assert main(argv) == 0  # the default limit of 2
    assert [step for step, _ in list_checkpoints(cli)] == [2, 3]
    capsys.readouterr()
    assert main([*argv, "--resume", "--save-total-limit", "1"]) == 0
    assert "save_total_limit: deleted checkpoint-2" in capsys.readouterr().err
    assert [step for step, _ in list_checkpoints(cli)] == [3]
    _trainer(python, max_steps=2, save_steps=1).train()
    assert _trainer(python, max_steps=2, save_total_limit=1, resume=True).train() == []
    assert [step for step, _ in list_checkpoints(python)] == [2]


@pytest.mark.parametrize("argv, line", [
    (["sft", "--max-steps", "1"],
     "is at step 1 (checkpoint-1) of 1 (--max-steps 1); pass a larger --max-steps to train on"),
    (["ei", "--ei-steps", "1", "--questions-per-step", "4"],
     "is at round 1 (checkpoint-1) of --ei-steps 1; pass a larger --ei-steps to train on"),
])
def test_a_finished_sft_or_ei_run_resumed_says_so(tmp_path, capsys, argv, line):
    from fastgrpo.train.cli import main

    argv = [*argv, "--output-dir", str(tmp_path), "--no-progress-bar", "--no-export", "--logging-steps", "0"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    out = capsys.readouterr().out
    assert out == f"fastgrpo {argv[0]}: nothing to train: the run in {tmp_path} {line}\n", out


def test_a_run_without_a_checkpoint_is_not_offered_to_resume(tmp_path, capsys):
    """A run that stopped before its first checkpoint left its metrics: a fresh run there is pointed at
    --overwrite-output-dir only, and --resume, which has nothing to continue, says so and points there too."""
    from fastgrpo.train.cli import main

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    argv = ["train", "--output-dir", str(tmp_path), "--max-steps", "1", "--no-progress-bar"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds another run (metrics.jsonl); start afresh with --overwrite-output-dir" in err, err
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "start without --resume (with --overwrite-output-dir where a run left files" in err, err
    assert main([*argv, "--overwrite-output-dir"]) == 0


def test_a_run_that_fails_at_its_first_step_leaves_no_metrics_log(tmp_path):
    """A run whose first step raised left an empty metrics.jsonl (which kept the folder it created, too): the log is
    created at its first line now. A resumed run that fails keeps the lines of the steps before."""
    from fastgrpo.rewards.scoring import RewardError

    def broken(prompts, completions, **kwargs):
        raise RuntimeError("reward server down")

    run = tmp_path / "run"
    with pytest.raises(RewardError, match="reward server down"):
        _trainer(run, broken, max_steps=1).train()
    assert not run.exists()  # created by the run, removed with nothing in it
    _trainer(run, max_steps=1).train()  # the same folder: a fresh run, not refused
    logged = (run / "metrics.jsonl").read_text()
    assert logged.count("\n") == 1
    with pytest.raises(RewardError, match="reward server down"):
        _trainer(run, broken, max_steps=2, resume=True).train()
    assert (run / "metrics.jsonl").read_text() == logged


def test_a_tensorboard_run_that_fails_at_its_first_step_leaves_no_folder(tmp_path):
    """report_to=["tensorboard"] made its tensorboard/ folder when the log was built: GRPOTrainer builds it before
    train() checks the folder, which then refused the run as 'holds another run (tensorboard)', and a run whose first
    step raised would have kept the folder. The writer starts at the first line now, as metrics.jsonl does."""
    pytest.importorskip("tensorboard", reason="report_to tensorboard needs `pip install tensorboard`")
    from fastgrpo.rewards.scoring import RewardError

    def broken(prompts, completions, **kwargs):
        raise RuntimeError("reward server down")

    run = tmp_path / "run"
    with pytest.raises(RewardError, match="reward server down"):
        _trainer(run, broken, max_steps=1, report_to=["tensorboard"]).train()
    assert not run.exists()
    _trainer(run, max_steps=1, report_to=["tensorboard"]).train()
    assert any((run / "tensorboard").iterdir())


def test_truncated_last_metrics_line_is_dropped_with_a_warning(tmp_path, caplog):
    lines = [json.dumps({"step": s, "reward": 0.5}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "rew')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        MetricsLog(tmp_path).start_at(2)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines[:2]
    assert "dropped unreadable line 4" in caplog.text


def test_a_users_folder_named_like_a_checkpoint_is_neither_refused_nor_deleted(tmp_path):
    notes = tmp_path / "checkpoint-notes"
    notes.mkdir()
    (notes / "a.txt").write_text("keep")
    (tmp_path / ".checkpoint-ideas").mkdir()  # hidden, but not a partial write's name (.checkpoint-<step>.tmp-<pid>)
    _trainer(tmp_path, max_steps=1).train()  # a fresh run: the folder holds no run
    _trainer(tmp_path, max_steps=1, overwrite_output_dir=True).train()
    assert (notes / "a.txt").read_text() == "keep" and (tmp_path / ".checkpoint-ideas").is_dir()
    (tmp_path / ".checkpoint-1.tmp-99").mkdir()  # what a killed checkpoint write leaves: a resume deletes it
    RunDirectory(tmp_path).prepare(resume=True, overwrite=False)
    assert not (tmp_path / ".checkpoint-1.tmp-99").exists() and (tmp_path / ".checkpoint-ideas").is_dir()


def test_the_partial_writes_of_a_killed_run_are_deleted_by_a_resume_and_the_users_files_kept(tmp_path, caplog):
    """A kill leaves hidden partial writes: a checkpoint's or an export's folder (atomic_directory, delete_folder),
    the metrics log cut back on a resume (write_whole). The log's was neither deleted by a resume nor counted as the
    run's by a fresh run (left beside the next run's files). A resume deletes each, saying so; a user's hidden files
    named alike stay."""
    _trainer(tmp_path, max_steps=1).train()
    partial = [".checkpoint-2.tmp-99", ".checkpoint-1.old-98", ".final.tmp-97", ".metrics.jsonl.tmp"]
    users = [".checkpoint-ideas", ".final.notes", ".metrics.jsonl.bak"]
    for name in partial[:3] + users[:1]:
        (tmp_path / name).mkdir()
    for name in partial[3:] + users[1:]:
        (tmp_path / name).write_text("{}\n")
    with caplog.at_level(logging.INFO, logger="fastgrpo.train.run_dir"):
        RunDirectory(tmp_path).prepare(resume=True, overwrite=False)
    assert [name for name in partial if (tmp_path / name).exists()] == []
    assert all((tmp_path / name).exists() for name in users)
    assert "deleted .metrics.jsonl.tmp, a partial write of a stopped run" in caplog.text
    (tmp_path / ".metrics.jsonl.tmp").write_text("{}\n")  # a fresh run refuses it as the run's; overwriting deletes it
    with pytest.raises(ValueError, match=r"holds another run \(\.metrics\.jsonl\.tmp, checkpoint-1, metrics"):
        RunDirectory(tmp_path).prepare(resume=False, overwrite=False)
    RunDirectory(tmp_path).prepare(resume=False, overwrite=True)
    assert not (tmp_path / ".metrics.jsonl.tmp").exists() and all((tmp_path / name).exists() for name in users)


def test_a_fresh_run_refuses_an_evaluations_results_and_overwrite_deletes_them(tmp_path):
    for name in ("results.jsonl", "summary.json"):
        (tmp_path / name).write_text("{}\n")
    with pytest.raises(ValueError, match=r"holds the results of a `fastgrpo eval` \(results.jsonl, summary.json\); "
                                         r"pick another output_dir, or start afresh with overwrite_output_dir=True"):
        RunDirectory(tmp_path).prepare(resume=False, overwrite=False, command="train")
    _trainer(tmp_path, max_steps=1, overwrite_output_dir=True).train()
    assert not (tmp_path / "summary.json").exists()  # it described the checkpoints that overwriting deleted


@pytest.mark.parametrize("path, expected", [("", r"output_dir: expected a folder path, got ''"),
                                            ("/proc/fastgrpo-run", r"output_dir: cannot create /proc/fastgrpo-run")])
def test_an_output_dir_that_cannot_hold_a_run_is_named(path, expected):
    with pytest.raises(ValueError, match=expected):
        with RunDirectory(path):
            pass


def test_resuming_past_a_damaged_checkpoint_deletes_it_once_the_run_has_a_newer_one(tmp_path, caplog):
    _trainer(tmp_path, max_steps=4, save_steps=2, save_total_limit=2).train()
    state = tmp_path / "checkpoint-4" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # damaged: the resume goes back to checkpoint-2
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.checkpoint"):
        resumed = _trainer(tmp_path, max_steps=3, save_steps=2, save_total_limit=2, resume=True).train()
    assert [m["step"] for m in resumed] == [3]
    # kept, the damaged 4 of the steps this run went back over would push 2 out of the rotation and be the next
    # --resume's pick
    assert "deleted checkpoint-4, left by the steps this run went back over" in caplog.text
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 3]


def test_a_resume_without_export_warns_that_final_is_older(tmp_path, caplog):
    _trainer(tmp_path, max_steps=2, export=True).train()
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.final_export"):
        _trainer(tmp_path, max_steps=3, resume=True).train()  # TINY: export=False
    assert f"export: {tmp_path / 'final'} holds the weights of an earlier point of this run" in caplog.text


def test_a_finished_run_resumed_from_python_keeps_its_final_folder(tmp_path):
    """GRPOTrainer.train(resume=True) on a finished run leaves final/ as it was (the same weights): it exported them
    again, which deleted what the user had put beside them (an eval's results); a run that missed its export gets it."""
    _trainer(tmp_path, max_steps=1, export=True).train()
    note = tmp_path / "final" / "eval" / "summary.json"
    note.parent.mkdir()
    note.write_text("{}")
    _trainer(tmp_path, max_steps=1, export=True, resume=True).train()
    assert note.read_text() == "{}"
    shutil.rmtree(tmp_path / "final")
    _trainer(tmp_path, max_steps=1, export=True, resume=True).train()
    assert (tmp_path / "final" / "config.json").is_file()


def test_tensorboard_shows_each_step_a_resume_redid_once_as_metrics_jsonl_does(tmp_path):
    """A run stopped after logging step 3 but before its checkpoint-3: the resume from checkpoint-2 redoes step 3,
    which its tensorboard writer logged beside the stopped run's, so TensorBoard drew step 3 twice. The writer
    purges from the first step redone (purge_step): each step once, with the value metrics.jsonl keeps."""
    pytest.importorskip("tensorboard", reason="report_to tensorboard needs `pip install tensorboard`")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _trainer(tmp_path, max_steps=3, save_steps=2, report_to=["tensorboard"]).train()
    shutil.rmtree(tmp_path / "checkpoint-3")  # the kill came before the step's checkpoint
    _trainer(tmp_path, max_steps=3, save_steps=2, report_to=["tensorboard"], resume=True).train()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    drawn = [(event.step, event.value) for event in events.Scalars("step_s")]  # a time: each run's differs
    assert drawn == [(row["step"], pytest.approx(row["step_s"], rel=1e-6)) for row in logged], drawn


def test_a_damaged_newest_checkpoint_at_max_steps_is_not_a_finished_run(tmp_path, capsys):
    """--resume said "nothing to train" from the newest checkpoint's name while the resume itself skips a damaged
    one: the run stayed at step 1 for good. It resumes from the checkpoint a resume loads and trains the step."""
    from fastgrpo.train.cli import main

    argv = ["train", "--output-dir", str(tmp_path), "--no-progress-bar", "--no-export", "--max-steps", "2",
            "--save-steps", "1", "--logging-steps", "0"]
    assert main(argv) == 0
    state = tmp_path / "checkpoint-2" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # a copy cut short
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    out, err = capsys.readouterr()
    assert "nothing to train" not in out and "(step 2); metrics in" in out, out
    assert err.count("resume: skipped checkpoint-2, which is incomplete or damaged") == 1, err
    assert torch.load(state, weights_only=True)["step"] == 2
    for step in (1, 2):  # none left to resume from: the resume's error, before the model loads
        state = tmp_path / f"checkpoint-{step}" / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[:100])
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"error: resume: every checkpoint in {tmp_path} is incomplete or damaged (see the warnings)\n" in err, err
    assert "resumed from" not in err and err.count("resume: skipped checkpoint-") == 2, err


@pytest.mark.parametrize("argv, where", [
    (["train", "--max-steps", "1"], "step 1 of --max-steps 1"),
    (["sft", "--max-steps", "1"], "step 1 of 1 (--max-steps 1)"),
    (["ei", "--ei-steps", "1", "--questions-per-step", "4"], "round 1 of --ei-steps 1"),
])
def test_a_finished_run_resumed_without_its_export_says_it_exports_it(tmp_path, capsys, argv, where):
    """--resume of a finished run whose final/ is missing (stopped before its export) or of another step (it went on
    with --no-export): the export is the work left. It warned "nothing to train ...; pass a larger --max-steps to
    train on" and exported anyway; it says it exports, and does."""
    from fastgrpo.train.cli import main

    argv = [*argv, "--output-dir", str(tmp_path), "--no-progress-bar", "--logging-steps", "0"]
    assert main(argv) == 0
    final = tmp_path / "final"
    shutil.rmtree(final)
    for left in ("is missing", "holds another point's weights"):
        capsys.readouterr()
        assert main([*argv, "--resume"]) == 0
        err = capsys.readouterr().err
        assert (f"warning: nothing to train: the run in {tmp_path} is at {where}; exporting it to {final}, which "
                f"{left}\n") in err, err
        assert "pass a larger" not in err and json.loads((final / "export.json").read_text())["step"] == 1
        (final / "export.json").write_text(json.dumps({**json.loads((final / "export.json").read_text()), "step": 0}))


def test_a_file_written_whole_reaches_the_disk_before_its_rename(tmp_path, monkeypatch):
    """The metrics log cut back on a resume is renamed over the old one: were its data not flushed first, a power
    loss could leave metrics.jsonl empty under its name (the run's history gone). Before: no fsync."""
    from fastgrpo.train import run_dir

    events, real_replace = [], os.replace
    monkeypatch.setattr(run_dir, "fsync_path", lambda path: events.append(("fsync", path.name, _text_of(path))))
    monkeypatch.setattr(run_dir.os, "replace", lambda src, dst: (events.append(("rename", Path(dst).name, None)),
                                                                 real_replace(src, dst)))
    (tmp_path / "metrics.jsonl").write_text("old\n")
    run_dir.write_whole(tmp_path / "metrics.jsonl", "new\n")
    assert events == [("fsync", ".metrics.jsonl.tmp", "new\n"), ("rename", "metrics.jsonl", None),
                      ("fsync", tmp_path.name, None)], events
    assert (tmp_path / "metrics.jsonl").read_text() == "new\n"


def _text_of(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None
