"""EngineConfig(shared_prefix=True): each prompt's K/V stored once per group, read once per group by the decode kernel.

The tokens and log-probs must be those of attention="triton" without sharing and of "sdpa": greedy and SAMPLED.
The sampling noise is keyed per (seed, step, prompt, sample) (rollout/sampling.py keyed_exponential), so the same
seed gives the same completions token for token whatever the cache layout, and the sampled tests assert exact
equality with the unshared engine. Equality does not show that either samples from the model: a statistical test
(test_samples_follow_the_models_conditionals) compares the shared path's draws with the model's own fp64
conditional probabilities, and fails on one hidden prompt slot (test_uniformity_test_sees_a_hidden_prompt_slot).

The kernel tests run the Triton kernel under TRITON_INTERPRET=1 (conftest; ~0.4 s per layer and step here), so they
decode a few tokens. The longer runs (many steps, stop tokens and strings, the cache's size) check the engine's
wiring through the op's plain-torch path (TRITON_INTERPRET unset), which takes the same prefix arguments; the
kernel's prefix path is checked against that torch reference in tests/test_decode_attention.py.
"""
import copy
import math

import pytest
import torch
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

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


# Kolmogorov-Smirnov at false-alarm rate ALPHA. Dvoretzky-Kiefer-Wolfowitz with Massart's constant: for n i.i.d.
# U(0, 1) draws, P(sqrt(n) D_n > c) <= 2 exp(-2 c^2) for every n, so c = sqrt(ln(2 / ALPHA) / 2) = 2.225.
ALPHA = 1e-4
KS_CRITICAL = math.sqrt(math.log(2 / ALPHA) / 2)


def sharp_model(arch: str) -> torch.nn.Module:
    """tiny_model with its matrices scaled by 10. At the default init the next-token distribution is nearly uniform
    (entropy 3.77 of log 44 = 3.78 nats) and barely depends on the context, so no sampling test could see a wrong
    context; scaled, the entropy is 2.6-2.8 nats and the attention is sharp."""
    model = tiny_model(arch)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    return model


def ks_of_pit(model, result, params: SamplingParams, G: int) -> tuple[float, int, torch.Tensor]:
    """sqrt(n) D_n of the randomized probability integral transform of every token the engine sampled in a decode
    step (completion index >= 1; index 0 comes from the prefill), and the reference probabilities of those tokens.

    The reference is HF's own forward in fp64 on prompt + the row's earlier tokens, filtered by HF's warpers in
    HF's order (temperature, top-k, top-p). With the tokens sorted by falling reference probability, u = F(x-) +
    V p(x), V ~ U(0, 1), is U(0, 1) given the row's history when x is drawn from p, so (Rosenblatt) the u's of a
    row are i.i.d. U(0, 1) and, the noise being keyed per sample, so are all rows' together. Sorting makes the
    statistic sensitive to draws from the wrong context: they land on tokens the reference finds unlikely (u near 1);
    in token-id order, dropping the whole prefix gave only 1.9 (n = 1,839), under the threshold.
    """
    reference = copy.deepcopy(model).double()
    warpers = LogitsProcessorList()
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    uniform = torch.Generator().manual_seed(0)
    u, p_sampled = [], []
    for first in range(0, result.completion_ids.shape[0], G):
        prompt = result.prompt_ids[first][result.prompt_mask[first].bool()]
        tokens = result.completion_ids[first: first + G]  # [G, L], pads after a stop: causal, so never read
        with torch.no_grad():
            logits = reference(torch.cat([prompt.expand(G, -1), tokens], 1)).logits[:, len(prompt) - 1: -1]
        V = logits.shape[-1]
        probs = warpers(None, logits.reshape(-1, V)).softmax(-1).reshape(logits.shape)  # [G, L, V]
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
        ranked = probs.gather(-1, order)
        below = torch.empty_like(probs).scatter_(-1, order, ranked.cumsum(-1) - ranked)  # F(x-) per token id
        p = probs.gather(-1, tokens[..., None])[..., 0]
        draws = below.gather(-1, tokens[..., None])[..., 0] + torch.rand(p.shape, generator=uniform,
                                                                         dtype=torch.float64) * p
        decoded = result.completion_mask[first: first + G].bool()
        decoded[:, 0] = False
        u.append(draws[decoded])
        p_sampled.append(p[decoded])
    u = torch.cat(u).sort().values
    n = len(u)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    D = max((i / n - u).max().item(), (u - (i - 1) / n).max().item())
    return math.sqrt(n) * D, n, torch.cat(p_sampled)


# 6 prompts x 256 samples x 5 decoded tokens: n ~ 7,000 draws, ~1 s each case
@pytest.mark.parametrize("arch, params", [
    ("qwen2", SamplingParams(max_new_tokens=6, temperature=1.0)),
    ("llama", SamplingParams(max_new_tokens=6, temperature=0.8, top_k=12, top_p=0.9)),
])
def test_samples_follow_the_models_conditionals(arch, params, monkeypatch, prefix_calls):
    """Each decode step's token is a draw from the model's exact conditional distribution (KS at ALPHA = 1e-4 on
    the randomized PIT). Measured: sqrt(n) D = 0.71 (qwen2, n = 7,456), 0.85 (llama, n = 6,872); threshold 2.225."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model, G = sharp_model(arch), 256
    result = run(model, PROMPTS + SHORT_PROMPTS, G, params, SHARED, seed=0)
    assert prefix_calls and all(prefix_calls)
    stat, n, p_sampled = ks_of_pit(model, result, params, G)
    assert n > 6000
    assert torch.all(p_sampled > 0), "sampled a token the filters remove"
    assert stat < KS_CRITICAL, f"{arch}: sqrt(n) D = {stat:.3f} >= {KS_CRITICAL:.3f} (alpha {ALPHA}, n {n})"


def test_uniformity_test_sees_a_hidden_prompt_slot(monkeypatch):
    """The test above can fail: hiding each prompt's last token from the decode attention (one slot of up to 25)
    gives sqrt(n) D = 9.2, four times the threshold. Measured the same way: the whole prefix dropped 34, sampling at
    temperature 1.1 instead of 1.0 5.1 (qwen2, temperature 1)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    op = attention.decode_attention

    def hide_last_prompt_slot(*args, prefix_visible=None, **kwargs):
        visible = prefix_visible.clone()
        last = visible.shape[1] - 1 - visible.flip(1).int().argmax(1)  # left padding: the prompt ends there
        visible[torch.arange(len(visible)), last] = False
        return op(*args, prefix_visible=visible, **kwargs)

    monkeypatch.setattr(attention, "decode_attention", hide_last_prompt_slot)
    model, G = sharp_model("qwen2"), 256
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    stat, n, _ = ks_of_pit(model, run(model, PROMPTS + SHORT_PROMPTS, G, params, SHARED, seed=0), params, G)
    assert stat > 2 * KS_CRITICAL, f"sqrt(n) D = {stat:.3f}, threshold {KS_CRITICAL:.3f} (n {n})"


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
            attention.LENGTH_KWARG: torch.tensor([3]), attention.CACHE_KWARG: object()})


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
