"""`fastgrpo ei`: the built-in expert iteration raises its reward; a round keeps exactly the sampled tokens of the
completions marked correct; a round with nothing kept leaves the weights alone; resume continues a straight run."""
import json
import re
import logging

import pytest
import torch

from fastgrpo.rewards import r1_zero_math_reward
from fastgrpo.rewards.scoring import RewardError
from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.expert_iteration import ExpertIteration

ROUNDS = ["--ei-steps", "5", "--no-progress-bar", "--logging-steps", "0", "--no-export"]


def _metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def builtin_run(tmp_path_factory):
    """The built-in `fastgrpo ei`, shortened to 5 rounds, evaluated before the first round and after the last."""
    out = tmp_path_factory.mktemp("ei")
    assert main(["ei", "--output-dir", str(out), *ROUNDS, "--eval-steps", "5", "--eval-max-examples", "32"]) == 0
    return out


def test_builtin_reward_and_kept_fraction_rise(builtin_run):
    start, *rounds = _metrics(builtin_run)
    assert start["round"] == 0 and [m["round"] for m in rounds] == [1, 2, 3, 4, 5]
    rewards = [m["reward"] for m in rounds]
    assert rewards[-1] > 3 * rewards[0] and rewards[-1] > rewards[0] + 0.2, rewards
    assert rounds[-1]["kept_frac"] > rounds[0]["kept_frac"]
    assert rounds[-1]["eval/accuracy"] > start["eval/accuracy"]
    assert all(m["kept"] == round(m["kept_frac"] * 64 * 16) for m in rounds)


def test_resume_continues_the_straight_run(builtin_run, tmp_path):
    straight = [m["reward"] for m in _metrics(builtin_run)[1:]]
    argv = ["ei", "--output-dir", str(tmp_path), *ROUNDS]
    assert main([*argv[:3], "--ei-steps", "2", *argv[5:]]) == 0
    assert main([*argv, "--resume"]) == 0
    assert [m["reward"] for m in _metrics(tmp_path)] == straight


def _run(reward, tmp_path, **fields):
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    config = EIConfig(**{**default_task.EI_PRESET, "prompt_format": "raw", "questions_per_step": 4,
                         "num_generations": 2, "batch_size": 4, "micro_batch_size": 4, "sft_epochs": 1,
                         "output_dir": str(tmp_path), **fields})
    return model, ExpertIteration(model, tokenizer, reward, default_task.build_dataset(num_rows=8), config)


