"""What a newcomer following the README hits on the CLI: eval of a run trained on its own rows evaluates those, not
the built-in task's; an --eval-dataset that nothing evaluates on is said; a run's closing line says where its model
went; HF / TRL flag names TRL users type name fastgrpo's; a second Ctrl-C before the run's first checkpoint says how to start afresh, not to --resume; a Ctrl-C as the
command starts that a library swallows or turns into another error still stops it, in one line."""
import json
import os
import signal
import sys
import time

import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import main

QUIET = ["--no-progress-bar", "--logging-steps", "0"]


def _rows_file(path):
    path.write_text("".join(json.dumps(row) + "\n" for row in default_task.build_dataset(8, seed=1)))
    return path


def test_eval_of_a_run_on_its_own_rows_without_dataset_is_refused_naming_them(tmp_path, capsys):
    """Without --dataset eval scored the run's model on the built-in task's rows, a task it never trained on, with
    no word said; now one line names the run's data, and --dataset (or `none`, the built-in rows) runs."""
    data = _rows_file(tmp_path / "rows.jsonl")
    run = tmp_path / "run"
    assert main(["train", "--dataset", str(data), "--output-dir", str(run), "--max-steps", "1", *QUIET]) == 0
    capsys.readouterr()
    for weights in (["--checkpoint", str(run)], ["--model", str(run / "final")]):
        assert main(["eval", *weights, "--output-dir", str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error: dataset: " in err and f"trained on {data}" in err, err
        assert "pass the rows to evaluate on" in err and "--dataset none for the built-in task's" in err, err
        assert not (tmp_path / "refused").exists()
    scored = ["--reward-funcs", *default_task.REWARD_FUNCS, "--max-examples", "4"]
    assert main(["eval", "--checkpoint", str(run), "--dataset", str(data), *scored,
                 "--output-dir", str(tmp_path / "own")]) == 0
    assert main(["eval", "--checkpoint", str(run), "--dataset", "none", "--max-examples", "4",
                 "--output-dir", str(tmp_path / "builtin")]) == 0
    # a run of the built-in task is evaluated on its held-out rows, as before
    builtin = tmp_path / "builtin_run"
    assert main(["train", "--output-dir", str(builtin), "--max-steps", "1", "--no-export", *QUIET]) == 0
    assert main(["eval", "--checkpoint", str(builtin), "--max-examples", "4",
                 "--output-dir", str(tmp_path / "builtin_eval")]) == 0


def test_an_eval_dataset_without_eval_steps_is_said(tmp_path, capsys):
    """TRL users pass eval_dataset; with eval_steps 0 (the default) nothing read it, silently (a missing file too)."""
    missing = tmp_path / "held_out.jsonl"
    assert main(["train", "--eval-dataset", str(missing), "--output-dir", str(tmp_path / "run"), "--max-steps", "1",
                 "--no-export", *QUIET]) == 0
    err = capsys.readouterr().err
    assert f"warning: eval_dataset: {missing} is not evaluated on, as eval_steps is 0 (off); pass --eval-steps N " \
           "to evaluate every N steps" in err, err
    assert main(["train", "--output-dir", str(tmp_path / "quiet"), "--max-steps", "1", "--no-export", *QUIET]) == 0
    assert "eval_dataset" not in capsys.readouterr().err


def test_a_runs_closing_line_says_where_its_model_went(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--max-steps", "1", "--no-progress-bar"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith(f"; metrics in {run / 'metrics.jsonl'}, model in {run / 'final'}"), last
    assert main(["sft", "--output-dir", str(tmp_path / "sft"), "--max-steps", "1", "--no-export",
                 "--no-progress-bar"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith(f"; metrics in {tmp_path / 'sft' / 'metrics.jsonl'}"), last  # no export: no model named


def test_a_second_ctrl_c_before_the_first_checkpoint_says_how_to_start_afresh(tmp_path, capsys, monkeypatch):
    """It said "continue from the last checkpoint with `... --resume`": there was none, --resume refused, and so did
    the same command again (the run's metrics.jsonl is there)."""
    from fastgrpo.train.trainer import GRPOTrainer

    train = GRPOTrainer.train

    def interrupted_twice_in_step_2(self, *args, **kwargs):
        updates = []

        def hook(optimizer, hook_args, hook_kwargs):
            updates.append(1)
            if len(updates) == self.updates_per_step + 1:  # the update of step 2: the second signal stops at once
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)

        self.optimizer.register_step_pre_hook(hook)
        return train(self, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "train", interrupted_twice_in_step_2)
    run = tmp_path / "run"
    argv = ["train", "--output-dir", str(run), "--max-steps", "3", "--save-steps", "0", *QUIET]
    assert main(argv) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    command = f"fastgrpo train --output-dir {run} --max-steps 3 --save-steps 0 {' '.join(QUIET)} --overwrite-output-dir"
    assert last == ("fastgrpo train: stopped by SIGINT in the middle of a step, before the run's first checkpoint: "
                    f"nothing to continue from; start afresh with `{command}`"), last
    assert (run / "metrics.jsonl").exists() and not list(run.glob("checkpoint-*"))
    monkeypatch.undo()
    assert main(command.split()[1:]) == 0  # the command it names runs


def ctrl_c_swallowed():
    """A Ctrl-C that a library catches (torch's import of numpy does; seen: the run went on to its last step; so does
    a reward function's bare except)."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:
        pass


@pytest.mark.parametrize("after", ["goes on", "fails"])
def test_a_ctrl_c_as_the_command_starts_stops_it_in_one_line(tmp_path, capsys, monkeypatch, after):
    """Seen with `timeout -s INT 0.3 fastgrpo train`: the run went on and trained, or the model class's lazy import
    failed (numpy left half imported: RecursionError, then transformers' ModuleNotFoundError) with a 100-line
    traceback."""
    build = default_task.build_model

    def build_model(*args, **kwargs):
        ctrl_c_swallowed()
        if after == "fails":
            raise ModuleNotFoundError("Could not import module 'Qwen2ForCausalLM'") from RecursionError()
        return build(*args, **kwargs)

    monkeypatch.setattr(default_task, "build_model", build_model)
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--max-steps", "2", *QUIET]) == 130
    assert capsys.readouterr().err == "fastgrpo train: interrupted\n"
    assert not (run / "metrics.jsonl").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own handler back
    monkeypatch.undo()
    assert main(["train", "--output-dir", str(run), "--max-steps", "2", *QUIET]) == 0  # the same command again runs


def test_a_ctrl_c_a_library_swallowed_as_the_cli_imports_is_one_line(monkeypatch, capsys):
    """The interrupt torch's numpy import swallows is in no exception's chain: the error it left (transformers'
    ModuleNotFoundError from a RecursionError, once the model class imports) printed its traceback."""
    import fastgrpo.__main__ as entry
    import fastgrpo.train.cli as cli

    def run():
        ctrl_c_swallowed()
        raise ModuleNotFoundError("Could not import module 'Qwen2ForCausalLM'") from RecursionError()

    monkeypatch.setattr(cli, "main", run)
    monkeypatch.setattr(sys, "argv", ["fastgrpo", "train"])
    assert entry.main() == 130
    assert capsys.readouterr().err == "fastgrpo: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
