"""The periodic evaluation inside `fastgrpo train` (--eval-steps): eval/step-<N>.jsonl and its summary name the step
and the settings they ran with, and a resumed run's evaluation files are those of the steps it kept."""
import json

from fastgrpo.train.cli import main

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
