"""Verifiable rewards: correct scores on known cases, deterministic and in range on arbitrary text; a failing
reward function (raises, wrong count, NaN / inf / non-numbers) is reported with its first bad row and scored 0,
and stops a training run with one line naming the function and the dataset row unless reward_errors="skip"."""
import functools
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.rewards import (
    boxed_math_reward, check_constraint, ifeval_reward, is_equivalent, length_reward, r1_zero_math_reward,
    required_columns, score,
)
from fastgrpo.rewards.answers import last_boxed

pytest.importorskip("math_verify")


@pytest.mark.parametrize("completion, answer, expected", [
    ("Let me think. </think> <answer> \\frac{1}{2} </answer>", "0.5", 1.0),
    ("</think><answer>0.5</answer>", "\\frac12", 1.0),
    ("x</think> <answer>$2\\sqrt{2}$</answer>", "\\sqrt{8}", 1.0),
    ("</think> <answer> 3 </answer>", "4", 0.0),
    ("<answer>0.5</answer>", "0.5", 0.0),  # no </think>: wrong format
    ("</think> <answer>0.5", "0.5", 0.0),  # unclosed answer
    ("</think> <answer></answer>", "0", 0.0),
])
def test_r1_zero_math_reward(completion, answer, expected):
    assert r1_zero_math_reward(["q"], [completion], answer=[answer]) == [expected]


@pytest.mark.parametrize("completion, answer, expected", [
    ("so the answer is \\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{1} then \\boxed{2}", "2", 1.0),  # the last box counts
    ("\\boxed{1} then \\boxed{2}", "1", 0.0),
    ("\\boxed{x^{2}+1}", "1 + x^2", 1.0),
    ("\\boxed{5", "5", 0.0),
    ("no box: 5", "5", 0.0),
])
def test_boxed_math_reward(completion, answer, expected):
    assert boxed_math_reward(["q"], [completion], answer=[answer]) == [expected]


@pytest.mark.parametrize("answer, problem", [(None, "null"), (float("nan"), "null"), ("", "empty"), ("  ", "empty")])
def test_math_rewards_refuse_a_missing_reference_answer(answer, problem):
    """A null answer (JSON null, None, pandas' NaN) was read as the text "None" and an empty one parsed to nothing:
    every completion scored 0, silently. Each is a ValueError whatever the completion; score() reports it as the
    function's failure (the run names the row)."""
    message = rf"^answer: expected a reference answer, got {answer!r} \({problem}\); math rewards need one per row$"
    for completion in ("</think> <answer> 1 </answer>", "no answer at all", "\\boxed{1}"):
        for reward in (r1_zero_math_reward, boxed_math_reward):
            with pytest.raises(ValueError, match=message):
                reward(["q"], [completion], answer=[answer])
    with pytest.raises(ValueError, match=message):
        is_equivalent("1", answer)
    _, failures = score([boxed_math_reward], ["q", "q"], ["\\boxed{1}", "x"], {"answer": ["1", answer]})
    assert failures["boxed_math_reward"].startswith("raised ValueError: answer: expected a reference answer")
    assert r1_zero_math_reward(["q"], ["</think> <answer> 0 </answer>"], answer=[0]) == [1.0]  # 0 is an answer


@pytest.mark.parametrize("as_dataset", [False, True])
@pytest.mark.parametrize("answer, problem", [(None, "null"), ("", "empty")])
def test_a_training_row_without_an_answer_is_refused_before_anything_runs(as_dataset, answer, problem):
    """A JSONL row with "answer": null (a list of rows) or a datasets.Dataset's None trained against a 0 reward;
    the trainer refuses it when it is built, naming the row and the column."""
    from fastgrpo.train import default_task
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.train.trainer import GRPOTrainer

    rows = [{"prompt": f"{i} say a", "answer": "a"} for i in range(4)]
    rows[2]["answer"] = answer
    if as_dataset:
        rows = pytest.importorskip("datasets").Dataset.from_list(rows)
    tokenizer = default_task.build_tokenizer()
    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 4, "num_generations": 4, "micro_batch_size": 4,
                           "max_completion_length": 4, "export": False, "progress_bar": False})
    message = (rf"^dataset: row 2 has no answer \(the answer column is {problem}\); reward function "
               r"r1_zero_math_reward needs one per row$")
    with pytest.raises(ValueError, match=message):
        GRPOTrainer(default_task.build_model(tokenizer), tokenizer, r1_zero_math_reward, rows, config)


