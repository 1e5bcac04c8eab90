"""How a failing reward ends a command. A reward function that raises during a run is the run failing in the
user's code: one line naming the function, the row and where in their code it raised, exit 1 (as any uncaught
Python error; the steps before are saved), and --debug shows the traceback of THEIR function. What can be checked in
the data before anything runs (a row a built-in reward cannot read) is an input mistake: one line, exit 2."""
import json
import traceback

import pytest

from fastgrpo.rewards import CONSTRAINTS, ifeval_reward
from fastgrpo.rewards.scoring import RewardError
from fastgrpo.train.cli import main
from fastgrpo.train.input_checks import check_reward_rows

USER_REWARDS = '''def lookup(text):
    return {"a": 1.0}[text]


def letter_score(prompts, completions, letter, **kwargs):
    return [lookup(text) for text in completions]
'''


def _train(tmp_path, *flags):
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    return main(["train", "--reward-funcs", f"{tmp_path / 'user_rewards.py'}:letter_score", "--max-steps", "1",
                 "--output-dir", str(tmp_path / "run"), "--no-progress-bar", *flags])


def test_a_raising_reward_is_one_line_naming_where_it_raised_exit_1(tmp_path, capsys):
    assert _train(tmp_path) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("fastgrpo train: error: reward function letter_score raised KeyError: ")
    assert "(at user_rewards.py:2, in lookup) on dataset row " in lines[0]


def test_debug_shows_the_traceback_of_the_users_function(tmp_path):
    """The user's exception was caught in score() and dropped: --debug showed only fastgrpo's frames."""
    with pytest.raises(RewardError) as caught:
        _train(tmp_path, "--debug")
    shown = "".join(traceback.format_exception(caught.value))
    assert 'user_rewards.py", line 6, in letter_score' in shown and 'line 2, in lookup' in shown


@pytest.mark.parametrize("constraints, message", [
    ([{"type": "rhymes"}], r"dataset: row 1: constraints: unknown type 'rhymes', expected one of \["),
    ([{"type": "num_words", "most": 3}], r"dataset: row 1: constraints: bad arguments \{'most': 3\} for 'num_words'"),
    ([{"type": "letter_case", "case": "title"}], r"dataset: row 1: constraints: letter_case expects case 'upper' or"),
    (None, r"dataset: row 1: constraints: expected a list of constraints \{'type': name, \*\*arguments\}, got None"),
])
def test_a_constraint_ifeval_cannot_read_is_refused_before_anything_runs(constraints, message):
    """It raised inside ifeval_reward at the first step that sampled the row: after the model loaded and generated,
    as a failing reward (exit 1)."""
    rows = [{"prompt": "a", "constraints": [{"type": "num_words", "min": 1}]},
            {"prompt": "b", "constraints": constraints}]
    with pytest.raises(ValueError, match="^" + message):
        check_reward_rows(rows, "prompt", [ifeval_reward], "dataset")


def test_a_bad_constraint_row_exits_2(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": "a", "constraints": [{"type": t}]}) for t in ("json_output", "x")))
    assert main(["train", "--dataset", str(rows), "--reward-funcs", "ifeval", "--output-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("fastgrpo train: error: dataset: row 1: constraints: unknown type 'x', "
                                               f"expected one of {sorted(CONSTRAINTS)}")


def test_eval_and_ei_name_where_it_raised_too():
    """`fastgrpo eval` and `ei` stop through evaluate.check_reward_failures, which dropped the exception too."""
    from fastgrpo.rewards import score
    from fastgrpo.train.evaluate import check_reward_failures

    def broken(prompts, completions, **kwargs):
        return [1 / 0 for _ in completions]

    _, failures = score([broken], ["p"], ["a"], {})
    with pytest.raises(RewardError, match=r"^reward function broken raised ZeroDivisionError: division by zero \(at "
                                          r"test_rewards_errors.py:\d+, in (<listcomp>|broken)\); ") as caught:
        check_reward_failures(failures, "raise")
    assert "1 / 0" in str(caught.value.__cause__)  # its traceback: --debug shows it


def test_a_failure_keeps_no_frames_alive():
    """With reward_errors="skip" a failure stays in the step's metrics; holding the exception held its frames, and
    through them every local of the step (its tensors), for as long as the run's history lived."""
    import gc
    import weakref

    from fastgrpo.rewards import score

    class Payload:
        pass

    payloads = []

    def raises(prompts, completions, **kwargs):
        payload = Payload()
        payloads.append(weakref.ref(payload))
        raise KeyError("x")

    _, failures = score([raises], ["p"], ["a"], {})
    gc.collect()
    assert payloads[0]() is None
    assert failures["raises"].raised_at.startswith(" (at test_rewards_errors.py:")
    assert "in raises" in failures["raises"].trace
