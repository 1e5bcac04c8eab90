"""EngineConfig(shared_prefix=True): each prompt's K/V stored once per group, read once per group by the decode kernel.

The tokens and log-probs must be those of attention="triton" without sharing and of "sdpa": greedy and SAMPLED.
The sampling noise is keyed per (seed, step, prompt, sample) (rollout/sampling.py keyed_exponential), so the same
seed gives the same completions token for token whatever the cache layout, and the sampled tests assert exact
equality: stronger than comparing token frequencies over many draws, which would pass a small bias unnoticed.

The kernel tests run the Triton kernel under TRITON_INTERPRET=1 (conftest; ~0.4 s per layer and step here), so they
decode a few tokens. The longer runs (many steps, stop tokens and strings, the cache's size) check the engine's
wiring through the op's plain-torch path (TRITON_INTERPRET unset), which takes the same prefix arguments; the
kernel's prefix path is checked against that torch reference in tests/test_decode_attention.py.
"""
import pytest
import torch

from fastgrpo.rollout import attention, decode
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams
from tests.test_rollout import PROMPTS, char_tokenizer, completions, tiny_model

SHARED = EngineConfig(attention="triton", shared_prefix=True)
# prompts of 1, 5 and 11 tokens: odd lengths, up to 10 left pads
SHORT_PROMPTS = ["a", "xyz!?", "hello world"]


@pytest.fixture
def prefix_calls(monkeypatch):
    """Counts the decode_attention calls made with a shared prefix (proof that the shared path ran)."""
    calls = []
    op = attention.decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("prefix_k") is not None)
        return op(*args, **kwargs)

    monkeypatch.setattr(attention, "decode_attention", spy)
    return calls


def run(model, prompts, G, params, config, seed=3, **kwargs):
    return generate_with_config(model, char_tokenizer(), prompts, G, params, seed=seed, config=config, **kwargs)


def assert_same(got, want, what, atol=1e-5):
    assert completions(got) == completions(want), what
    assert got.finish_reasons == want.finish_reasons, what
    assert torch.equal(got.completion_mask, want.completion_mask), what
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=atol, rtol=0, msg=what)


# 4 tokens: 3 decode steps through the interpreted kernel per layer; the bucket of 16 leaves invisible slots at the
# end of the prefix (prompts of 25 and 11 tokens -> 32 and 16 slots) and makes the kernel split the keys. The
# unshared kernel runs in the first case only (it costs as much again; test_decode_attention compares it to sdpa).
@pytest.mark.parametrize("arch, G, temperature, prompts, baselines", [
    ("qwen2", 2, 0.0, PROMPTS, ("sdpa", "triton")),
    ("llama", 3, 1.0, SHORT_PROMPTS, ("sdpa",)),
    ("qwen2", 4, 1.0, SHORT_PROMPTS[1:], ("sdpa",)),
])
def test_kernel_matches_unshared_and_sdpa(arch, G, temperature, prompts, baselines, prefix_calls):
    model = tiny_model(arch)
    params = SamplingParams(max_new_tokens=4, temperature=temperature)
    out = {name: run(model, prompts, G, params, EngineConfig(attention=name, length_bucket=16)) for name in baselines}
    prefix_calls.clear()
    shared = run(model, prompts, G, params, EngineConfig(attention="triton", shared_prefix=True, length_bucket=16))
    assert prefix_calls and all(prefix_calls)
    for name, plain in out.items():
        assert_same(shared, plain, f"{arch} G{G} T{temperature}: shared vs {name}")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_long_sampled_rollout_through_the_torch_path(arch, monkeypatch, prefix_calls):
    """40 tokens (3 host syncs, suffixes past a 16-slot tile), repetition penalty and top-k (the seen-token set)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model(arch, seed=1)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, top_k=20, repetition_penalty=1.3)
    want = run(model, PROMPTS + SHORT_PROMPTS, 3, params, EngineConfig(attention="sdpa"))
    plain = run(model, PROMPTS + SHORT_PROMPTS, 3, params, EngineConfig(attention="triton"))
    assert not any(prefix_calls)
    got = run(model, PROMPTS + SHORT_PROMPTS, 3, params, SHARED)
    assert any(prefix_calls)
    assert_same(got, plain, f"{arch}: shared vs triton")
    assert_same(got, want, f"{arch}: shared vs sdpa")


def test_stops_end_rows_early(monkeypatch, prefix_calls):
    """Stop token ids (EOS among them) and stop strings end rows at different steps; all rows stopped ends the call."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model, tok = tiny_model("qwen2", seed=2), char_tokenizer()
    params = SamplingParams(max_new_tokens=64, temperature=1.0)
    stop = ["e", "o", *tok(" .,!?", add_special_tokens=False)["input_ids"]]
    out = {name: run(model, PROMPTS, 4, params, config, stop=stop)
           for name, config in (("sdpa", EngineConfig()), ("shared", SHARED))}
    assert any(prefix_calls)
    assert_same(out["shared"], out["sdpa"], "stops")
    assert out["shared"].texts == out["sdpa"].texts
    lengths = out["shared"].completion_mask.sum(1)
    assert all(reason == "stop" for reason in out["shared"].finish_reasons)
    assert len(set(lengths.tolist())) > 1 and out["shared"].completion_ids.shape[1] < params.max_new_tokens


