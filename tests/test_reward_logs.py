"""TRL's logging hooks for reward functions (TRL 1.16 passes every function log_metric and log_extra): log_metric's
values are a training step's metric under their own name, the step's mean (metrics.jsonl; expert iteration and
evaluation: tests/test_reward_logs_commands.py); log_extra's columns (TRL's completions table, which fastgrpo does not
keep) are taken and not recorded, with a warning once."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from fastgrpo.rewards.reward_logs import RewardLogs, merged_means
from fastgrpo.rewards.scoring import RewardError, check_failures, score


def test_log_metric_takes_numbers_and_leaves_nan_out():
    def logs_all(completions, log_metric, **kwargs):
        for value in (1, torch.tensor(0.5), np.float32(0.0), np.array(2.0), True):
            log_metric("acc", value)
        log_metric("unmeasured", float("nan"))
        return [1.0] * len(completions)

    logs = RewardLogs()
    _, failures = score([logs_all], ["p"] * 2, ["a", "b"], {}, logs=logs)
    assert not failures and logs.values == {"acc": [1.0, 0.5, 0.0, 2.0, 1.0], "unmeasured": []}
    assert merged_means([(logs.values, logs.sources)]) == {"acc": (0.9, "logs_all"), "unmeasured": (None, "logs_all")}


@pytest.mark.parametrize("name, value, message", [
    ("acc", math.inf, "log_metric: 'acc' got inf, expected one finite number"),
    ("acc", "1", "log_metric: 'acc' got '1', expected one finite number"),
    ("acc", [1.0, 2.0], "log_metric: 'acc' got [1.0, 2.0], expected one finite number"),
    ("acc", None, "log_metric: 'acc' got None, expected one finite number"),
    (3, 1.0, "log_metric: expected a metric name (text, not blank), got 3"),
    (" ", 1.0, "log_metric: expected a metric name (text, not blank), got ' '"),
])
def test_a_bad_log_metric_call_is_the_reward_functions_failure(name, value, message):
    """The ValueError is raised in the function that called log_metric: the run's reward error names it."""
    def logs_badly(completions, log_metric, **kwargs):
        log_metric(name, value)
        return [1.0] * len(completions)

    _, failures = score([logs_badly], ["p"], ["a"], {}, logs=RewardLogs())
    assert failures["logs_badly"] == f"raised ValueError: {message}"


def test_a_bad_log_metric_call_is_located_at_the_users_line():
    """The failure's location is the reward function's call of log_metric, not the line of fastgrpo's that refused
    the value."""
    def logs_a_list(completions, log_metric, **kwargs):
        log_metric("acc", [1.0] * len(completions))  # the mean forgotten
        return [1.0] * len(completions)

    _, failures = score([logs_a_list], ["p"], ["a"], {}, logs=RewardLogs())
    assert failures["logs_a_list"].raised_at.startswith(" (at test_reward_logs.py:")
    assert failures["logs_a_list"].raised_at.endswith(", in logs_a_list)")


def test_what_a_function_logged_before_it_raised_is_dropped():
    """Under reward_errors="skip" the step trains on: a function that raised measured part of the batch, so its values
    are left out as its rewards are (its name null: not measured); another function's values under the name count."""
    def measures_then_raises(completions, log_metric, **kwargs):
        log_metric("judge/acc", 0.0)
        log_metric("judge/only_mine", 0.0)
        raise KeyError("verdict")

    def measures(completions, log_metric, **kwargs):
        log_metric("judge/acc", 1.0)
        return [1.0] * len(completions)

    logs = RewardLogs()
    _, failures = score([measures_then_raises, measures], ["p"], ["a"], {}, logs=logs)
    assert list(failures) == ["measures_then_raises"]
    assert merged_means([(logs.values, logs.sources)]) == {"judge/acc": (1.0, "measures_then_raises"),
                                                           "judge/only_mine": (None, "measures_then_raises")}


