"""What reward functions log with TRL's log_metric outside a training step: an expert-iteration round's metrics and an
evaluation's summary (`fastgrpo eval`'s summary.json, the periodic evaluation's "eval/<name>") get each name's mean
over the round's (evaluation's) values, merged across processes; a name the command's own metrics take is refused."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from fastgrpo.rewards.scoring import RewardError
from fastgrpo.rollout import BuiltinEngine, SamplingParams
from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.evaluate import build_eval_task, evaluate, logged_metrics
from fastgrpo.train.expert_iteration import ExpertIteration


def counting_judge(completions, log_metric, **kwargs):
    """Logs each batch's size (so a mean over batches of unequal sizes tells a mean of all values from a mean of the
    batches' means) and a metric it never measures."""
    for _ in completions:
        log_metric("judge/batch_size", float(len(completions)))
    log_metric("judge/unmeasured", float("nan"))
    return [0.0] * len(completions)


def _ei(tmp_path, reward, **fields) -> ExpertIteration:
    tokenizer = default_task.build_tokenizer()
    config = EIConfig(**{**default_task.EI_PRESET, "prompt_format": "raw", "questions_per_step": 4,
                         "num_generations": 2, "batch_size": 4, "micro_batch_size": 4, "sft_epochs": 1, "ei_steps": 1,
                         "progress_bar": False, "logging_steps": 0, "export": False,
                         "output_dir": str(tmp_path), **fields})
    return ExpertIteration(default_task.build_model(tokenizer), tokenizer, reward, default_task.build_dataset(8), config)


