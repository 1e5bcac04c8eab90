"""A run records a fingerprint of its local dataset's bytes: `--resume` after the file was edited warns, in one line,
that the resumed steps draw from other rows than the checkpoint's did (it went on in silence, mixing two datasets in
one run); an unedited resume, or one of a run recorded before fingerprints, says nothing."""
import json

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.checkpoint import STATE_FILE
from fastgrpo.train.cli import main
from fastgrpo.train.dataset_fingerprint import FINGERPRINT_KEY, fingerprint

QUIET = ["--no-progress-bar", "--logging-steps", "0", "--save-steps", "1"]
TRAIN = ["train", "--reward-funcs", default_task.REWARD_FUNCS[0], "--batch-size", "8", "--num-generations", "4",
         "--micro-batch-size", "8", "--max-completion-length", "4", *QUIET]
SFT = ["sft", "--max-seq-length", "16", "--batch-size", "8", "--micro-batch-size", "8", "--dtype", "float32",
       "--device", "cpu", *QUIET]
WARNING = "{command}: warning: dataset: {data} changed since checkpoint-1 was written (its contents differ); the " \
          "resumed steps draw from the new rows"


def _data(tmp_path, command: str):
    """A JSONL file of the built-in task's rows (sft's with its answer as the response)."""
    rows = default_task.build_dataset(16)
    if command == "sft":
        rows = [{"prompt": r["prompt"], "response": r["letter"] * default_task.SFT_REPEATS} for r in rows]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def _edit(data):
    """A typo fixed in the first row's prompt: the same number of rows, one value differs."""
    lines = data.read_text().splitlines(keepends=True)
    lines[0] = lines[0].replace(" say ", " say  ", 1)
    data.write_text("".join(lines))


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "changed since" in line]


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_resume_after_the_dataset_was_edited_warns_once(tmp_path, command, capsys):
    data, run = _data(tmp_path, command), tmp_path / "run"
    args = [*(TRAIN if command == "train" else SFT), "--dataset", str(data), "--output-dir", str(run)]
    assert main([*args, "--max-steps", "1"]) == 0
    record = json.loads((run / "checkpoint-1" / "run_config.json").read_text())
    assert record[FINGERPRINT_KEY] == {"dataset": fingerprint(str(data))}
    capsys.readouterr()
    _edit(data)
    assert main([*args, "--max-steps", "2", "--resume"]) == 0
    err = capsys.readouterr().err
    assert _warnings(err) == [WARNING.format(command=f"fastgrpo {command}", data=data)], err
    # checkpoint-2 recorded the rows it was trained on: resuming it draws from the same ones, silently
    assert main([*args, "--max-steps", "3", "--resume"]) == 0
    err = capsys.readouterr().err
    assert _warnings(err) == [], err


def test_an_unedited_resume_and_a_record_without_fingerprints_say_nothing(tmp_path, capsys):
    data, run = _data(tmp_path, "train"), tmp_path / "run"
    args = [*TRAIN, "--dataset", str(data), "--output-dir", str(run)]
    assert main([*args, "--max-steps", "1"]) == 0
    data.write_bytes(data.read_bytes())  # rewritten with the same bytes (a new mtime): the same rows
    assert main([*args, "--max-steps", "2", "--resume"]) == 0
    assert _warnings(capsys.readouterr().err) == []
    # checkpoint-2 as a run recorded before fingerprints wrote it: its resume goes on as it did, silently
    state_file = run / "checkpoint-2" / STATE_FILE
    state = torch.load(state_file, weights_only=True)
    del state["config"][FINGERPRINT_KEY]
    torch.save(state, state_file)
    record_file = run / "checkpoint-2" / "run_config.json"
    record = json.loads(record_file.read_text())
    del record[FINGERPRINT_KEY]
    record_file.write_text(json.dumps(record))
    _edit(data)
    assert main([*args, "--max-steps", "3", "--resume"]) == 0
    assert _warnings(capsys.readouterr().err) == []