def test_a_round_keeps_the_sampled_tokens_of_correct_completions(tmp_path):
    seen = []

    def every_other(prompts, completions, **columns):  # completions 0, 2, 4, 6 are correct
        seen.extend(completions)
        return [float(i % 2 == 0) for i in range(len(completions))]

    _, run = _run(every_other, tmp_path)
    metrics = run.run_round()
    assert metrics["kept"] == 4 and metrics["kept_frac"] == 0.5 and metrics["sft_steps"] == 1
    questions = run._questions(0)
    for example, k in zip(run.last_kept, (0, 2, 4, 6)):
        assert list(example.prompt_ids) == run.prompts[questions[k // 2]]
        assert run.tokenizer.decode(example.response_ids, skip_special_tokens=True) == seen[k]


def test_samples_do_not_depend_on_the_generation_batch(tmp_path):
    texts = {}
    for per_call in (1, 3, 4):
        def record(prompts, completions, **columns):
            texts[per_call] = list(completions)
            return [0.0] * len(completions)

        _run(record, tmp_path / str(per_call), generation_batch_size=per_call)[1].run_round()
    assert len(texts[4]) == 8 and texts[1] == texts[3] == texts[4]


def test_nothing_kept_leaves_the_weights_and_says_so(tmp_path, caplog):
    model, run = _run(lambda prompts, completions, **c: [0.0] * len(completions), tmp_path)
    before = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.expert_iteration"):
        metrics = run.run_round()
    assert metrics["kept"] == 0 and metrics["sft_steps"] == 0 and metrics["sft_loss_first"] is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert "round 1: no completion reached correct_threshold 1 (best reward 0, 8 of 8 cut at max_completion_length)" \
        in caplog.text, caplog.text


def test_bad_input_and_failing_rewards(tmp_path):
    with pytest.raises(ValueError, match="needs columns \\['answer'\\]"):
        _run(r1_zero_math_reward, tmp_path)
    with pytest.raises(ValueError, match="micro_batch_size: expected a divisor of batch_size"):
        EIConfig(batch_size=6, micro_batch_size=4)
    # inf is a bug in the function (NaN, like None, means 'does not apply': TRL's rule)
    _, run = _run(lambda prompts, completions, **c: [float("inf")] * len(completions), tmp_path)
    with pytest.raises(RewardError, match="returned inf, not a finite number"):
        run.run_round()


def test_a_failing_reward_saves_the_rounds_before_it(tmp_path):
    """Without a checkpoint every round (save_steps=0: only at the end), a reward function failing in round 3 stops
    the run after saving round 2, as train saves the step before a failing one: the rounds done are not lost."""
    from fastgrpo.train.checkpoint import list_checkpoints

    calls = []

    def fails_in_round_3(prompts, completions, **columns):
        calls.append(1)
        if len(calls) == 3:
            raise ZeroDivisionError("division by zero")
        return [float(i % 2 == 0) for i in range(len(completions))]

    _, run = _run(fails_in_round_3, tmp_path, ei_steps=3, save_steps=0, export=False, progress_bar=False,
                  logging_steps=0)
    with pytest.raises(RewardError, match=r"^reward function fails_in_round_3 raised ZeroDivisionError: division by "
                                          r"zero .*; round 2 is saved in .*checkpoint-2: continue with resume=True "
                                          r"once fixed$"):
        run.train()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2]
    calls.clear()  # saved every round: the message names the checkpoint the round before wrote
    _, run = _run(fails_in_round_3, tmp_path / "every", ei_steps=3, save_steps=1, export=False, progress_bar=False,
                  logging_steps=0)
    with pytest.raises(RewardError, match=r"; round 2 is saved in .*every/checkpoint-2: continue with resume=True"):
        run.train()


def test_console_and_a_stop_count_rounds(tmp_path, capsys):
    """ei's console lines and its stop message say round (its metrics' and --ei-steps' word), not step: a SIGINT
    while round 2 scores abandons that round (round 1's checkpoint, written by --save-steps, stays the last)."""
    (tmp_path / "stop_in_round_2.py").write_text(
        "import os, signal\ncalls = []\n"
        "def fn(prompts, completions, **kw):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return [1.0] * len(completions)\n")
    argv = ["ei", "--output-dir", str(tmp_path / "o"), "--ei-steps", "3", "--no-progress-bar", "--logging-steps",
            "1", "--no-export", "--reward-funcs", f"{tmp_path / 'stop_in_round_2.py'}:fn"]
    assert main(argv) == 130
    out = capsys.readouterr()
    assert out.out.splitlines()[0].startswith("round 1/3 | reward 1.000 | sft_loss_last "), out.out
    assert "fastgrpo ei: stopped by SIGINT in the middle of a round, without a new checkpoint" in out.err, out.err


def test_a_prompt_over_max_prompt_length_says_how_it_was_wrapped(tmp_path, capsys):
    """ei on your rows prompts in r1_zero by default: a 7-character question is a ~400-token prompt, which the
    error says (it named only the count), as eval's does."""
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"prompt": "1 say a", "answer": "a"}) + "\n")
    assert main(["ei", "--dataset", str(data), "--output-dir", str(tmp_path / "o"), *ROUNDS]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"fastgrpo ei: error: dataset: row 0 has a \d+-token prompt as --prompt-format r1_zero wraps "
                        r"it \(raw: as written\), over max_prompt_length \(16\); raise --max-prompt-length or pass "
                        r"--truncate-prompts to left-truncate\n", err), err


def test_a_finished_run_resumed_keeps_its_export(tmp_path):
    """As sft's: --resume of a finished run leaves final/, and the files put there, alone."""
    argv = ["ei", "--output-dir", str(tmp_path), "--ei-steps", "1", "--questions-per-step", "4", "--no-progress-bar",
            "--logging-steps", "0"]
    assert main(argv) == 0
    (tmp_path / "final" / "notes.txt").write_text("mine")
    assert main([*argv, "--resume"]) == 0
    assert (tmp_path / "final" / "notes.txt").read_text() == "mine"


def test_a_finished_run_resumed_says_so_before_loading_the_model(tmp_path, capsys):
    """As sft's: the line without a model load (the model folder lost its weights after the run)."""
    tokenizer = default_task.build_tokenizer()
    model = tmp_path / "model"
    default_task.build_model(tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    out = tmp_path / "run"
    argv = ["ei", "--model", str(model), "--output-dir", str(out), "--ei-steps", "1", "--questions-per-step", "4",
            "--num-generations", "2", "--max-prompt-length", "16", "--max-completion-length", "2", "--batch-size", "4",
            "--micro-batch-size", "4", "--no-export", "--no-progress-bar", "--logging-steps", "0"]
    assert main(argv) == 0
    capsys.readouterr()
    (model / "model.safetensors").unlink()
    assert main([*argv, "--resume"]) == 0
    assert capsys.readouterr().out == (
        f"fastgrpo ei: nothing to train: the run in {out} is at round 1 (checkpoint-1) of --ei-steps 1; pass a larger "
        "--ei-steps to train on\n")