def test_a_hook_kept_from_an_earlier_call_logs_into_the_batch_scored_now(caplog):
    """TRL passes one log_metric for the whole run, so a reward may keep it: fastgrpo's, one per call, records a kept
    one's values with the batch being scored when it is called; called between batches, they are not recorded, and
    a warning says so."""
    kept = []

    def keeps_its_hook(completions, log_metric, **kwargs):
        kept.append(log_metric)
        kept[0]("judge/calls", 1.0)
        return [1.0] * len(completions)

    batches = [RewardLogs(), RewardLogs()]
    for logs in batches:
        score([keeps_its_hook], ["p"], ["a"], {}, logs=logs)
    assert [logs.values for logs in batches] == [{"judge/calls": [1.0]}] * 2
    with caplog.at_level(logging.WARNING, logger="fastgrpo"):
        kept[0]("judge/between", 1.0)
    assert [logs.values for logs in batches] == [{"judge/calls": [1.0]}] * 2
    assert caplog.messages == ["reward function keeps_its_hook called log_metric('judge/between') after its call "
                               "returned and outside any reward call: not recorded (log with the log_metric of the call "
                               "being made)"]


def test_a_kept_hook_logging_a_taken_name_is_refused_by_the_batch_scored_now():
    """A kept log_metric logs into the batch being scored: that batch's caller raises its refusal, not the earlier
    batch's, which no one looks at any more."""
    kept = []

    def keeps_its_hook(completions, log_metric, **kwargs):
        kept.append(log_metric)
        if len(kept) == 2:
            kept[0]("loss", 1.0)
        return [1.0] * len(completions)

    batches = [RewardLogs(taken={"loss"}), RewardLogs(taken={"loss"})]
    for logs in batches:
        score([keeps_its_hook], ["p"], ["a"], {}, logs=logs)
    assert batches[0].clash is None and batches[1].values == {}
    assert batches[1].clash.startswith("reward function keeps_its_hook logged metric 'loss' with log_metric (at "
                                       "test_reward_logs.py:")


def test_finding_the_row_a_function_raised_on_warns_of_no_kept_hook(caplog):
    """When the run stops, the function that raised is called again row by row: a hook it kept is called inside a
    reward call then, not "outside any reward call"."""
    kept = []

    def keeps_its_hook(completions, log_metric, **kwargs):
        kept.append(log_metric)
        kept[0]("judge/calls", 1.0)
        if "b" in completions:
            raise KeyError("b")
        return [1.0] * len(completions)

    score([keeps_its_hook], ["p"], ["a"], {}, logs=RewardLogs())
    failures = score([keeps_its_hook], ["p"] * 2, ["a", "b"], {}, logs=RewardLogs())[1]
    with caplog.at_level(logging.WARNING, logger="fastgrpo"), pytest.raises(RewardError, match=r"on row 1: 'b'"):
        check_failures(failures, [keeps_its_hook], ["p"] * 2, ["a", "b"], {}, on_error="raise")
    assert "outside any reward call" not in caplog.text


def test_metrics_of_several_processes_are_one_mean():
    """As TRL's sum and count gathered across processes: a mean over all the values, not a mean of means."""
    shares = [({"acc": [1.0, 0.0]}, {"acc": "f"}), ({"acc": [1.0], "late": []}, {"acc": "f", "late": "g"})]
    assert merged_means(shares) == {"acc": (2 / 3, "f"), "late": (None, "g")}
    # a name two functions logged on two processes is the first process's function's, as on one process (RewardLogs
    # keeps the first): the one a clash's error names; the last one's passed the suite
    assert merged_means([({"x": [1.0]}, {"x": "f"}), ({"x": [3.0]}, {"x": "g"})]) == {"x": (2.0, "f")}


