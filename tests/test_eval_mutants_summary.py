"""An evaluation's summary and metrics line, found by the step-logic mutation audit: the numbers over the records
that test_eval_summary's run leaves untested (an unscored completion, the wrong ones' lengths, the r1_zero rates),
a reward exactly at correct_threshold, and the whole numbers a periodic evaluation adds to the step's metrics."""
import pytest

from fastgrpo.rewards import r1_zero_math_reward
from fastgrpo.rollout import BuiltinEngine, SamplingParams
from fastgrpo.train import default_task
from fastgrpo.train.evaluate import build_eval_task, evaluate, summarize
from fastgrpo.train.periodic_eval import PeriodicEval


def _record(index, sample, reward, correct, length, finish="stop", grades=(None, None)):
    return {"index": index, "sample": sample, "reward": reward, "correct": correct, "length": length,
            "finish_reason": finish, "format_reward": grades[0], "answer_reward": grades[1]}


def test_the_summary_means_skip_unscored_completions_and_split_lengths_by_correctness():
    """Two examples x 2 samples: one completion unscored (reward None: no function applied), which the reward mean
    leaves out rather than counting 0, and which is not correct."""
    records = [_record(0, 0, 1.0, True, 4), _record(0, 1, None, False, 8, "length"),
               _record(1, 0, 0.5, False, 6), _record(1, 1, 1.0, True, 2)]
    summary = summarize(records, ["f"], {}, 1.0, 20)
    assert summary["reward"] == pytest.approx(2.5 / 3) and summary["accuracy"] == 0.5
    assert summary["completion_length_correct"] == 3 and summary["completion_length_wrong"] == 7
    assert summary["completion_length"] == 5 and summary["completion_length_max"] == 8
    assert summary["truncated_frac"] == 0.25 and summary["pass@2"] == 1.0 and summary["pass@1"] == 0.5


def test_the_r1_zero_rates_are_the_format_and_answer_means():
    """A completion in the answer format but wrong: format 1, answer 0 (the format rate is not the answer rate)."""
    records = [_record(0, 0, 0.0, False, 5, grades=(1.0, 0.0)), _record(1, 0, 1.0, True, 5, grades=(1.0, 1.0)),
               _record(2, 0, 0.0, False, 5, grades=(0.0, 0.0)), _record(3, 0, 0.0, False, 5, grades=(1.0, 0.0))]
    summary = summarize(records, [r1_zero_math_reward.__name__], {}, 1.0, 20)
    assert (summary["format_rate"], summary["answer_rate"]) == (0.75, 0.25)


def _task(tokenizer, reward, threshold):
    rows = [{"prompt": f"{i} say a", "letter": "a"} for i in range(2)]
    return build_eval_task(rows, tokenizer, prompt_column="prompt", prompt_format="raw", reward_funcs=[reward],
                           correct_threshold=threshold)


def half(prompts, completions, **kwargs):
    return [0.5] * len(completions)


def test_a_reward_at_correct_threshold_is_correct():
    """correct: reward >= correct_threshold (as ei's rounds keep a completion): a reward of exactly 0.5 at threshold
    0.5 is correct, at 0.5000001 it is not."""
    tokenizer = default_task.build_tokenizer()
    engine = BuiltinEngine(default_task.build_model(tokenizer), tokenizer)
    for threshold, accuracy in ((0.5, 1.0), (0.5000001, 0.0)):
        records, summary = evaluate(engine, tokenizer, _task(tokenizer, half, threshold),
                                    SamplingParams(max_new_tokens=2), num_generations=2)
        assert [r["correct"] for r in records] == [accuracy == 1.0] * 4 and summary["accuracy"] == accuracy


def test_a_periodic_evaluation_reports_its_whole_numbers_too(tmp_path):
    """The step's metrics carry every number of the summary (eval/num_examples, eval/completion_length_max are
    ints), not its lists, texts or dicts."""
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    periodic = PeriodicEval(model, BuiltinEngine(model, tokenizer), tokenizer, _task(tokenizer, half, 0.5),
                            SamplingParams(max_new_tokens=2), every=1, output_dir=tmp_path)
    metrics = periodic(1)
    assert metrics["eval/num_examples"] == 2 and metrics["eval/num_samples"] == 2
    assert isinstance(metrics["eval/completion_length_max"], int) and metrics["eval/accuracy"] == 1.0
    assert not {"eval/reward_funcs", "eval/reward_errors", "eval/sampling", "eval/date"} & set(metrics)
