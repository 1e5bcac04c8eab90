"""`fastgrpo eval --overwrite-output-dir` replaces the previous evaluation's results.jsonl and summary.json only once
its own are complete: an evaluation that stops early (a reward error, out of memory, Ctrl-C, a full disk as it
writes) leaves them byte for byte. Before, it deleted them as it started and a stopped re-run left the user with
neither. The refusals (no --overwrite-output-dir, a folder in use, inside a run's checkpoint) are as they were, and
train's --overwrite-output-dir still deletes at its start (it writes progressively)."""
import errno
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from fastgrpo.rollout import BuiltinEngine
from fastgrpo.train.cli import main
from fastgrpo.train.run_dir import RunDirectory, RunLock

QUIET = ["--no-progress-bar", "--logging-steps", "0"]
EVAL = ["eval", "--max-examples", "6", "--batch-size", "2"]  # 3 batches: a stop in the second is mid-evaluation


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    """The files of a finished evaluation (4 examples), copied into each test's folder."""
    folder = tmp_path_factory.mktemp("previous") / "eval"
    assert main([*EVAL, "--max-examples", "4", "--output-dir", str(folder)]) == 0
    return _files(folder)


def _files(folder: Path) -> dict:
    """Every entry of `folder`, hidden ones too, as {name: bytes} ('<folder>' for a folder)."""
    return {p.name: p.read_bytes() if p.is_file() else "<folder>" for p in sorted(folder.iterdir())}


