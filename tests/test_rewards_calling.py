"""How reward functions are called: as TRL calls them (prompts and completions by keyword, each dataset column as a
keyword holding one value per completion), so a function written for TRL's GRPOTrainer works unchanged."""
import asyncio
import functools
import math

import pytest

from fastgrpo.rewards import required_columns, score
from fastgrpo.rewards.scoring import RewardError, check_failures


def accuracy_reward(completions, solution, **kwargs):  # the shape of TRL's documented examples
    return [float(c == s) for c, s in zip(completions, solution)]


def format_reward(completions, **kwargs):
    return [float(c.startswith("<")) for c in completions]


def test_a_trl_style_reward_gets_its_arguments_by_keyword():
    """TRL passes prompts= and completions= by keyword; fastgrpo passed them by position, so `f(completions,
    solution, **kwargs)` got the prompts as completions and failed with "got multiple values for argument"."""
    per_func, failures = score([accuracy_reward, format_reward], ["p", "q"], ["1", "<2"], {"solution": ["1", "1"]})
    assert not failures and per_func.tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert required_columns(accuracy_reward) == ["solution"]  # checked against the dataset before anything runs
    assert required_columns(format_reward) == []


def test_positional_rewards_still_work():
    """fastgrpo's own convention, f(prompts, completions, ...), with any parameter names."""
    def positional_only(prompts, completions, /, **kwargs):
        return [len(x) for x in completions]

    per_func, failures = score([lambda p, c, **kw: [len(x) for x in c], positional_only], ["p"], ["abc"], {})
    assert not failures and per_func.tolist() == [[3.0, 3.0]]
    assert required_columns(lambda p, c, answer, **kw: []) == ["answer"]


def test_a_trl_style_reward_trains(tmp_path):
    """A run end to end with a keyword-style reward reading a dataset column (the built-in task's `letter`)."""
    from fastgrpo.train import default_task
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.train.trainer import GRPOTrainer

    def letter_reward(completions, letter, **kwargs):
        assert len(letter) == len(completions)  # one value per completion, as TRL repeats the row's
        return default_task.repeat_letter_reward(None, completions, letter)

    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 8,
                           "max_completion_length": 4, "max_steps": 1, "export": False, "progress_bar": False,
                           "logging_steps": 0, "output_dir": str(tmp_path)})
    tokenizer = default_task.build_tokenizer()
    trainer = GRPOTrainer(default_task.build_model(tokenizer), tokenizer, letter_reward,
                          default_task.build_dataset(16), config)
    history = trainer.train()
    assert history[0]["reward_errors"] == 0 and math.isfinite(history[0]["rewards/letter_reward"])


@pytest.mark.parametrize("returned", ["numpy", "tensor"])
def test_array_rewards_are_read_as_lists(returned):
    """A numpy array or a torch tensor of N rewards is N rewards; a NaN in one does not apply (as None), an inf is a
    failure."""
    import numpy as np
    import torch

    make = np.array if returned == "numpy" else torch.tensor
    per_func, failures = score([lambda p, c, **kw: make([1.0, 0.5])], ["p"] * 2, ["a", "b"], {})
    assert not failures and per_func[:, 0].tolist() == [1.0, 0.5]
    per_func, failures = score([lambda p, c, **kw: make([1.0, float("nan")])], ["p"] * 2, ["a", "b"], {})
    assert not failures and per_func[0, 0] == 1.0 and per_func[1, 0].isnan()
    _, failures = score([lambda p, c, **kw: make([1.0, float("inf")])], ["p"] * 2, ["a", "b"], {})
    assert failures["<lambda>"].row == 1


def test_built_in_rewards_read_chat_completions_as_trl_passes_them():
    """TRL (and so FastGRPOTrainer) passes a conversational dataset's completions as [{"role": "assistant",
    "content": text}]: the math rewards and ifeval raised TypeError on them and length scored len(list) == 1."""
    from fastgrpo.rewards import boxed_math_reward, ifeval_reward, length_reward, r1_zero_math_reward

    def chat(text):
        return [{"role": "assistant", "content": text}]

    prompts = [[{"role": "user", "content": "q"}]]
    assert r1_zero_math_reward(prompts, [chat("x </think> <answer> 4 </answer>")], answer=["4"]) == [1.0]
    assert boxed_math_reward(prompts, [chat("\\boxed{4}")], answer=["4"]) == [1.0]
    assert ifeval_reward(prompts, [chat("two words")], constraints=[[{"type": "num_words", "max": 2}]]) == [1.0]
    assert length_reward(prompts, [chat("x" * 10)], target_length=10) == [1.0]
    with pytest.raises(ValueError, match=r"^completions: expected text or a list of chat messages"):
        length_reward(prompts, [{"content": "x"}], target_length=10)