def test_last_boxed_matches_braces():
    assert last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed") is None


@given(st.text(max_size=200))
def test_math_rewards_safe_on_arbitrary_text(text):
    for reward in (r1_zero_math_reward, boxed_math_reward):
        for completion in (text, f"</think> <answer>{text}</answer>", f"\\boxed{{{text}}}"):
            out = reward(["q"], [completion], answer=["1"])
            assert out == reward(["q"], [completion], answer=["1"]) and out[0] in (0.0, 1.0)


@pytest.mark.parametrize("text, constraint, expected", [
    ("one two three", {"type": "num_words", "min": 3, "max": 3}, True),
    ("one two", {"type": "num_words", "min": 3}, False),
    ("Hi. How are you? Fine!", {"type": "num_sentences", "min": 3, "max": 3}, True),
    ("Hi. No end", {"type": "num_sentences", "max": 1}, False),
    ("a\n\nb\n\n\nc", {"type": "num_paragraphs", "min": 3, "max": 3}, True),
    ("The cat sat.", {"type": "required_keywords", "keywords": ["cat", "sat"]}, True),
    ("concatenate", {"type": "required_keywords", "keywords": ["cat"]}, False),  # whole words only
    ("I am sorry", {"type": "forbidden_keywords", "keywords": ["Sorry"]}, False),
    ('{"a": [1, 2]}', {"type": "json_output"}, True),
    ('```json\n{"a": 1}\n```', {"type": "json_output"}, True),
    ("{a: 1}", {"type": "json_output"}, False),
    ("ALL CAPS 123", {"type": "letter_case", "case": "upper"}, True),
    ("Not all", {"type": "letter_case", "case": "lower"}, False),
    ("123", {"type": "letter_case", "case": "lower"}, False),
    ("  Dear sir", {"type": "starts_with", "prefix": "Dear"}, True),
    ("Thanks. Bye!\n", {"type": "ends_with", "suffix": "Bye!"}, True),
    ("Thanks. Bye", {"type": "ends_with", "suffix": "Bye!"}, False),
])
def test_constraints(text, constraint, expected):
    assert check_constraint(text, constraint) is expected


def test_ifeval_reward_is_the_fraction_satisfied():
    constraints = [{"type": "num_words", "max": 3}, {"type": "letter_case", "case": "lower"}]
    assert ifeval_reward(["q", "q"], ["two words", "Many More Words Here"], constraints=[constraints] * 2) == [1.0, 0.0]
    assert ifeval_reward(["q"], ["Two words"], constraints=[constraints]) == [0.5]


def test_unknown_constraint_is_a_value_error():
    with pytest.raises(ValueError, match="unknown type 'rhymes'"):
        check_constraint("x", {"type": "rhymes"})
    with pytest.raises(ValueError, match="bad arguments"):
        check_constraint("x", {"type": "num_words", "most": 3})
    with pytest.raises(ValueError, match="constraints: expected a dict"):
        check_constraint("x", "num_words")
    with pytest.raises(ValueError, match="letter_case expects case 'upper' or 'lower', got 'title'"):
        check_constraint("x", {"type": "letter_case", "case": "title"})


@given(st.text(max_size=300))
def test_ifeval_safe_on_arbitrary_text(text):
    rows = [[{"type": name, **args}] for name, args in [
        ("num_words", {"min": 1}), ("num_sentences", {"max": 2}), ("num_paragraphs", {"min": 1}),
        ("required_keywords", {"keywords": ["a"]}), ("forbidden_keywords", {"keywords": ["b c"]}),
        ("json_output", {}), ("letter_case", {"case": "upper"}), ("starts_with", {"prefix": "x"}),
        ("ends_with", {"suffix": "."}),
    ]]
    out = ifeval_reward(["q"] * len(rows), [text] * len(rows), constraints=rows)
    assert all(v in (0.0, 1.0) for v in out)


