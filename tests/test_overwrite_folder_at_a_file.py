"""A folder of the user's at a name where a run writes a file (metrics.jsonl, results.jsonl, summary.json, a partial
write's .<name>.tmp) is not a run's file: `fastgrpo train / sft / ei` refuse it in one line before anything is
deleted, as `fastgrpo eval` does. Before, --overwrite-output-dir deleted it with everything in it (shutil.rmtree),
after a refusal that listed it as the previous run's. Moved out, an ordinary overwrite works as it did."""
import re
import shutil
from pathlib import Path

import pytest

from fastgrpo.train.cli import main
from fastgrpo.train.run_dir import RunDirectory

QUIET = ["--no-progress-bar", "--no-export", "--logging-steps", "0"]
COMMANDS = {"train": ["train", "--max-steps", "1"], "sft": ["sft", "--max-steps", "1"],
            "ei": ["ei", "--ei-steps", "1", "--questions-per-step", "4"]}
FILE_NAMES = ("metrics.jsonl", "results.jsonl", "summary.json", ".metrics.jsonl.tmp", ".results.jsonl.tmp")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """{command: the folder of a finished 1-step run of it}, copied into each test's folder."""
    runs = {}
    for command, argv in COMMANDS.items():
        runs[command] = tmp_path_factory.mktemp(command) / "run"
        assert main([*argv, "--output-dir", str(runs[command]), *QUIET]) == 0
    return runs


def _everything(folder: Path) -> dict:
    """Every file and folder under `folder` except the lock, as {relative path: bytes} ('<folder>' for a folder)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else "<folder>"
            for p in sorted(folder.rglob("*")) if p.name != ".fastgrpo.lock"}


@pytest.mark.parametrize("command, name", [("train", "results.jsonl"), ("sft", "summary.json"),
                                           ("ei", "metrics.jsonl")])
def test_a_users_folder_at_a_run_file_name_is_refused_and_kept_by_every_command(finished, tmp_path, capsys,
                                                                                  command, name):
    run = tmp_path / "run"
    shutil.copytree(finished[command], run)
    if (run / name).is_file():  # the run's own log: the user put a folder of that name there instead
        (run / name).unlink()
    (run / name).mkdir()
    (run / name / "notes.txt").write_text("mine\n")
    before = _everything(run)
    argv = [*COMMANDS[command], "--output-dir", str(run), *QUIET]
    line = (f"fastgrpo {command}: error: output_dir: {run / name} is a folder, where the run writes a file; move it "
            f"out of {run}, or pick another --output-dir\n")
    for flags in ([], ["--overwrite-output-dir"]):  # a fresh run is not pointed at an overwrite that would delete it
        assert main([*argv, *flags]) == 2
        assert capsys.readouterr().err == line, flags
        assert _everything(run) == before, flags  # the user's folder and the previous run: not a byte deleted
    shutil.move(run / name, tmp_path / name)
    assert main([*argv, "--overwrite-output-dir"]) == 0  # an ordinary overwrite, as before
    assert (run / "metrics.jsonl").is_file() and (run / "checkpoint-1").is_dir()


@pytest.mark.parametrize("name", FILE_NAMES)
@pytest.mark.parametrize("replace_at_end", [False, True])
def test_every_file_name_a_run_writes_refuses_a_folder_before_deleting_anything(tmp_path, name, replace_at_end):
    """At the RunDirectory level, for each file name of TRAIN_ARTIFACTS and both ways of overwriting (train's delete
    at the start, eval's replace at the end); an empty folder too: it is still not the run's."""
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "trainer_state.pt").write_bytes(b"state")
    (tmp_path / name).mkdir()
    before = _everything(tmp_path)
    with RunDirectory(tmp_path) as run_dir:
        line = (f"output_dir: {tmp_path / name} is a folder, where the run writes a file; move it out of {tmp_path}, "
                "or pick another output_dir")
        with pytest.raises(ValueError, match=f"^{re.escape(line)}$"):
            run_dir.prepare(resume=False, overwrite=True, command="train", replace_at_end=replace_at_end)
        assert _everything(tmp_path) == before
        (tmp_path / name).rmdir()
        run_dir.prepare(resume=False, overwrite=True, command="train", replace_at_end=replace_at_end)
        assert (tmp_path / "checkpoint-3").exists() == replace_at_end  # deleted at once, or kept until replaced


@pytest.mark.parametrize("name", ["metrics.jsonl", ".metrics.jsonl.tmp"])
def test_resume_refuses_a_folder_at_a_run_file_name_and_keeps_it(finished, tmp_path, capsys, name):
    """--resume deleted a user's folder at a partial write's name as the stopped run's leftover, and at the log's name
    wrote "resumed from" then stopped on the OS's "[Errno 21] Is a directory"."""
    run = tmp_path / "run"
    shutil.copytree(finished["train"], run)
    if (run / name).is_file():
        (run / name).unlink()
    (run / name).mkdir()
    (run / name / "notes.txt").write_text("mine\n")
    before = _everything(run)
    assert main([*COMMANDS["train"], "--max-steps", "2", "--resume", "--output-dir", str(run), *QUIET]) == 2
    assert capsys.readouterr().err == (f"fastgrpo train: error: output_dir: {run / name} is a folder, where the run "
                                       f"writes a file; move it out of {run}, or pick another --output-dir\n")
    assert _everything(run) == before