async def async_length(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


class AsyncJudge:  # an object with an async __call__ and no __name__, as TRL's docs allow
    async def __call__(self, prompts, completions, **kwargs):
        return [1.0 if "b" in c else None for c in completions]


async def async_lookup(completions, table, **kwargs):
    return [row[c] for row, c in zip(table, completions)]  # KeyError on a completion not in the row's table


def test_async_rewards_are_awaited():
    """TRL awaits an async reward function (a function, a partial of one, an object with an async __call__), all of a
    batch's together; fastgrpo took the coroutine for its rewards ("returned <coroutine object ...>, expected a list
    of 2 rewards") and never awaited it."""
    funcs = [async_length, functools.partial(async_length), AsyncJudge()]
    per_func, failures = score(funcs, ["p", "q"], ["a", "bb"], {})
    assert not failures and per_func[:, :2].tolist() == [[1.0, 1.0], [2.0, 2.0]]
    assert math.isnan(per_func[0, 2]) and per_func[1, 2] == 1.0  # None: not applicable, as for a plain function

    async def in_a_running_loop():  # a notebook's: the rewards' loop is another
        return score([async_length], ["p"], ["abc"], {})

    assert asyncio.run(in_a_running_loop())[0].tolist() == [[3.0]]


def test_an_async_reward_that_raises_names_its_row():
    """An async function's exception is its failure, and the row it fails on is found as for a plain function."""
    table = [{"a": 1.0, "b": 0.0}] * 3
    _, failures = score([async_lookup], ["p"] * 3, ["a", "c", "b"], {"table": table})
    assert failures["async_lookup"].startswith("raised KeyError: 'c'")
    with pytest.raises(RewardError, match=r"async_lookup raised KeyError: 'c' \(at test_rewards_calling.py:\d+, in "
                                          r"(<listcomp>|async_lookup)\) on row 1: 'c'"):
        check_failures(failures, [async_lookup], ["p"] * 3, ["a", "c", "b"], {"table": table}, on_error="raise")


class Judge:
    def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)


def logs_accuracy(completions, log_metric, **kwargs):  # TRL's log_metric, required
    log_metric("accuracy", 1.0)
    return [1.0] * len(completions)


def logs_if_it_can(completions, log_metric=None, **kwargs):
    if log_metric is not None:
        log_metric("accuracy", 1.0)
    return [1.0] * len(completions)


def test_what_a_run_would_call_wrongly_is_refused_before_it_starts():
    """A class named as a reward (`--reward-funcs my_rewards.py:Judge`) was constructed with the completions once
    the model had loaded and sampled (TypeError: Judge() takes no arguments). An instance of the class works; so does
    a function needing TRL's log_metric, with a default or without (before, it was refused: fastgrpo passed none)."""
    from fastgrpo.rewards.reward_logs import RewardLogs
    from fastgrpo.train.input_checks import check_reward_rows

    rows = [{"prompt": "p"}]
    with pytest.raises(ValueError, match=r"^reward_funcs: Judge is a class; expected a reward function or an "
                                         r"instance \(Judge\(\)\) of a class with __call__$"):
        check_reward_rows(rows, "prompt", [Judge], "dataset")
    check_reward_rows(rows, "prompt", [Judge(), logs_if_it_can, logs_accuracy], "dataset")
    logs = RewardLogs()
    per_func, failures = score([Judge(), logs_if_it_can, logs_accuracy], ["p"], ["a"], {}, logs=logs)
    assert not failures and per_func.tolist() == [[1.0, 1.0, 1.0]]
    assert logs.values == {"accuracy": [1.0, 1.0]} and logs.sources == {"accuracy": "logs_if_it_can"}


def _score_async_in_child(queue) -> None:
    queue.put(score([async_length], ["p"], ["abcd"], {})[0].tolist())


def test_a_forked_child_scores_async_rewards_after_its_parent_did():
    """A child forked after the parent scored an async reward (the parent's event loop started) copied the loop but
    not the thread that runs it: its own async reward waited for good."""
    import multiprocessing

    score([async_length], ["p"], ["a"], {})  # the parent's loop runs
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_score_async_in_child, args=(queue,))
    child.start()
    child.join(timeout=30)  # ~1 s when it works
    alive = child.is_alive()
    child.kill()
    assert not alive and queue.get(timeout=5) == [[4.0]], "the forked child's async reward never returned"