def _holding(folder: Path, files: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def _in_batch_2(monkeypatch, stop):
    """Call stop() as the evaluation generates its second batch."""
    calls, generate = [], BuiltinEngine.generate

    def generate_then_stop(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            stop()
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(BuiltinEngine, "generate", generate_then_stop)


def _raise(error):
    def stop():
        raise error
    return stop


def _full_disk_at_the_summary(monkeypatch):
    """The disk fills as the evaluation writes its summary (its results written in full beside theirs)."""
    write_text = Path.write_text

    def full_at_the_summary(path, *args, **kwargs):
        if "summary.json" in path.name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_at_the_summary)


def _failing_reward(tmp_path) -> list[str]:
    file = tmp_path / "flaky_reward.py"
    file.write_text("from fastgrpo.train.default_task import repeat_letter_reward\n"
                    "calls = []\n"
                    "def reward(prompts, completions, **columns):\n"
                    "    calls.append(1)\n"
                    "    if len(calls) == 2:\n"
                    "        raise RuntimeError('grader crashed')\n"
                    "    return repeat_letter_reward(prompts, completions, **columns)\n")
    return ["--reward-funcs", f"{file}:reward"]


STOPS = {  # how a re-run stops: (exit code, what the last line of stderr says)
    "a reward error": (1, "error: reward function reward raised RuntimeError: grader crashed"),
    "out of memory": (1, "OutOfMemoryError"),
    "Ctrl-C": (130, "fastgrpo eval: interrupted"),
    "a full disk as it writes": (1, "No space left on device"),
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_a_stopped_overwrite_keeps_the_previous_results_byte_for_byte(previous, tmp_path, capsys, monkeypatch, stop):
    """Before: every one of these left the folder empty (results.jsonl and summary.json deleted as eval started)."""
    out = _holding(tmp_path / "eval", previous)
    flags = []
    if stop == "a reward error":
        flags = _failing_reward(tmp_path)
    elif stop == "out of memory":
        _in_batch_2(monkeypatch, _raise(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")))
    elif stop == "Ctrl-C":
        _in_batch_2(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGINT))
    else:
        _full_disk_at_the_summary(monkeypatch)
    capsys.readouterr()
    try:
        code = main([*EVAL, *flags, "--output-dir", str(out), "--overwrite-output-dir"])
        err = capsys.readouterr().err
    except torch.OutOfMemoryError as error:  # not one of the errors the CLI says in one line: its traceback
        code, err = 1, f"{capsys.readouterr().err}{type(error).__name__}: {error}"
    expected_code, said = STOPS[stop]
    assert code == expected_code and said in err, (code, err)
    kept = {name: data for name, data in _files(out).items() if not name.endswith(".tmp")}  # a stopped write's
    assert kept == previous, f"after {stop}: {sorted(kept)} in the folder, {sorted(previous)} before"
    assert "deleted" not in err and "replaced" not in err, err  # nothing was


def test_a_completed_overwrite_replaces_the_previous_results(previous, tmp_path, capsys):
    out = _holding(tmp_path / "eval", previous)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # another command's: not eval's to replace
    capsys.readouterr()
    assert main([*EVAL, "--output-dir", str(out), "--overwrite-output-dir"]) == 0
    err = capsys.readouterr().err
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == 6 and summary["num_examples"] == 6 and summary["config"]["max_examples"] == 6
    assert sorted(_files(out)) == ["metrics.jsonl", "results.jsonl", "summary.json"]  # no partial write left
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # what the log says is true when it says it: kept as the evaluation starts, replaced at its end
    kept = err.index("output_dir: the previous run's results.jsonl, summary.json stay until this run replaces them")
    replaced = err.index("output_dir: replaced the previous run's results.jsonl, summary.json")
    assert kept < replaced, err


def test_a_stop_between_the_two_renames_leaves_no_mix_of_two_evaluations(previous, tmp_path, monkeypatch):
    """The results and the summary are two files: a stop after the results took their place leaves them without a
    summary, never beside the previous evaluation's summary, which would describe other results."""
    out = _holding(tmp_path / "eval", previous)
    replace = os.replace

    def killed_at_the_summary(src, dst, *args, **kwargs):
        if Path(dst).name == "summary.json":
            raise KeyboardInterrupt
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", killed_at_the_summary)
    assert main([*EVAL, "--output-dir", str(out), "--overwrite-output-dir"]) == 130
    files = _files(out)
    assert "summary.json" not in files and files["results.jsonl"] != previous["results.jsonl"], sorted(files)
    assert len(files["results.jsonl"].splitlines()) == 6


def test_the_refusals_are_unchanged(previous, tmp_path, capsys):
    """Without --overwrite-output-dir, in a folder another run holds, or inside a run's checkpoint: refused in one
    line, the previous results untouched (these held before too)."""
    out = _holding(tmp_path / "eval", previous)
    assert main([*EVAL, "--output-dir", str(out)]) == 2
    assert "holds the results of a `fastgrpo eval` (results.jsonl, summary.json); pick another --output-dir, or " \
           "start afresh with --overwrite-output-dir (replaces them once it is done)" in capsys.readouterr().err
    lock = RunLock(out)
    lock.acquire()
    try:
        assert main([*EVAL, "--output-dir", str(out), "--overwrite-output-dir"]) == 2
        assert f"output_dir: {out} is in use by another run (PID {os.getpid()}" in capsys.readouterr().err
    finally:
        lock.release()
    assert _files(out) == previous
    run = tmp_path / "run"
    assert main(["train", "--max-steps", "1", "--save-steps", "1", "--output-dir", str(run), *QUIET]) == 0
    capsys.readouterr()
    assert main([*EVAL, "--output-dir", str(run / "checkpoint-1"), "--overwrite-output-dir"]) == 2
    assert f"output_dir: {run / 'checkpoint-1'} is a checkpoint of the run in {run}" in capsys.readouterr().err


def test_eval_overwrites_its_results_in_a_train_runs_folder_and_train_still_deletes_them_first(previous, tmp_path):
    """An evaluation into a train run's folder replaces only its own results (the run's checkpoint stays); a fresh
    train into a folder holding them refuses it, and --overwrite-output-dir deletes them as it prepares the folder,
    as before (train writes as it goes)."""
    run = tmp_path / "run"
    assert main(["train", "--max-steps", "1", "--save-steps", "1", "--output-dir", str(run), *QUIET]) == 0
    _holding(run, previous)
    checkpoint = _files(run / "checkpoint-1")
    assert main([*EVAL, "--output-dir", str(run), "--overwrite-output-dir"]) == 0
    assert _files(run / "checkpoint-1") == checkpoint and (run / "metrics.jsonl").is_file()
    assert _files(run)["summary.json"] != previous["summary.json"]
    folder = _holding(tmp_path / "evaluated", previous)
    with RunDirectory(folder) as run_dir:
        with pytest.raises(ValueError, match="holds the results of a `fastgrpo eval`"):
            run_dir.prepare(resume=False, overwrite=False, command="train")
        run_dir.prepare(resume=False, overwrite=True, command="train")
        assert sorted(_files(folder)) == [".fastgrpo.lock"]  # deleted at once


def test_a_folder_at_a_results_name_is_refused_before_the_evaluation(previous, tmp_path, capsys):
    """A folder of the user's named summary.json is not an evaluation's file: refused in one line before anything
    runs (before: --overwrite-output-dir deleted it with whatever it held)."""
    out = _holding(tmp_path / "eval", {"results.jsonl": previous["results.jsonl"]})
    (out / "summary.json").mkdir()
    (out / "summary.json" / "notes.txt").write_text("mine")
    assert main([*EVAL, "--output-dir", str(out), "--overwrite-output-dir"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: output_dir: {out / 'summary.json'} is a folder, where the run writes a file; move "
                        f"it out of {out}, or pick another --output-dir\n"), err
    assert (out / "summary.json" / "notes.txt").read_text() == "mine"
    assert (out / "results.jsonl").read_bytes() == previous["results.jsonl"]


FAILS_ON_RANK_1 = '''import torch.distributed as dist

from fastgrpo.train.default_task import repeat_letter_reward


def fails_on_rank_1(prompts, completions, **kwargs):
    if dist.get_rank() == 1:
        raise RuntimeError("no score here")
    return repeat_letter_reward(prompts, completions, **kwargs)
'''


def test_under_torchrun_rank_0_replaces_the_results_only_once_every_process_is_done(previous, tmp_path):
    """2 gloo processes: a reward failing on rank 1 alone stops both and leaves the previous results byte for byte
    (before: deleted by rank 0 as it prepared the folder); an evaluation that ends replaces them."""
    from tests.forked_gloo import cli, run_forked

    (tmp_path / "reward.py").write_text(FAILS_ON_RANK_1)
    stopped, done = _holding(tmp_path / "out" / "stopped", previous), _holding(tmp_path / "out" / "done", previous)
    overwrite = [*EVAL, "--max-new-tokens", "4", "--overwrite-output-dir", "--output-dir"]
    runs = [[*overwrite, str(stopped), "--reward-funcs", f"{tmp_path / 'reward.py'}:fails_on_rank_1"],
            [*overwrite, str(done)]]
    found = run_forked(cli, tmp_path, runs, deadline_s=120, group_timeout_s=60)
    assert [rank["exits"] for rank in found] == [[1, 0], [1, 0]], found[0]["stderr"]
    assert _files(stopped) == previous, sorted(_files(stopped))
    assert sorted(_files(done)) == ["results.jsonl", "summary.json"]
    assert json.loads((done / "summary.json").read_text())["num_examples"] == 6