def test_the_fingerprint_follows_the_bytes_of_a_file_or_folder(tmp_path):
    data = _data(tmp_path, "train")
    before = fingerprint(str(data))
    assert fingerprint("openai/gsm8k") is None and fingerprint(None) is None  # a Hub name, the built-in rows
    _edit(data)
    assert fingerprint(str(data)) != before
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text(data.read_text())
    in_folder = fingerprint(str(folder))
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x").write_text("datasets' lock files")  # hidden: not the rows
    assert fingerprint(str(folder)) == in_folder
    (folder / "b.jsonl").write_text(data.read_text())  # another file of rows
    assert fingerprint(str(folder)) != in_folder


def test_the_same_bytes_under_another_name_are_the_same_rows_under_another_suffix_other_rows(tmp_path):
    """The suffix is the format the file is read as: data.jsonl's bytes as data.csv are other rows."""
    data = _data(tmp_path, "train")
    moved, as_csv = tmp_path / "moved.jsonl", tmp_path / "data.csv"
    for copy in (moved, as_csv):
        copy.write_bytes(data.read_bytes())
    assert fingerprint(str(moved)) == fingerprint(str(data)) != fingerprint(str(as_csv))


def test_a_resume_after_the_eval_dataset_was_edited_warns(tmp_path, capsys):
    data, run = _data(tmp_path, "train"), tmp_path / "run"
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text(data.read_text())
    args = [*TRAIN, "--dataset", str(data), "--eval-dataset", str(held_out), "--eval-steps", "1",
            "--eval-max-examples", "2", "--output-dir", str(run)]
    assert main([*args, "--max-steps", "1"]) == 0
    capsys.readouterr()
    _edit(held_out)
    assert main([*args, "--max-steps", "2", "--resume"]) == 0
    err = capsys.readouterr().err
    assert _warnings(err) == [f"fastgrpo train: warning: eval_dataset: {held_out} changed since checkpoint-1 was "
                              "written (its contents differ); the resumed evaluations read the new rows"], err


def test_a_file_past_the_whole_hash_size_is_sampled(tmp_path, monkeypatch):
    """A large corpus is not read whole once more at each run's start: past _WHOLE_UP_TO bytes a file's size and
    _SAMPLES windows are hashed, which see a change of size or in a window, not an edit between windows."""
    from fastgrpo.train import dataset_fingerprint as fp

    monkeypatch.setattr(fp, "_CHUNK", 16)
    monkeypatch.setattr(fp, "_WHOLE_UP_TO", 1000)
    monkeypatch.setattr(fp, "_SAMPLES", 4)  # 16-byte windows at 0, 333, 666 and 1000 of 1016 bytes
    data = tmp_path / "big.jsonl"
    data.write_bytes(bytes(1000 + 16))
    first = fp.fingerprint(str(data))
    edited = bytearray(bytes(1016))
    edited[100] = 1  # between windows
    data.write_bytes(bytes(edited))
    assert fp.fingerprint(str(data)) == first
    edited[340] = 1  # in the second window
    data.write_bytes(bytes(edited))
    assert fp.fingerprint(str(data)) != first
    data.write_bytes(bytes(1017))  # another size
    assert fp.fingerprint(str(data)) != first


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_dataset_moved_with_its_bytes_resumes_and_one_also_edited_is_a_changed_setting(tmp_path, command, capsys):
    """A run copied to another machine or folder, its data under another path: the same bytes are the same rows, so
    the resume goes on (it was refused as a changed --dataset, unless --resume-allow-changes); moved and edited, it
    is still the changed setting it was."""
    data, run = _data(tmp_path, command), tmp_path / "run"
    common = [*(TRAIN if command == "train" else SFT), "--output-dir", str(run)]
    assert main([*common, "--dataset", str(data), "--max-steps", "1"]) == 0
    moved = data.rename(tmp_path / "elsewhere.jsonl")
    capsys.readouterr()
    assert main([*common, "--dataset", str(moved), "--max-steps", "2", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "changed settings" not in err and _warnings(err) == [], err
    _edit(moved)
    again = moved.rename(tmp_path / "third.jsonl")
    assert main([*common, "--dataset", str(again), "--max-steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"other settings: dataset: '{moved}' in the checkpoint, '{again}' now; " in err, err
