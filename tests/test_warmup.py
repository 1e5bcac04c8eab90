"""Warm-up of the built-in engine: EngineConfig.max_prompt_length (calls whose prompt lengths differ recompile
nothing).

Compiles are counted as dynamo frames through a counting backend (torch._dynamo.testing.CompileCounter, which runs
the traced graph as is): the trace and its guards decide what recompiles, not Inductor's code. The op's plain-torch
path runs (TRITON_INTERPRET unset) so that many steps stay cheap; the GPU tests at the end compile with Inductor and
count CUDA-graph captures too.
"""
import functools
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from fastgrpo.rollout import decode
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams
from tests.test_rollout import char_tokenizer, completions, tiny_model

# longest prompts of 3, 20 and 37 tokens: with length_bucket=16 three different per-call cache lengths
PROMPT_SETS = [["abc", "a"], ["hello world, hello you", "xyz"], ["the quick brown fox jumps over the lazy", "b"]]
FIXED = dict(attention="triton", max_prompt_length=40, length_bucket=16, compile=True)
PARAMS = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=20)


@pytest.fixture
def compiles(monkeypatch):
    """The engine's torch.compile through a CompileCounter backend; counts every dynamo frame it compiles."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    counter = CompileCounter()
    monkeypatch.setattr(decode, "_compiled", functools.cache(
        lambda fn: torch.compile(fn, backend=counter, dynamic=False)))
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


@pytest.fixture
def caches(monkeypatch):
    made = []

    class Recorded(decode.StaticKVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(decode, "StaticKVCache", Recorded)
    return made


def run(model, prompts, config, G=3, seed=7):
    return generate_with_config(model, char_tokenizer(), prompts, G, PARAMS, seed=seed, config=config)


@pytest.mark.parametrize("shared", [False, True])
def test_fixed_cache_compiles_the_step_once_across_prompt_lengths(compiles, caches, shared):
    model = tiny_model("qwen2")
    config = EngineConfig(**FIXED, shared_prefix=shared)
    counts = []
    for prompts in PROMPT_SETS:
        run(model, prompts, config)
        counts.append(compiles.frame_count)
    assert counts == [1, 1, 1]
    if shared:
        assert [c.prefix_len for c in caches] == [48, 48, 48] and all(c.max_len == 10 for c in caches)
    else:
        assert [c.max_len for c in caches] == [64, 64, 64]  # bucket(40 + 10)


def test_per_call_cache_recompiles_for_each_length_bucket(compiles):
    """The control: the same calls without max_prompt_length compile once per cache length (3)."""
    model = tiny_model("qwen2")
    config = EngineConfig(**{**FIXED, "max_prompt_length": None})
    for prompts in PROMPT_SETS:
        run(model, prompts, config)
    assert compiles.frame_count == 3


@pytest.mark.parametrize("shared", [False, True])
def test_fixed_cache_gives_the_per_call_cache_tokens(monkeypatch, shared):
    """Extra empty slots must change nothing: same sampled tokens and log-probs as a cache sized per call. (The
    kernel's reading of a cache longer than its filled length is tested in test_decode_attention.py.)"""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model("llama")
    base = dict(attention="triton", shared_prefix=shared, length_bucket=16)
    for prompts in PROMPT_SETS:
        got = run(model, prompts, EngineConfig(**base, max_prompt_length=40))
        want = run(model, prompts, EngineConfig(**base))
        assert completions(got) == completions(want)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


def test_prompt_longer_than_max_prompt_length_raises():
    with pytest.raises(ValueError, match="max_prompt_length"):
        run(tiny_model("qwen2"), PROMPT_SETS[2], EngineConfig(attention="triton", max_prompt_length=36))


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_prompt_length=64), "max_prompt_length"),  # sdpa: the larger cache would cost attention time
    (dict(attention="triton", max_prompt_length=0), "max_prompt_length"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.fixture
def graphed_steps(monkeypatch):
    """The engine's _GraphedStep objects, in creation order (one per call that compiles)."""
    made = []

    class Recorded(decode._GraphedStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.captures = 0
            made.append(self)

        def __call__(self):
            had = self.graph is not None
            super().__call__()
            self.captures += self.graph is not None and not had

    monkeypatch.setattr(decode, "_GraphedStep", Recorded)
    return made


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
def test_gpu_no_recompile_and_one_capture_per_call(graphed_steps, shared):
    """With Inductor and CUDA graphs: the first call compiles, calls with other prompt lengths compile nothing
    (dynamo's unique_graphs stays put), each call captures one CUDA graph and no call falls back; tokens equal those
    of the uncompiled engine with a cache sized per call."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_model("qwen2").cuda()
    config = EngineConfig(**{**FIXED, "compile": None}, shared_prefix=shared)
    graphs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for prompts in PROMPT_SETS:
            got = run(model, prompts, config)
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            # the reference sizes its cache per call: the kernel must ignore the fixed cache's extra slots
            eager = run(model, prompts, EngineConfig(**{**FIXED, "compile": False, "max_prompt_length": None},
                                                     shared_prefix=shared))
            assert completions(got) == completions(eager)
    fallbacks = [str(w.message) for w in caught if "rollout:" in str(w.message)]
    assert not fallbacks, fallbacks
    assert graphs == [1, 1, 1]
    assert [s.captures for s in graphed_steps] == [1, 1, 1]
    torch._dynamo.reset()
