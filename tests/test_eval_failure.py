"""A periodic evaluation (--eval-steps) that fails after a step's update -- a reward function raising with
reward_errors=raise -- ended the run with no checkpoint: the steps since the last one were lost. Now train, ei and
sft save the step (its metrics line written without the evaluation), say how to continue, and the resumed run
evaluates that step first, then goes on: each step trained once, its line in metrics.jsonl whole."""
import json

import pytest
import torch

from fastgrpo.rewards.scoring import RewardError
from fastgrpo.train import default_task
from fastgrpo.train.checkpoint import list_checkpoints

QUIET = {"progress_bar": False, "logging_steps": 0, "export": False}


def _lines(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _evaluated(out) -> list[int]:
    """The steps (rounds) with an evaluation summary in out/eval/."""
    return sorted(int(path.name[5:-len("_summary.json")]) for path in (out / "eval").glob("step-*_summary.json"))


class Judge:
    """A reward function that fails in the evaluation while `broken` (the built-in task's held-out rows carry a
    "response" column, its training rows none), and counts the training batches it scored."""

    def __init__(self, broken: bool = True, evaluations_before: int = 0):
        self.broken, self.evaluations_before = broken, evaluations_before
        self.trained = self.evaluated = 0
        self.__name__ = "judge"

    def __call__(self, prompts, completions, letter, **columns):
        if "response" not in columns:
            self.trained += 1
        else:
            self.evaluated += 1
            if self.broken and self.evaluated > self.evaluations_before:
                raise ZeroDivisionError("division by zero")
        return default_task.repeat_letter_reward(prompts, completions, letter)


def _grpo(out, judge, **fields):
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.train.trainer import GRPOTrainer

    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 8,
                           "max_completion_length": 4, "max_steps": 2, "eval_steps": 1, "eval_max_examples": 2,
                           "save_steps": 0, "output_dir": str(out), **QUIET, **fields})
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    return model, GRPOTrainer(model, tokenizer, judge, default_task.build_dataset(16), config)


def test_train_saves_the_step_whose_evaluation_failed_and_evaluates_it_on_resume(tmp_path):
    """Step 1's evaluation fails (save_steps 0: no checkpoint until the end): checkpoint-1 holds step 1, its line is
    written without eval numbers. The resume after the fix trains only step 2, evaluates step 1 first, and ends as a
    straight run with the fixed function: same weights, same metrics, each step drawn once in TensorBoard."""
    pytest.importorskip("tensorboard", reason="report_to tensorboard needs `pip install tensorboard`")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, judge = tmp_path / "run", Judge()
    with pytest.raises(RewardError, match=r"^reward function judge raised ZeroDivisionError: division by zero .*; "
                                          r"step 1's evaluation failed after its update: step 1 is saved in "
                                          r".*run/checkpoint-1: continue with resume=True once fixed \(the resumed "
                                          r"run evaluates it first\)$"):
        _grpo(out, judge, report_to=["tensorboard"])[1].train()
    assert [step for step, _ in list_checkpoints(out)] == [1] and judge.trained == 1
    (line,) = _lines(out)
    assert line["step"] == 1 and "loss" in line and not any(k.startswith("eval/") for k in line)

    judge.broken = False
    model, trainer = _grpo(out, judge, report_to=["tensorboard"], resume=True)
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2] and judge.trained == 2  # step 1 not trained again
    straight_model, straight = _grpo(tmp_path / "straight", Judge(broken=False))
    straight.train()
    for name, param in straight_model.named_parameters():
        assert torch.equal(param, dict(model.named_parameters())[name]), name
    lines, expected = _lines(out), _lines(tmp_path / "straight")
    untimed = [{k: v for k, v in m.items() if not k.endswith(("_s", "seconds"))} for m in lines]
    assert untimed == [{k: v for k, v in m.items() if not k.endswith(("_s", "seconds"))} for m in expected]
    assert all("eval/accuracy" in m for m in lines) and _evaluated(out) == [1, 2]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    drawn = [(event.step, event.value) for event in events.Scalars("step_s")]
    assert drawn == [(m["step"], pytest.approx(m["step_s"], rel=1e-6)) for m in lines], drawn


def test_ei_saves_the_round_whose_evaluation_failed_and_evaluates_it_on_resume(tmp_path):
    """The evaluation before round 1 passes, round 1's fails: checkpoint-1 holds round 1; the resume evaluates it
    and runs round 2 only. A resume with the evaluation off instead keeps round 1's line as written."""
    from fastgrpo.train.ei_config import EIConfig
    from fastgrpo.train.expert_iteration import ExpertIteration

    def run(out, judge, **fields):
        config = EIConfig(**{**default_task.EI_PRESET, "prompt_format": "raw", "questions_per_step": 4,
                             "num_generations": 2, "batch_size": 4, "micro_batch_size": 4, "sft_epochs": 1,
                             "ei_steps": 2, "eval_steps": 1, "eval_max_examples": 2, "save_steps": 0,
                             "output_dir": str(out), **QUIET, **fields})
        tokenizer = default_task.build_tokenizer()
        return ExpertIteration(default_task.build_model(tokenizer), tokenizer, judge,
                               default_task.build_dataset(num_rows=8), config)

    out, judge = tmp_path / "run", Judge(evaluations_before=1)
    with pytest.raises(RewardError, match=r"; round 1's evaluation failed after its update: round 1 is saved in "
                                          r".*run/checkpoint-1: continue with resume=True once fixed"):
        run(out, judge).train()
    assert [step for step, _ in list_checkpoints(out)] == [1] and judge.trained == 1
    assert [(m["round"], "eval/accuracy" in m) for m in _lines(out)] == [(0, True), (1, False)]

    judge.broken = False
    history = run(out, judge, resume=True).train()
    assert [m["round"] for m in history] == [1, 2] and judge.trained == 2  # round 1 not sampled again
    assert [(m["round"], "eval/accuracy" in m) for m in _lines(out)] == [(0, True), (1, True), (2, True)]
    assert _evaluated(out) == [0, 1, 2]
    assert list_checkpoints(out)[0][0] == 1 and "unevaluated" not in \
        torch.load(out / "checkpoint-1" / "trainer_state.pt", weights_only=True)  # saved again, evaluated

    off, judge = tmp_path / "off", Judge(evaluations_before=1)
    with pytest.raises(RewardError):
        run(off, judge).train()
    run(off, judge, resume=True, eval_steps=0).train()
    assert [(m["round"], "eval/accuracy" in m) for m in _lines(off)] == [(0, True), (1, False), (2, False)]