def test_an_expert_iteration_round_records_what_its_rewards_log(tmp_path, caplog):
    """The round's 8 completions (4 questions x 2) are scored at once: the round's line in metrics.jsonl has 8.0, null
    for a name never measured; the evaluations before and after the round (3 rows, one batch) have theirs as
    eval/<name> (a null one left out, as the summary's other null fields are). Every other name of the round is one
    log_metric may not take."""
    run = _ei(tmp_path, counting_judge, eval_steps=1, eval_max_examples=3)
    with caplog.at_level(logging.WARNING, logger="fastgrpo"):
        history = run.train()
    start, line = [json.loads(text) for text in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["judge/batch_size"] == history[0]["judge/batch_size"] == 8.0 and line["judge/unmeasured"] is None
    assert start["eval/judge/batch_size"] == line["eval/judge/batch_size"] == 3.0  # one batch of the 3 rows
    assert "eval/judge/unmeasured" not in line and "log_metric" not in caplog.text
    assert [name for name in history[0] if name not in run.taken_names] == ["judge/batch_size", "judge/unmeasured"]


def test_a_logged_metric_named_as_one_of_a_rounds_stops_the_run_before_its_fine_tuning(tmp_path):
    """Every completion is correct (reward 1.0), so the round would fine-tune on them: refused as the function logs
    the name, the round stops before, the weights untouched and nothing saved."""
    def clashing(completions, log_metric, **kwargs):
        log_metric("kept_frac", 1.0)
        return [1.0] * len(completions)

    run = _ei(tmp_path, clashing)
    before = {name: tensor.clone() for name, tensor in run.model.state_dict().items()}
    with pytest.raises(RewardError, match=r"^reward function clashing logged metric 'kept_frac' with log_metric \(at "
                                          r"test_reward_logs_commands.py:\d+, in clashing\), a name fastgrpo's own "
                                          r"metrics take; give it another \(e.g. 'clashing/kept_frac'\)$"):
        run.train()
    assert all(torch.equal(before[name], tensor) for name, tensor in run.model.state_dict().items())
    assert run.round == 0 and not list(tmp_path.glob("checkpoint-*"))


def _task(reward, rows: int = 3):
    tokenizer = default_task.build_tokenizer()
    rows = [{"prompt": f"{i} say a", "letter": "a"} for i in range(rows)]
    task = build_eval_task(rows, tokenizer, prompt_column="prompt", prompt_format="raw", reward_funcs=[reward])
    return BuiltinEngine(default_task.build_model(tokenizer), tokenizer), tokenizer, task


def test_an_evaluation_summary_has_the_mean_of_every_batchs_values():
    """3 rows x 2 samples, 2 rows per engine call: batches of 4 and 2 completions, mean (4 * 4 + 2 * 2) / 6."""
    engine, tokenizer, task = _task(counting_judge)
    _, summary = evaluate(engine, tokenizer, task, SamplingParams(max_new_tokens=2), num_generations=2, batch_size=2)
    assert summary["judge/batch_size"] == pytest.approx(20 / 6) and summary["judge/unmeasured"] is None
    assert logged_metrics(summary) == {"judge/batch_size": summary["judge/batch_size"], "judge/unmeasured": None}


@pytest.mark.parametrize("name", ["accuracy", "dataset", "pass@2"])
def test_a_logged_metric_named_as_a_summarys_field_stops_the_evaluation_at_once(name):
    """A field of the summary, or one the command adds to it (the dataset evaluated), would be hidden (pass@k: with
    several samples per row): the evaluation stops at the first batch that logs it (of 3 rows, one per batch), not
    after generating them all."""
    calls = []

    def clashing(completions, log_metric, **kwargs):
        calls.append(len(completions))
        log_metric(name, 1.0)
        return [0.0] * len(completions)

    engine, tokenizer, task = _task(clashing)
    with pytest.raises(RewardError, match=rf"^reward function clashing logged metric '{name}' with log_metric \(at "
                                          rf"test_reward_logs_commands.py:\d+, in clashing\), a name fastgrpo's own "
                                          rf"metrics take; give it another \(e.g. 'clashing/{name}'\)$"):
        evaluate(engine, tokenizer, task, SamplingParams(max_new_tokens=2), batch_size=1)
    assert calls == [1]


def test_fastgrpo_eval_writes_them_in_its_summary_and_its_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(
        "def judge(completions, log_metric, **kwargs):\n"
        "    log_metric('judge/seen', float(len(completions)))\n"
        "    return [1.0] * len(completions)\n")
    assert main(["eval", "--output-dir", "out", "--max-examples", "3", "--batch-size", "2", "--reward-funcs",
                 "my_rewards.py:judge"]) == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["judge/seen"] == 1.5  # batches of 2 and 1
    assert "reward 1.000, judge/seen 1.500 over 3 completions; " in capsys.readouterr().out


def _logged_by_rank(rank: int, tmp) -> list[dict]:
    """A round's metrics and an evaluation's summary on this process, its reward function logging 0.0 once on rank 0,
    1.0 twice and "rank1_only" on rank 1 in each call."""
    from fastgrpo.train.distributed import Distributed

    def by_rank(completions, log_metric, **kwargs):
        for _ in range(rank + 1):
            log_metric("by_rank", float(rank))
        if rank == 1:
            log_metric("rank1_only", 5.0)
        return [0.0] * len(completions)

    round_metrics = _ei(tmp / "ei", by_rank, micro_batch_size=2).run_round()
    engine, tokenizer, task = _task(by_rank, rows=4)
    _, summary = evaluate(engine, tokenizer, task, SamplingParams(max_new_tokens=2), dist=Distributed.current())
    return [{key: value for key, value in found.items() if key in ("by_rank", "rank1_only")}
            for found in (round_metrics, summary)]


def test_under_torchrun_they_are_the_mean_of_every_processs_values(tmp_path):
    """2 gloo processes: a round's metrics (on every process) and an evaluation's summary (rank 0's; the others
    return none) have the mean over all values ((0 + 1 + 1) / 3, not the mean of the processes' means), a name only
    one process logged too."""
    from tests.forked_gloo import run_forked

    merged = {"by_rank": pytest.approx(2 / 3), "rank1_only": 5.0}
    assert run_forked(_logged_by_rank, tmp_path, deadline_s=120, group_timeout_s=60) == [[merged, merged],
                                                                                          [merged, {}]]
