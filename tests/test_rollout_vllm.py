"""The vLLM adapter's logic that runs without vllm: request translation and output conversion."""
from types import SimpleNamespace

import pytest
import torch

from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.rollout.vllm import generate_vllm, sampling_kwargs, to_result


def fake_completion(ids, logps, text, reason):
    return SimpleNamespace(
        token_ids=ids, logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, logps)], text=text,
        finish_reason=reason,
    )


def test_sampling_kwargs_carry_every_option():
    params = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, repetition_penalty=1.2)
    kw = sampling_kwargs(4, params, ["###"], [5], 11)
    assert kw == dict(
        n=4, max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, repetition_penalty=1.2, stop=["###"],
        stop_token_ids=[5], seed=11, logprobs=0, include_stop_str_in_output=True, skip_special_tokens=True,
    )
    with pytest.raises(ValueError, match="num_generations"):
        sampling_kwargs(0, params, [], [], None)
    with pytest.raises(ValueError, match="seed: expected an int or None"):
        sampling_kwargs(2, params, [], [], 1.5)


def test_to_result_groups_pads_and_masks():
    outputs = [
        SimpleNamespace(prompt_token_ids=[3, 4, 5], outputs=[
            fake_completion([7, 8], [-0.5, -1.0], "ab", "length"), fake_completion([9], [-2.0], "c", "stop")]),
        SimpleNamespace(prompt_token_ids=[6], outputs=[
            fake_completion([1, 2, 3], [-0.1, -0.2, -0.3], "xyz", "stop"), fake_completion([4], [-0.4], "w", "abort")]),
    ]
    r = to_result(outputs, pad_id=0, num_generations=2)
    assert r.prompt_ids.tolist() == [[3, 4, 5], [3, 4, 5], [0, 0, 6], [0, 0, 6]]
    assert r.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert r.completion_ids.tolist() == [[7, 8, 0], [9, 0, 0], [1, 2, 3], [4, 0, 0]]
    assert r.completion_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert torch.equal(r.logprobs, torch.tensor([[-0.5, -1.0, 0], [-2.0, 0, 0], [-0.1, -0.2, -0.3], [-0.4, 0, 0]]))
    assert r.texts == ["ab", "c", "xyz", "w"] and r.finish_reasons == ["length", "stop", "stop", "length"]
    with pytest.raises(ValueError, match="outputs"):
        to_result(outputs, pad_id=0, num_generations=3)


def test_generate_vllm_checks_arguments_before_touching_the_engine():
    class Tok:
        def __len__(self):
            return 10

    engine = SimpleNamespace(generate=lambda *a, **k: pytest.fail("engine called"))
    with pytest.raises(ValueError, match="unknown sampling option 'n'"):
        generate_vllm(engine, Tok(), [[1, 2]], n=2)
    with pytest.raises(ValueError, match="top_p"):
        generate_vllm(engine, Tok(), [[1, 2]], top_p=2.0)
    with pytest.raises(ValueError, match="prompts\\[0\\]"):
        generate_vllm(engine, Tok(), [[1, 20]])