def _sft_argv(out, judge: str, eval_steps: int) -> list[str]:
    """`fastgrpo sft` of 2 steps on the built-in task, eval_reward_funcs: the function `judge` (its source)."""
    (out.parent / "judge.py").write_text(judge)
    return ["sft", "--output-dir", str(out), "--max-steps", "2", "--eval-steps", str(eval_steps),
            "--eval-max-examples", "2", "--eval-reward-funcs", f"{out.parent / 'judge.py'}:judge", "--no-export",
            "--no-progress-bar", "--logging-steps", "0"]


def test_sft_saves_its_last_step_whose_evaluation_failed_and_the_resume_evaluates_it(tmp_path, capsys):
    """`fastgrpo sft` whose eval_reward_funcs fail at the last step's evaluation: one line naming checkpoint-2 and
    --resume; the resume after the fix is not a finished run ("nothing to train") but evaluates step 2."""
    from fastgrpo.train.cli import main

    broken, out = tmp_path / "broken", tmp_path / "run"
    broken.touch()
    judge = (f"import os\n\n\ndef judge(prompts, completions, **columns):\n    if os.path.exists({str(broken)!r}):\n"
             "        raise ZeroDivisionError('division by zero')\n    return [0.0] * len(completions)\n")
    argv = _sft_argv(out, judge, eval_steps=2)
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert f"; step 2's evaluation failed after its update: step 2 is saved in {out / 'checkpoint-2'}: continue " \
           "with --resume once fixed (the resumed run evaluates it first)\n" in err, err
    assert "Traceback" not in err and [m["step"] for m in _lines(out)] == [1, 2] and not (out / "eval").exists()

    broken.unlink()
    assert main([*argv, "--resume"]) == 0
    assert "nothing to train" not in "".join(capsys.readouterr())  # neither the CLI's line nor the trainer's warning
    assert [(m["step"], "eval/accuracy" in m) for m in _lines(out)] == [(1, False), (2, True)]
    assert _evaluated(out) == [2]


def test_sft_saves_the_step_whose_evaluation_logs_a_name_its_summary_takes(tmp_path, capsys):
    """eval_reward_funcs run first in the evaluation, so a log_metric name the summary takes is met there, after
    step 1's update: the step is saved as for a failing function."""
    from fastgrpo.train.cli import main

    out = tmp_path / "run"
    argv = _sft_argv(out, "def judge(prompts, completions, log_metric, **columns):\n"
                          "    log_metric('accuracy', 1.0)\n    return [0.0] * len(completions)\n", eval_steps=1)
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "logged metric 'accuracy' with log_metric" in err and "; step 1's evaluation failed after its update: " \
        f"step 1 is saved in {out / 'checkpoint-1'}: continue with --resume once fixed" in err, err
    assert [step for step, _ in list_checkpoints(out)] == [1]


def test_sft_evaluation_takes_reward_errors_as_its_hint_says(tmp_path, capsys):
    """The evaluation's error names --reward-errors skip; sft takes it (it had no such flag, so the hint was a dead
    end): with skip the run finishes, the failing function's rows scored 0 and counted."""
    from fastgrpo.train.cli import main

    out = tmp_path / "run"
    failing = "def judge(prompts, completions, **columns):\n    raise ZeroDivisionError('division by zero')\n"
    assert main(_sft_argv(out, failing, eval_steps=2)) != 0
    assert "--reward-errors skip scores such rows 0 instead" in capsys.readouterr().err

    out = tmp_path / "skipped"
    assert main([*_sft_argv(out, failing, eval_steps=2), "--reward-errors", "skip"]) == 0, capsys.readouterr().err
    assert _evaluated(out) == [2] and [m["step"] for m in _lines(out)] == [1, 2]


def test_train_saves_the_step_whose_evaluation_failed_on_a_full_disk(tmp_path, monkeypatch):
    """Any failure of the evaluation after the update (here its files' write on a full disk, injected), not only a
    reward function's, saves the step in a one-process run: the error says where, and the resume evaluates it."""
    import errno

    from fastgrpo.train import periodic_eval

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    out, judge = tmp_path / "run", Judge(broken=False)
    monkeypatch.setattr(periodic_eval, "write_eval", full_disk)
    with pytest.raises(OSError) as caught:
        _grpo(out, judge)[1].train()
    assert getattr(caught.value, "__notes__", []) == [
        f"step 1's evaluation failed after its update: step 1 is saved in {out / 'checkpoint-1'}: continue with "
        "resume=True once fixed (the resumed run evaluates it first)"]
    assert [step for step, _ in list_checkpoints(out)] == [1] and judge.trained == 1

    monkeypatch.undo()
    history = _grpo(out, judge, resume=True)[1].train()
    assert [m["step"] for m in history] == [1, 2] and judge.trained == 2 and _evaluated(out) == [1, 2]
