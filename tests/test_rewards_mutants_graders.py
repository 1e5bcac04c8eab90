"""The built-in rewards on cases the rest of the suite left open: each test kills mutants of fastgrpo/rewards
(answers.py, ifeval.py, length.py, completions.py) that passed it (a mutation audit)."""
import pytest

from fastgrpo.rewards import (
    boxed_math_reward, check_constraint, ifeval_reward, is_equivalent, length_reward, score,
)

pytest.importorskip("math_verify")


def test_a_multi_message_completion_is_graded_on_all_its_text():
    """A completion of several messages (a tool call, whose message has no text, its result, the answer): every
    text content counts, the tool call's None content is skipped."""
    completion = [{"role": "assistant", "content": None, "tool_calls": [{"name": "calc"}]},
                  {"role": "tool", "content": "4"}, {"role": "assistant", "content": "so \\boxed{4}"}]
    prompts = [[{"role": "user", "content": "2+2?"}]]
    assert boxed_math_reward(prompts, [completion], answer=["4"]) == [1.0]
    assert length_reward(prompts, [completion], target_length=len("4\nso \\boxed{4}")) == [1.0]


def test_blank_lines_around_the_text_make_no_paragraph():
    text = "\n\nFirst paragraph.\n\nSecond one.\n\n"
    assert check_constraint(text, {"type": "num_paragraphs", "min": 2, "max": 2})


def test_a_row_without_constraints_is_all_satisfied():
    """The fraction satisfied of none is 1.0 (every one of them), as all() of nothing."""
    assert ifeval_reward(["q", "q"], ["x", ""], constraints=[[], [{"type": "num_words", "max": 0}]]) == [1.0, 1.0]


def test_score_passes_a_chat_datasets_completions_as_trl():
    """TRL (GRPOTrainer._generate_and_score_completions) wraps each completion of a conversational dataset as
    [{"role": "assistant", "content": text}], and passes a standard dataset's as the text."""
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.append(completions)
        return [0.0] * len(completions)

    chat = [{"role": "user", "content": "hi"}]
    score([spy], [chat, chat], ["a", "b"], {})
    score([spy], ["hi", "hi"], ["a", "b"], {})
    assert seen == [[[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]], ["a", "b"]]


@pytest.mark.parametrize("prediction, answer", [("12\\,34", "1234"), ("1\\,0000", "10000"), ("1\\,000\\,0", "10000")])
def test_only_a_thin_space_before_a_group_of_three_digits_is_a_thousands_separator(prediction, answer):
    """1\\,000 is 1000 (tests/test_rewards_answers.py); a thin space before 2 or 4 digits groups no thousands."""
    assert not is_equivalent(prediction, answer)
