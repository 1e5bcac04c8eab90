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
