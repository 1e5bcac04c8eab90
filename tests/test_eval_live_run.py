"""`fastgrpo eval --checkpoint` of a run that is still training: the run deletes its older checkpoints as it saves
new ones (--save-total-limit), which can happen while eval loads one (seen on a live run with --save-total-limit 1:
a traceback, TornCheckpoint, two evaluations in three). Replayed here in order: the checkpoint found, then deleted,
then loaded."""
import json
import logging
import shutil

import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.eval_model import load_evaluated_model

QUIET = ["--no-progress-bar", "--logging-steps", "0"]


@pytest.fixture
def run(tmp_path):
    """A finished run with checkpoint-1 and checkpoint-2."""
    out = tmp_path / "run"
    assert main(["train", "--output-dir", str(out), "--max-steps", "2", "--save-steps", "1", "--no-export",
                 "--batch-size", "8", "--micro-batch-size", "8", *QUIET]) == 0
    return out


def _config(checkpoint):
    return EvalConfig(checkpoint=str(checkpoint), dtype="float32", device="cpu", max_new_tokens=8)


def test_a_checkpoint_pruned_while_it_loads_gives_way_to_the_runs_newest(run, caplog):
    found = run / "checkpoint-1"  # what --checkpoint <run> found when the run's newest was step 1
    shutil.rmtree(found)
    with caplog.at_level(logging.WARNING):
        model, source = load_evaluated_model(_config(run), found, default_task.build_tokenizer())
    assert source == {"model": None, "checkpoint": str(run / "checkpoint-2")} and not model.training
    assert f"checkpoint: {found} was deleted while it loaded" in caplog.text
    assert "evaluating the run's newest, checkpoint-2, instead" in caplog.text


def test_a_named_checkpoint_pruned_while_it_loads_is_one_line(run):
    found = run / "checkpoint-1"
    shutil.rmtree(found)
    with pytest.raises(ValueError, match=rf"^checkpoint: {found} was deleted while it loaded \(its run, still "
                                         r"training, prunes older checkpoints as it saves: --save-total-limit\); "
                                         r"pass a newer one$"):
        load_evaluated_model(_config(found), found, default_task.build_tokenizer())


def test_a_damaged_checkpoint_is_one_line_not_a_traceback(run, tmp_path, capsys):
    state = run / "checkpoint-2" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # cut short
    assert main(["eval", "--checkpoint", str(run / "checkpoint-2"), "--output-dir", str(tmp_path / "out"),
                 "--max-examples", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("fastgrpo eval: error:") == 1, err
    assert f"fastgrpo eval: error: checkpoint: cannot read {state}: " in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    assert main(["eval", "--checkpoint", str(run / "checkpoint-1"), "--output-dir", str(tmp_path / "ok"),
                 "--max-examples", "2"]) == 0
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["checkpoint"] == str(run / "checkpoint-1")
