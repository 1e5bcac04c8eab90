"""Verifiable reward functions f(prompts, completions, **dataset_columns) -> list[float], as in TRL."""
from fastgrpo.rewards.ifeval import CONSTRAINTS, check_constraint, ifeval_reward
from fastgrpo.rewards.length import length_reward
from fastgrpo.rewards.answers import boxed_math_reward, is_equivalent, r1_zero_math_reward
from fastgrpo.rewards.scoring import required_columns, score

# Names usable as `fastgrpo train --reward-funcs NAME`; anything else is read as "module:function".
REGISTRY = {
    "r1_zero_math": r1_zero_math_reward,
    "boxed_math": boxed_math_reward,
    "ifeval": ifeval_reward,
    "length": length_reward,
}

__all__ = [
    "CONSTRAINTS", "REGISTRY", "boxed_math_reward", "check_constraint", "ifeval_reward", "is_equivalent",
    "length_reward", "r1_zero_math_reward", "required_columns", "score",
]