def test_what_is_not_recorded_is_said_once(caplog):
    """score() called without logs, and log_extra, record nothing: one warning per name, not one per batch."""
    def evaluated(completions, log_metric, log_extra, **kwargs):
        log_metric("unrecorded_metric", 1.0)
        log_extra("eval_only_column", list(completions))
        return [1.0] * len(completions)

    with caplog.at_level(logging.WARNING, logger="fastgrpo"):
        for _ in range(2):
            assert not score([evaluated], ["p"], ["a"], {})[1]
    assert [r.getMessage() for r in caplog.records] == [
        "reward function evaluated logged metric 'unrecorded_metric' with log_metric: score() was called without "
        "logs=RewardLogs(), so it is not recorded",
        "reward function evaluated logged column 'eval_only_column' with log_extra: fastgrpo keeps no completions "
        "table (TRL's log_completions), so it is not recorded"]


def _trainer(tmp_path, reward, max_steps=2, **fields):
    from fastgrpo.train import default_task
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.train.trainer import GRPOTrainer

    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 8,
                           "max_completion_length": 4, "max_steps": max_steps, "export": False, "progress_bar": False,
                           "logging_steps": 0, "output_dir": str(tmp_path), **fields})
    tokenizer = default_task.build_tokenizer()
    return GRPOTrainer(default_task.build_model(tokenizer), tokenizer, reward, default_task.build_dataset(16), config)


def test_a_training_run_logs_what_its_reward_functions_log(tmp_path, caplog):
    """A function written for TRL, needing log_metric and log_extra and returning NaN where it does not apply (another
    function scores every completion), trains: each step's metrics.jsonl line has its metric, the mean of the step's
    values, under the name it gave."""
    from fastgrpo.train.default_task import repeat_letter_reward

    logged = []

    def letter_judge(prompts, completions, letter, log_metric, log_extra, **kwargs):
        rewards = repeat_letter_reward(prompts, completions, letter)
        rewards = [r if i % 2 == 0 else math.nan for i, r in enumerate(rewards)]  # every other: not applicable
        log_metric("judge/first_reward", rewards[0])
        log_metric("judge/first_reward", 1.0)
        log_extra("letter", letter)
        logged.append((rewards[0] + 1.0) / 2)
        return rewards

    with caplog.at_level(logging.WARNING, logger="fastgrpo"):
        history = _trainer(tmp_path, [repeat_letter_reward, letter_judge]).train()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["judge/first_reward"] for m in lines] == [m["judge/first_reward"] for m in history] == logged
    assert all(m["reward_errors"] == 0 and math.isfinite(m["rewards/letter_judge"]) for m in lines)
    assert caplog.text.count("with log_extra") == 1 and "returned None (or NaN)" not in caplog.text


def test_a_step_that_skips_a_failed_function_logs_none_of_its_values(tmp_path):
    """reward_errors="skip": on the step where an async function raises after logging, its names are null and a name
    another function shares has that function's values only; the next step has both."""
    import asyncio

    async def flaky(completions, log_metric, trainer_state, **kwargs):
        log_metric("judge/flaky", 1.0)
        log_metric("judge/shared", 0.0)
        await asyncio.sleep(0)
        if trainer_state.global_step == 0:
            raise RuntimeError("judge unreachable")
        return [0.5] * len(completions)

    async def steady(completions, log_metric, **kwargs):
        log_metric("judge/shared", np.float32(1.0))
        return [1.0] * len(completions)

    _trainer(tmp_path, [flaky, steady], reward_errors="skip").train()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["reward_errors"], m["judge/flaky"], m["judge/shared"]) for m in lines] == [(1, None, 1.0),
                                                                                           (0, 1.0, 0.5)]


def _weights(model) -> dict:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("name, fields", [("loss", {}), ("rewards/clashing/std", {}),
                                          ("accuracy", {"eval_steps": 1, "eval_max_examples": 2})])
