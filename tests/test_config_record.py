"""A run's record of its config (checkpoint-<step>/run_config.json, final/, summary.json) fed back as --config: it
reproduces the run, and never deletes the run it came from."""
import json
import os

import pytest

from fastgrpo.train.cli import main
from fastgrpo.train.commands import CONFIGS

TINY = ["--max-steps", "2", "--learning-rate", "1e-3", "--no-export"]


def _rewards(run):
    return [line["reward"] for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def test_a_run_record_fed_back_reproduces_the_run_and_keeps_it(tmp_path, capsys):
    run, again = tmp_path / "run", tmp_path / "again"
    run.mkdir()
    (run / "notes.txt").write_text("mine")  # not a run's file: kept
    assert main(["train", *TINY, "--output-dir", str(run), "--overwrite-output-dir"]) == 0
    record = run / "checkpoint-2" / "run_config.json"
    # the record's overwrite_output_dir would delete this run when fed back as it stands
    assert main(["train", "--config", str(record)]) == 2
    assert f"output_dir (from {record}): {run} holds another run" in capsys.readouterr().err
    assert (run / "checkpoint-2").is_dir() and _rewards(run) and (run / "notes.txt").read_text() == "mine"
    assert main(["train", "--config", str(record), "--output-dir", str(again)]) == 0  # a flag over the file
    assert _rewards(again) == _rewards(run)
    saved, resaved = (json.loads(p.read_text()) for p in (record, again / "checkpoint-2" / "run_config.json"))
    assert resaved.pop("output_dir") == str(again) and saved.pop("output_dir") == str(run) and saved == resaved


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_the_record_holds_what_the_run_computes_not_what_its_invocation_did(command):
    """resume / overwrite_output_dir / resume_allow_changes say what one invocation did with the run already in
    output_dir; recorded, a record fed back as --config would repeat it (overwrite: delete that run)."""
    config = CONFIGS[command](overwrite_output_dir=True)
    record = config.to_dict()
    assert not {"resume", "resume_allow_changes", "overwrite_output_dir"} & set(record)
    default = CONFIGS[command]()
    if default.output_dir is not None:  # recorded absolute: the run's folder, wherever the record is read
        default.output_dir = os.path.abspath(default.output_dir)
    assert CONFIGS[command].from_dict(record) == default


def test_an_older_record_fed_back_keeps_its_run(tmp_path, capsys):
    """Records written before they left out the invocation's fields hold overwrite_output_dir: true."""
    run = tmp_path / "run"
    (run / "checkpoint-3").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    record = run / "checkpoint-3" / "run_config.json"
    record.write_text(json.dumps({**CONFIGS["train"]().to_dict(), "output_dir": str(run), "max_steps": 1,
                                  "overwrite_output_dir": True, "resume": False}))
    assert CONFIGS["train"].file_settings(record).get("overwrite_output_dir") is None
    assert main(["train", "--config", str(record)]) == 2
    assert f"output_dir (from {record}): {run} holds another run" in capsys.readouterr().err
    assert record.is_file() and (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_the_record_name_is_the_checkpoints():
    from fastgrpo.train.checkpoint import CONFIG_FILE
    from fastgrpo.train.config_file import RUN_RECORD

    assert RUN_RECORD == CONFIG_FILE


def test_a_record_resumes_its_own_run_from_another_folder(tmp_path, monkeypatch, capsys):
    """A relative output_dir was recorded as typed: `--config run/checkpoint-2/run_config.json --resume` from another
    folder looked for the run there ("no checkpoint-<step> ... in run") instead of continuing it."""
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir()
    other.mkdir()
    monkeypatch.chdir(first)
    assert main(["train", *TINY, "--output-dir", "run"]) == 0
    record = first / "run" / "checkpoint-2" / "run_config.json"
    assert json.loads(record.read_text())["output_dir"] == str(first / "run")
    monkeypatch.chdir(other)
    assert main(["train", "--config", str(record), "--resume", "--max-steps", "3"]) == 0, capsys.readouterr().err
    assert (first / "run" / "checkpoint-3").is_dir() and len(_rewards(first / "run")) == 3
    assert list(other.iterdir()) == []


def test_a_copied_runs_record_does_not_resume_the_original(tmp_path, capsys):
    """The record keeps output_dir absolute: `--config copy/checkpoint-2/run_config.json --resume` continued (wrote
    into) the run the copy was made from."""
    import shutil

    run, copy = tmp_path / "run", tmp_path / "copy"
    assert main(["train", *TINY, "--output-dir", str(run)]) == 0
    shutil.copytree(run, copy)
    record = copy / "checkpoint-2" / "run_config.json"
    assert main(["train", "--config", str(record), "--resume", "--max-steps", "3"]) == 2
    assert (f"output_dir (from {record}): the record of the run in {copy} names {run} as its run folder (a copied "
            f"run?); pass --output-dir {copy} for this one, or --output-dir {run} for that one"
            in capsys.readouterr().err)
    assert not (run / "checkpoint-3").exists() and not (copy / "checkpoint-3").exists()
    assert main(["train", "--config", str(record), "--resume", "--max-steps", "3", "--output-dir", str(copy)]) == 0
    assert (copy / "checkpoint-3").is_dir() and not (run / "checkpoint-3").exists()


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
@pytest.mark.parametrize("folder", ["checkpoint-4", "final"])
def test_a_record_naming_another_run_is_refused_before_anything_runs(tmp_path, capsys, command, folder):
    original, copy = tmp_path / "original", tmp_path / "copy"
    (copy / folder).mkdir(parents=True)
    record = copy / folder / "run_config.json"
    record.write_text(json.dumps(CONFIGS[command](output_dir=str(original)).to_dict()))
    assert main([command, "--config", str(record), "--resume"]) == 2
    assert f"the record of the run in {copy} names {original} as its run folder" in capsys.readouterr().err
    assert not original.exists() and sorted(p.name for p in copy.iterdir()) == [folder]