def test_length_reward():
    texts = ["x" * 10, "x" * 5, "", "x" * 30]
    assert length_reward([""] * 4, texts, target_length=10) == [1.0, 0.5, 0.0, 0.0]
    assert length_reward(["", ""], ["abc", "abc"], target_length=[3, 6]) == [1.0, 0.5]


def test_required_columns():
    assert required_columns(r1_zero_math_reward) == ["answer"]
    assert required_columns(ifeval_reward) == ["constraints"]
    assert required_columns(length_reward) == []
    assert required_columns(lambda prompts, completions, **kw: []) == []


def test_score_reports_failures_and_scores_them_zero():
    def ok(prompts, completions, **kw):
        return [1.5] * len(completions)

    def raises(prompts, completions, **kw):
        raise RuntimeError("boom\nsecond line")

    def short(prompts, completions, **kw):
        return [1.0]

    def junk(prompts, completions, **kw):
        return [float("nan"), None, "x"]  # NaN and None: does not apply, as in TRL

    def infinite(prompts, completions, **kw):
        return [1, True, float("-inf")]

    def text(prompts, completions, **kw):
        return [1.0, "1", 0.5]

    rewards, errors = score([ok, raises, short, junk, infinite, text], ["p"] * 3, ["a", "b", "c"], {})
    assert rewards[:, 0].tolist() == [1.5] * 3
    assert rewards[:, 1:3].abs().sum() == 0 and rewards[:, 4].tolist() == [1.0, 1.0, 0.0]
    assert rewards[:2, 3].isnan().all() and rewards[2, 3] == 0
    assert errors == {"raises": "raised RuntimeError: boom", "short": "returned 1 rewards for 3 completions",
                      "junk": "returned 'x', not a finite number, None or NaN",
                      "infinite": "returned -inf, not a finite number, None or NaN",
                      "text": "returned '1', not a finite number, None or NaN"}
    assert [(e.function, e.row) for e in errors.values()] == [
        ("raises", None), ("short", None), ("junk", 2), ("infinite", 2), ("text", 1)]
    assert json.loads(json.dumps(errors)) == errors  # plain strings in metrics.jsonl


def test_none_rewards_are_left_out_as_in_trl():
    """A None reward (the function does not apply) is NaN: left out of the weighted sum across functions, the group
    means and stds (TRL's nansum / nanmean / nanstd); a completion no function scored gets advantage 0."""
    import torch

    from fastgrpo.loss.grpo import reward_advantages, weighted_rewards

    def math_only(prompts, completions, **kw):
        return [1.0 if c.startswith("m") else None for c in completions]

    def code_only(prompts, completions, **kw):
        return [0.5 if c.startswith("c") else None for c in completions]

    per_func, errors = score([math_only, code_only], ["p"] * 4, ["m1", "c1", "m2", "?"], {})
    assert not errors and per_func.isnan().tolist() == [[False, True], [True, False], [False, True], [True, True]]
    weights = torch.tensor([2.0, 1.0], dtype=torch.float64)
    rewards = weighted_rewards(per_func, weights)
    assert rewards[:3].tolist() == [2.0, 0.5, 2.0] and math.isnan(rewards[3])
    # groups of 2: (2.0, 0.5) and (2.0, unscored): the second group's one scored row has no std, advantage 0
    mean, std = 1.25, math.sqrt(2 * 0.75 ** 2)
    for scale, expected in [("group", [0.75 / std, -0.75 / std, 0.0, 0.0]),
                            ("batch", [(2.0 - mean) / math.sqrt(0.75), (0.5 - mean) / math.sqrt(0.75), 0.0, 0.0]),
                            ("none", [0.75, -0.75, 0.0, 0.0])]:
        advantages = reward_advantages(per_func, weights, 2, scale, 0.0)
        assert advantages.tolist() == pytest.approx(expected, rel=1e-12), scale
    assert reward_advantages(per_func, weights, 2, "group", 1e-4, "normalize_then_sum").isfinite().all()


def _trainer(tmp_path, reward, **fields):
    from fastgrpo.train import default_task
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.train.trainer import GRPOTrainer

    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 8,
                           "max_completion_length": 4, "max_steps": 3, "export": False, "progress_bar": False,
                           "logging_steps": 0, "output_dir": str(tmp_path), **fields})
    tokenizer = default_task.build_tokenizer()
    return GRPOTrainer(default_task.build_model(tokenizer), tokenizer, [default_task.repeat_letter_reward, reward],
                       default_task.build_dataset(16), config)


