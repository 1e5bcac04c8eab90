"""The math rewards against hand cases: which <answer> block r1_zero_math grades (the course's r1_zero_reward_fn
reads the last one), and answers written the ways reference answers of MATH / GSM8K are (fractions, boxes,
thousands separators, currency, units, signs, percent)."""
import pytest

from fastgrpo.rewards import boxed_math_reward, is_equivalent, r1_zero_math_reward
from fastgrpo.rewards.answers import r1_zero_grades

pytest.importorskip("math_verify")


@pytest.mark.parametrize("completion, answer, grades", [
    # two answer blocks: the last is graded, as the course's grader does (response.split("<answer>")[-1])
    ("</think> <answer> 3 </answer> wait, no. <answer> 4 </answer>", "4", (1.0, 1.0)),
    ("</think> <answer> 4 </answer> wait, no. <answer> 3 </answer>", "4", (1.0, 0.0)),
    # a box inside the answer: its (last) content is graded; an unclosed box is formatted but wrong
    ("</think> <answer> The answer is \\boxed{4}. </answer>", "4", (1.0, 1.0)),
    ("</think> <answer> \\boxed{3} or \\boxed{4} </answer>", "4", (1.0, 1.0)),
    ("</think> <answer> \\boxed{4 </answer>", "4", (1.0, 0.0)),
    # the last block must be closed: generation stops at </answer>, so an unclosed one was cut off
    ("</think> <answer> 4 </answer> <answer> 4", "4", (0.0, 0.0)),
])
def test_r1_zero_grades_the_last_answer_block(completion, answer, grades):
    assert r1_zero_grades(completion, answer) == grades
    assert r1_zero_math_reward(["q"], [completion], answer=[answer]) == [grades[1]]


@pytest.mark.parametrize("prediction, answer, expected", [
    ("1/2", "0.5", True), ("\\frac{1}{2}", "1/2", True), ("\\dfrac{3}{4}", "0.75", True), ("2/4", "\\frac12", True),
    ("-\\frac{1}{2}", "-0.5", True), ("\\boxed{7}", "7", True), ("7", "\\boxed{7}", True),
    ("1,000", "1000", True), ("1,234,567", "1234567", True), ("10000", "10{,}000", True), ("10,\\!000", "10000", True),
    ("1\\,000", "1000", True), ("1\\,000\\,000", "10^6", True),  # a thin space between digit groups
    ("\\$18.90", "18.90", True), ("\\$18.90", "\\$18.90", True), ("18.90", "\\$18.90", True), ("$5", "5", True),
    ("5 cm", "5", True), ("5\\text{ cm}", "5", True), ("12 dollars", "12", True), ("12 dollars", "\\$12", True),
    ("3.5 meters", "3.5", True), ("5^\\circ", "5", True),
    ("-3", "-3", True), ("−3", "-3", True), ("-3", "3", False), ("3", "-3", False),
    ("50\\%", "50", True), ("50%", "50\\%", True),
    ("x=3", "3", True), ("3.0", "3", True), ("4", "4.5", False), ("0.333", "1/3", False),
    ("3\\,x", "3x", True), ("2 x", "2", False), ("2 pi", "2", False),  # algebra, not units
])
def test_answer_normalisation(prediction, answer, expected):
    """Currency (\\$18.90 parsed to nothing, so even the reference equalled nothing), a thin space between digit
    groups (1\\,000 read as 1 * 0) and a unit in words ("12 dollars" read as 12 * d * o * l ...) were wrong."""
    assert is_equivalent(prediction, answer) is expected
    assert boxed_math_reward(["q"], [f"\\boxed{{{prediction}}}"], answer=[answer]) == [float(expected)]


@pytest.mark.parametrize("reward, completion", [
    (r1_zero_math_reward, "</think> <answer> 4 </answer>"), (boxed_math_reward, "\\boxed{4}"),
])
def test_a_list_of_reference_answers_accepts_any_of_them(reward, completion):
    """The course's grader takes a list of ground truths (correct when any matches); the list was read as the text
    "['3', '4']", whose first number alone could match."""
    assert reward(["q"], [completion], answer=[["3", "4"]]) == [1.0]
    assert reward(["q"], [completion], answer=[["4.5", "3"]]) == [0.0]
    with pytest.raises(ValueError, match=r"^answer: expected a reference answer, got \[\] \(empty\)"):
        reward(["q"], [completion], answer=[[]])
    with pytest.raises(ValueError, match=r"^answer: expected a reference answer, got \['4', None\] \(null\)"):
        reward(["q"], [completion], answer=[["4", None]])


@pytest.mark.parametrize("completion, answer, expected", [
    ("so \\boxed{3} and \\frac{1}{2}", "3", 1.0),
    ("so \\boxed 3 and \\frac{1}{2}", "1", 0.0),  # the brace of a later \frac was read as the box's: graded "1"
    ("so \\boxed 3 and \\frac{1}{2}", "3", 1.0),  # a brace-less box: its token, as MATH's graders read it
    ("the answer is $\\boxed 5$.", "5", 1.0), ("the answer is \\boxed 5.", "5", 1.0),
    ("\\boxed {7}", "7", 1.0),  # a space before the brace is still the box's
    ("\\boxedx {7}", "7", 0.0), ("\\boxed", "7", 0.0), ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
])
def test_the_box_graded_is_the_last_one_and_its_own_braces(completion, answer, expected):
    assert boxed_math_reward(["q"], [completion], answer=[answer]) == [expected]
