"""ifeval against its definitions, on rows as a Hugging Face dataset stores them."""
import pytest

from fastgrpo.rewards import check_constraint, ifeval_reward


def test_constraints_from_a_hugging_face_dataset():
    """datasets stores a column of constraint dicts as one struct: every constraint gets every key, None where unset,
    and every row failed with "bad arguments {'min': 1, 'keywords': None} for 'num_words'"."""
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_list([
        {"prompt": "a", "constraints": [{"type": "num_words", "min": 2}]},
        {"prompt": "b", "constraints": [{"type": "required_keywords", "keywords": ["cat"]}]},
    ])
    assert rows[0]["constraints"][0]["keywords"] is None  # what datasets does
    completions = ["the cat", "a dog"]
    assert ifeval_reward(rows["prompt"], completions, constraints=rows["constraints"]) == [1.0, 0.0]


@pytest.mark.parametrize("fence", ["```json", "```JSON", "```Json", "```"])
def test_json_output_inside_a_fence_of_any_case(fence):
    """IFEval strips ```json, ```Json and ```JSON fences; an upper-case tag was read as part of the JSON."""
    assert check_constraint(f'{fence}\n{{"a": 1}}\n```', {"type": "json_output"}) is True