@pytest.mark.parametrize("failure, message", [
    ("raise", r"reward function flaky raised ZeroDivisionError: division by zero \(at test_rewards.py:\d+, in flaky\) "
              r"on dataset row \d+ \(completion 3 of 4\): '.*'"),
    ("count", r"reward function flaky returned 7 rewards for 8 completions; reward_errors='skip'"),
    ("inf", r"reward function flaky returned inf, not a finite number, None or NaN on dataset row \d+ \(completion 3 "
            r"of 4"),
])
def test_a_failing_reward_stops_the_run_naming_function_and_row(tmp_path, failure, message):
    """flaky works in step 1 and fails in step 2 on the third completion: the run stops with one line, after
    saving step 1 for --resume."""
    from fastgrpo.rewards.scoring import RewardError
    from fastgrpo.train.checkpoint import list_checkpoints

    calls = []

    def flaky(prompts, completions, **kwargs):
        calls.append(len(completions))
        n = len(completions)
        if len(calls) == 1:
            return [0.5] * n
        if failure == "raise":  # the batch of step 2 raises, then (called row by row) its third row alone does
            if len(calls) in (2, 5):
                raise ZeroDivisionError("division by zero")
            return [0.5] * n
        return [0.5] * (n - 1) if failure == "count" else [0.5, 0.5, float("inf")] + [0.5] * (n - 3)

    with pytest.raises(RewardError, match=message + r".*step 1 is saved in .*checkpoint-1: continue with resume=True"):
        _trainer(tmp_path, flaky).train()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]


def test_repeated_reward_names_stay_apart():
    from fastgrpo.rewards.scoring import reward_names

    half = functools.partial(length_reward, target_length=2)
    funcs = [lambda p, c, **kw: 1 / 0, half, lambda p, c, **kw: 1 / 0, half]
    names = reward_names(funcs)
    assert names == ["<lambda>", "length_reward", "<lambda>_2", "length_reward_2"]  # a partial: as TRL names it
    _, errors = score(funcs, ["p"], ["ab"], {})
    assert set(errors) == {"<lambda>", "<lambda>_2"}


def test_score_passes_dataset_columns():
    def needs(prompts, completions, answer, **kw):
        return [float(c == a) for c, a in zip(completions, answer)]

    rewards, errors = score([needs], ["p", "p"], ["1", "2"], {"answer": ["1", "1"]})
    assert rewards[:, 0].tolist() == [1.0, 0.0] and not errors


@pytest.mark.parametrize("not_applicable", [None, math.nan], ids=["None", "NaN"])
def test_a_run_trains_through_none_rewards(tmp_path, caplog, not_applicable):
    """TRL's None: a function that applies to some completions only trains with finite losses and metrics (before,
    None stopped the run); a completion no function scored is named in a warning and gets advantage 0. NaN is the
    same (TRL's nansum reads it as None; before, it stopped the run as a bug)."""
    import logging

    from fastgrpo.train import default_task
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.train.trainer import GRPOTrainer

    def first_only(prompts, completions, letter, **kwargs):  # scores a batch's first completion, None the rest
        return (default_task.repeat_letter_reward(prompts[:1], completions[:1], letter[:1])
                + [not_applicable] * (len(letter) - 1))

    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 8,
                           "max_completion_length": 4, "max_steps": 2, "export": False, "progress_bar": False,
                           "logging_steps": 0, "output_dir": str(tmp_path)})
    tokenizer = default_task.build_tokenizer()
    trainer = GRPOTrainer(default_task.build_model(tokenizer), tokenizer, first_only, default_task.build_dataset(16),
                          config)
    with caplog.at_level(logging.WARNING, logger="fastgrpo"):
        history = trainer.train()
    assert len(history) == 2 and all(math.isfinite(m["loss"]) and math.isfinite(m["reward"]) for m in history)
    assert all(m["reward_errors"] == 0 and m["rewards/first_only"] == m["reward"] for m in history)
    assert "every reward function returned None (or NaN) for 7 completion(s), first dataset row" in caplog.text
