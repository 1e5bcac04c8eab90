"""The periodic evaluation inside `fastgrpo train` (--eval-steps): eval/step-<N>.jsonl and its summary name the step
and the settings they ran with, a resumed run's evaluation files are those of the steps it kept, and a write cut
short leaves no partial results."""
import errno
import json
import shutil
from pathlib import Path

import pytest

from fastgrpo.train.cli import main
from fastgrpo.train.evaluate import write_eval

QUIET = ["--no-progress-bar", "--logging-steps", "0"]
SMALL = ["--batch-size", "8", "--micro-batch-size", "8", "--eval-max-examples", "4", *QUIET]


def test_a_step_summary_names_its_step_and_sampling(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--output-dir", str(out), "--max-steps", "2", "--eval-steps", "1", "--no-export",
                 *SMALL]) == 0
    for step in (1, 2):
        summary = json.loads((out / "eval" / f"step-{step}_summary.json").read_text())
        assert summary["step"] == step and summary["sampling"]["max_new_tokens"] == 8, summary
        assert summary["num_examples"] == 4 and "fastgrpo" in summary["versions"]
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert "eval/step" not in last and last["eval/num_examples"] == 4  # the step is the line's own


def test_a_resumed_run_drops_the_evaluations_of_the_steps_it_replaces(tmp_path, capsys):
    """A run killed after step 3's evaluation but before a checkpoint of it resumes from checkpoint-2 and redoes
    step 3: metrics.jsonl dropped step 3's line, but eval/step-3.jsonl (weights the run threw away) stayed beside the
    new run's files when the resumed run evaluated at other steps."""
    out = tmp_path / "run"
    common = ["train", "--output-dir", str(out), "--max-steps", "4", "--save-steps", "2", "--no-export", *SMALL]
    assert main([*common, "--eval-steps", "1"]) == 0
    kept = (out / "eval" / "step-2.jsonl").read_text()
    for path in (out / "checkpoint-4", out / "eval" / "step-4.jsonl", out / "eval" / "step-4_summary.json"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()  # killed after step 3's evaluation
    capsys.readouterr()
    assert main([*common, "--eval-steps", "2", "--resume"]) == 0
    names = sorted(p.name for p in (out / "eval").iterdir())
    assert names == [f"step-{n}{suffix}" for n in (1, 2, 4) for suffix in (".jsonl", "_summary.json")], names
    assert (out / "eval" / "step-2.jsonl").read_text() == kept  # the steps the run kept keep theirs
    assert "eval: deleted step-3.jsonl, step-3_summary.json, the evaluations of steps this run replaces" in \
        capsys.readouterr().err
    evaluated = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
                 if "eval/accuracy" in line]
    assert evaluated == [1, 2, 4]



def test_a_run_resumed_without_evaluations_drops_those_of_the_steps_it_replaces(tmp_path, capsys):
    """As above, resumed with --eval-steps 0: the files were dropped at the resumed run's first evaluation, so a run
    that evaluates no more kept eval/step-3.jsonl of the weights it threw away (here of another learning rate)."""
    out = tmp_path / "run"
    common = ["train", "--output-dir", str(out), "--save-steps", "2", "--no-export", *SMALL]
    assert main([*common, "--eval-steps", "1", "--max-steps", "3"]) == 0
    shutil.rmtree(out / "checkpoint-3")  # killed after step 3's evaluation
    capsys.readouterr()
    assert main([*common, "--eval-steps", "0", "--max-steps", "4", "--resume", "--learning-rate", "0.01",
                 "--resume-allow-changes"]) == 0
    names = sorted(p.name for p in (out / "eval").iterdir())
    assert names == [f"step-{n}{suffix}" for n in (1, 2) for suffix in (".jsonl", "_summary.json")], names
    assert "eval: deleted step-3.jsonl, step-3_summary.json, the evaluations of steps this run replaces" in \
        capsys.readouterr().err


def test_a_write_cut_short_leaves_no_partial_results(tmp_path, monkeypatch):
    """A disk that fills (or a kill) in the middle of writing results.jsonl left the lines written so far as the
    results, beside no summary or the summary of an earlier evaluation; now the file appears whole or not at all."""
    records = [{"index": i, "completion": "x" * 100} for i in range(50)]
    examples, summary = tmp_path / "step-3.jsonl", tmp_path / "step-3_summary.json"
    write_eval(records[:2], {"accuracy": 0.5}, examples, summary)  # the earlier evaluation of step 3
    real_write = Path.write_text

    def disk_full(path, text, *args, **kwargs):
        real_write(path, text[:len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_eval(records, {"accuracy": 0.0}, examples, summary)
    monkeypatch.undo()
    assert len(examples.read_text().splitlines()) == 2 and json.loads(summary.read_text()) == {"accuracy": 0.5}