def test_cache_holds_the_prompt_once_per_group(monkeypatch, caches):
    """Per layer, K and V each: B x bucket(P) prefix slots + N x S suffix slots (plain: N x bucket(P + S))."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model("qwen2")
    params = SamplingParams(max_new_tokens=10, temperature=0)
    B, G, P, S, bucket = len(PROMPTS), 4, max(map(len, PROMPTS)), 10, 16
    for config in (EngineConfig(attention="triton", length_bucket=bucket),
                   EngineConfig(attention="triton", shared_prefix=True, length_bucket=bucket)):
        run(model, PROMPTS, G, params, config)
    plain, shared = caches
    cfg = model.config
    per_slot = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    rounded = -(-(P + S) // bucket) * bucket, -(-P // bucket) * bucket
    assert plain.nbytes() == per_slot * B * G * rounded[0]
    assert shared.nbytes() == per_slot * (B * rounded[1] + B * G * S)
    assert shared.prefix_visible.sum(1).tolist() == [len(p) for p in PROMPTS]


@pytest.mark.parametrize("arch, G", [("qwen2_sliding", 2), ("mistral", 2), ("gemma2", 2), ("qwen2", 1)])
def test_falls_back_where_sharing_cannot_apply(arch, G, monkeypatch, prefix_calls, recwarn):
    """Sliding windows, eager attention (gemma2's soft-cap) and G = 1 keep per-row prompts, silently."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model(arch)
    params = SamplingParams(max_new_tokens=20, temperature=1.0)
    got = run(model, PROMPTS, G, params, SHARED)
    assert not any(prefix_calls)
    assert_same(got, run(model, PROMPTS, G, params, EngineConfig()), f"{arch} fallback")
    assert not [w for w in recwarn if "shared_prefix" in str(w.message)]


def test_foreign_attention_warns_and_falls_back(monkeypatch, prefix_calls):
    """rollout() called on a model whose attention is not the engine's: the prefix would be ignored, so no sharing."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model, tok = tiny_model("llama"), char_tokenizer()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_new_tokens=6, temperature=0)
    with pytest.warns(UserWarning, match="shared_prefix"):
        out = decode.rollout(model, prompts, 2, params, stop_ids=[], pad_id=0, keys=None, config=SHARED)
    assert not any(prefix_calls) and out.tokens.shape == (6, 6)


@pytest.mark.parametrize("kwargs", [dict(attention="sdpa", shared_prefix=True)])
def test_bad_options_raise(kwargs):
    with pytest.raises(ValueError, match="shared_prefix"):
        EngineConfig(**kwargs)


def test_prefix_without_the_kernel_is_an_error():
    """A one-token call with a prefix that the kernel cannot take (soft-cap) must not silently drop the prefix."""
    q, kv = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 5, 16)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    module = torch.nn.Module()
    module.layer_idx = 0
    with pytest.raises(NotImplementedError, match="shared prefix"):
        attention.grouped_sdpa(module, q, kv, kv, mask, softcap=30.0, **{
            attention.LENGTH_KWARG: torch.tensor([3]), attention.PREFIX_KWARG: object()})


def test_shared_step_compiles_to_one_graph(monkeypatch, caches):
    """The shared-prefix decode step traces whole (fullgraph: no host reads, no data-dependent Python branches) and
    once for all steps (static shapes: what a CUDA graph needs). Backend "eager": the trace is the point, not
    Inductor's code; torch path of the op (the GPU test of test_decode_attention compiles the kernel itself)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(decode._forward_sample, backend="eager", fullgraph=True, dynamic=False)
    monkeypatch.setattr(decode, "_compiled", {decode._forward_sample: step}.__getitem__)
    model = tiny_model("qwen2")
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    # no prefix_calls spy here: its list, appended to at each step, would itself make dynamo recompile
    config = EngineConfig(attention="triton", shared_prefix=True, compile=True, compile_scope="step")
    got = run(model, PROMPTS, 3, params, config)
    assert caches[0].shares_prefix and caches[0].prefix_keys
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert_same(got, run(model, PROMPTS, 3, params, SHARED), "compiled vs eager step")
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gpu_compiled_graphed_shared_prefix_gives_sdpa_tokens(arch):
    """On CUDA the step is compiled with Inductor and replayed as a CUDA graph: sharing must survive both, with no
    fallback warning, and give sdpa's sampled tokens."""
    import warnings

    model = tiny_model(arch).cuda()
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(model, PROMPTS + SHORT_PROMPTS, 4, params, SHARED)
        want = run(model, PROMPTS + SHORT_PROMPTS, 4, params, EngineConfig())
    fallbacks = [str(w.message) for w in caught if "rollout:" in str(w.message)]
    assert not fallbacks, fallbacks
    assert_same(got, want, f"{arch} gpu", atol=1e-4)