def test_a_logged_metric_named_as_one_of_fastgrpos_stops_the_run_before_the_update(tmp_path, name, fields):
    """Under the name of fastgrpo's own metric, one value would hide the other: refused as the function logs it, so
    the first step stops before its update (the weights and the optimizer untouched, nothing saved), with the line
    that logged it. "loss" is known only after the update; "accuracy" is the periodic evaluation's (same functions),
    which would first run after the step."""
    def clashing(completions, log_metric, **kwargs):
        log_metric(name, 0.0)
        return [float(i % 2) for i in range(len(completions))]  # advantages not 0: an update moves the weights

    trainer = _trainer(tmp_path, clashing, max_steps=1, **fields)
    before = _weights(trainer.model)
    with pytest.raises(RewardError, match=rf"^reward function clashing logged metric '{name}' with log_metric \(at "
                                          rf"test_reward_logs.py:\d+, in clashing\), a name fastgrpo's own metrics "
                                          rf"take; give it another \(e.g. 'clashing/{name}'\)$"):
        trainer.train()
    after = _weights(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before) and not trainer.optimizer.state
    assert trainer.step == 0 and not list(tmp_path.glob("checkpoint-*"))


def test_every_metric_of_a_step_is_a_name_log_metric_may_not_take(tmp_path):
    """The names refused as they are logged cover everything a step writes (its evaluation's, the rollout
    correction's too): none would be found first after the update."""
    def judge(completions, log_metric, **kwargs):
        log_metric("judge/seen", 1.0)
        return [1.0] * len(completions)

    trainer = _trainer(tmp_path, judge, max_steps=1, eval_steps=1, eval_max_examples=2, beta=0.1,
                       rollout_correction="truncate")
    metrics = trainer.train()[0]
    assert "rollout_is_weight_mean" in metrics and "eval/accuracy" in metrics
    assert [name for name in metrics if name not in trainer.taken_names] == ["judge/seen"]


def test_a_logged_metric_named_as_a_reward_error_is_refused_on_every_step():
    """reward_error/<function> is in a step's metrics only on the steps where that function fails: the name is refused
    on a step without failures too, not first on the step (and the process) where the function fails."""
    from fastgrpo.train.step_rewards import metric_names

    def judge(completions, log_metric, **kwargs):
        log_metric("reward_error/judge", 1.0)
        return [1.0] * len(completions)

    logs = RewardLogs(taken=metric_names(["reward"], ["judge"]))
    _, failures = score([judge], ["p"], ["a"], {}, logs=logs)
    assert not failures and logs.values == {} and logs.clash.startswith(
        "reward function judge logged metric 'reward_error/judge' with log_metric (at test_reward_logs.py:")


def _logs_by_rank(rank: int, tmp) -> dict:
    from fastgrpo.train import default_task
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.train.trainer import GRPOTrainer

    def by_rank(completions, log_metric, **kwargs):  # rank 0 logs 0.0 once, rank 1 logs 1.0 twice and "rank1_only"
        for _ in range(rank + 1):
            log_metric("by_rank", float(rank))
        if rank == 1:
            log_metric("rank1_only", 5.0)
        return [0.0] * len(completions)

    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 4,
                           "max_completion_length": 4, "max_steps": 1, "save_steps": 0, "save_minutes": 0,
                           "export": False, "progress_bar": False, "logging_steps": 0, "output_dir": str(tmp / "run")})
    tokenizer = default_task.build_tokenizer()
    trainer = GRPOTrainer(default_task.build_model(tokenizer), tokenizer, by_rank, default_task.build_dataset(16),
                          config)
    return {key: value for key, value in trainer.train()[0].items() if key in ("by_rank", "rank1_only")}


def test_a_metric_of_several_processes_is_the_mean_of_all_their_values(tmp_path):
    """Under torchrun (2 gloo processes): every process logs the mean over all processes' values (TRL's sum / count:
    (0 + 1 + 1) / 3, not the mean of the processes' means), a name only one process logged too."""
    from tests.forked_gloo import run_forked

    expected = {"by_rank": pytest.approx(2 / 3), "rank1_only": 5.0}
    assert run_forked(_logs_by_rank, tmp_path, deadline_s=60, group_timeout_s=30) == [expected, expected]
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert line["by_rank"] == pytest.approx(2 / 3) and line["rank1_only"] == 5.0
