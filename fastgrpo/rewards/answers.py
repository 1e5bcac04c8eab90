"""Math rewards graded for mathematical equivalence with math-verify (it parses the LaTeX; _plain_number only
takes out what it misreads in reference answers: currency signs, thin spaces in numbers, units in words).

`r1_zero_math_reward`: the R1-Zero format `... </think> <answer> ... </answer>` with a correct answer scores 1. It
grades as the course's `r1_zero_reward_fn` (CS336's drgrpo_grader) does: the LAST `<answer>` block (a model that
corrects itself is graded on its correction), and inside it the last `\\boxed{...}` when there is one. Deliberate
differences: any whitespace between `</think>` and `<answer>` passes (the course's wants one space), and the last
block must be closed, with the text after `</answer>` ignored (the course's grades all of it).
`boxed_math_reward`: the last `\\boxed{...}` of the completion, graded against the `answer` column.
Both score 0.0 on anything they cannot read, so arbitrary model text never raises; a row without a reference answer
(null, or an empty string) is a ValueError: nothing could match it, and every completion would score 0 silently.
"""
from __future__ import annotations

import math
import re
import threading

from fastgrpo.rewards.completions import completion_texts

# Past this many characters an "answer" is degenerate model text; parsing it could take seconds of sympy.
MAX_ANSWER_CHARS = 1000
_R1_ZERO_FORMAT = re.compile(r"</think>\s*<answer>")
# "1\\,000": LaTeX's thin space between digit groups, which math-verify reads as a product (1 * 0)
_GROUP_SPACE = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")
# "12 dollars", "3.5 meters": a number and a unit in words (math-verify reads some as products of letters); one
# letter ("2 x") or pi is algebra, not a unit
_NUMBER_AND_UNIT = re.compile(r"(-?\d[\d,.]*)\s+(?!pi\b)[A-Za-z]{2,}(?:\s+[A-Za-z]{2,})*\.?")


def _timeout() -> int | None:
    # math-verify enforces timeouts with SIGALRM, which only the main thread may set.
    return 5 if threading.current_thread() is threading.main_thread() else None


def _plain_number(text: str) -> str:
    """`text` with what math-verify misreads in reference answers taken out: a currency sign (\\$18.90 parsed to
    nothing), a thin space between digit groups, a unit in words after a number."""
    text = _GROUP_SPACE.sub("", text.replace("\\$", ""))
    unit = _NUMBER_AND_UNIT.fullmatch(text.strip())
    return unit.group(1) if unit else text


def _parse(text: str) -> list:
    from math_verify import parse

    text = _plain_number(text)
    # An answer is one expression: read it whole as LaTeX math ("1 + x^2" plain would parse as its first number),
    # unless it carries its own delimiters or box.
    text = text.strip()
    wrapped = text if "$" in text or "\\boxed" in text else f"${text}$"
    return parse(wrapped, parsing_timeout=_timeout()) or parse(text, parsing_timeout=_timeout())


def _references(answer) -> list:
    """The reference answers of a row: a list of them (any one matching is correct, as in the course's grader), or
    one."""
    return list(answer) if isinstance(answer, (list, tuple)) else [answer]


def missing_answer(answer) -> str | None:
    """What makes a reference answer ungradable: "null" (None, or NaN as pandas reads an empty cell) or "empty" (a
    blank string, which parses to nothing, or an empty list); None for a gradable one (a number, a non-blank string,
    a list of gradable ones)."""
    if isinstance(answer, (list, tuple)):
        return next(filter(None, map(missing_answer, answer)), None) if answer else "empty"
    if answer is None or (isinstance(answer, float) and math.isnan(answer)):
        return "null"
    if isinstance(answer, str) and not answer.strip():
        return "empty"
    return None


def check_answer(answer) -> None:
    """A ValueError for an ungradable reference answer (missing_answer), before any grading."""
    problem = missing_answer(answer)
    if problem is not None:
        raise ValueError(f"answer: expected a reference answer, got {answer!r} ({problem}); math rewards need one "
                         "per row")


def is_equivalent(prediction: str, answer) -> bool:
    """True when `prediction` and the reference `answer` (or one of a list of them) are mathematically equal (both
    are plain or LaTeX); a null or empty `answer` is a ValueError (check_answer)."""
    from math_verify import verify

    check_answer(answer)
    if not prediction.strip() or len(prediction) > MAX_ANSWER_CHARS:
        return False
    try:
        pred = _parse(prediction)
        return bool(pred) and any(verify(gold, pred, timeout_seconds=_timeout())
                                  for gold in map(_parse, map(str, _references(answer))) if gold)
    except Exception:  # sympy can raise anything on adversarial text; unreadable means wrong
        return False


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces matched), or of a brace-less `\\boxed 5` (its token, up to a
    space or `$`, a sentence's final `.` or `,` dropped: the form MATH's graders read), or None. The brace must follow
    the box: one further on was read as its content (`\\boxed 3 and \\frac{1}{2}` graded "1")."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    rest = text[start + len("\\boxed"):]
    content = rest.lstrip()
    if not content.startswith("{"):
        tokens = content.split("$")[0].split() if rest[:1].isspace() else []  # not "\\boxedfoo"
        return (tokens[0].rstrip(".,") or None) if tokens else None
    depth = 0
    for j, char in enumerate(content):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return content[1:j]
    return None


def r1_zero_answer(completion: str) -> str | None:
    """What r1_zero grades: the content of the last `<answer>` block of a `... </think> <answer> ...` completion, or
    None when the completion lacks that format or its last block is not closed."""
    if _R1_ZERO_FORMAT.search(completion) is None:
        return None
    start = completion.rfind("<answer>") + len("<answer>")
    end = completion.find("</answer>", start)
    return None if end < 0 else completion[start:end]


def r1_zero_grades(completion: str, answer) -> tuple[float, float]:
    """(format_reward, answer_reward) of one completion: format 1.0 for `... </think> <answer> X </answer>`, answer
    1.0 when, in addition, X (its last \\boxed{} if it has one) equals `answer` (the course's r1_zero grading; its
    reward is the answer reward)."""
    check_answer(answer)  # whatever the completion: a row's error does not depend on what the model wrote
    graded = r1_zero_answer(completion)
    if graded is None:
        return 0.0, 0.0
    if "\\boxed" in graded:
        graded = last_boxed(graded)  # None: an unclosed box, formatted but wrong
    return 1.0, float(graded is not None and is_equivalent(graded, answer))


def r1_zero_math_reward(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 for `... </think> <answer> X </answer>` with X equal to `answer`, else 0.0 (format alone scores 0)."""
    return [r1_zero_grades(completion, gold)[1] for completion, gold in zip(completion_texts(completions), answer)]


def boxed_math_reward(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the last \\boxed{...} of the completion equals `answer`, else 0.0."""
    rewards = []
    for completion, gold in zip(completion_texts(completions), answer):
        check_answer(gold)
        boxed = last_boxed(completion)
        rewards.append(float(boxed is not None and is_equivalent(boxed, gold)))
    return rewards


# The columns each row must fill for these rewards, and the check of a value (fastgrpo.rewards.scoring.value_checks):
# a dataset with a null / empty answer is refused before anything is generated.
r1_zero_math_reward.value_checks = boxed_math_reward.value_checks = {"answer": missing_answer}
