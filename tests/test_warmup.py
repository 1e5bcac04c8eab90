"""Warm-up of the built-in engine: EngineConfig.max_prompt_length (calls whose prompt lengths differ recompile
nothing) and EngineConfig.compile_scope="layers" (one decoder layer compiled once for all layers).

Compiles are counted as dynamo frames through a counting backend (torch._dynamo.testing.CompileCounter, which runs
the traced graph as is): the trace and its guards decide what recompiles, not Inductor's code. The op's plain-torch
path runs (TRITON_INTERPRET unset) so that many steps stay cheap; the GPU tests at the end compile with Inductor and
count CUDA-graph captures too.
"""
import functools
import warnings

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

import fastgrpo
from fastgrpo.rollout import decode
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.regional import layer_options
from fastgrpo.rollout.sampling import SamplingParams
from tests.test_rollout import SIZES, char_tokenizer, completions, tiny_model

# longest prompts of 3, 22 and 39 tokens: with length_bucket=16 three different per-call cache lengths (16, 32, 64)
PROMPT_SETS = [["abc", "a"], ["hello world, hello you", "xyz"], ["the quick brown fox jumps over the lazy", "b"]]
FIXED = dict(attention="triton", max_prompt_length=40, length_bucket=16, compile=True)
PARAMS = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=20)


def run(model, prompts, config, G=3, seed=7):
    return generate_with_config(model, char_tokenizer(), prompts, G, PARAMS, seed=seed, config=config)


LAYERS4 = {**SIZES, "num_hidden_layers": 4}
DEEP = {  # test_rollout's tiny models with 4 layers: one compiled layer must serve them all
    "qwen2": lambda: Qwen2Config(**LAYERS4),
    "llama": lambda: LlamaConfig(**LAYERS4),
    "qwen3": lambda: Qwen3Config(**LAYERS4, head_dim=16),
    # layer 0 full attention, layers 1-3 sliding
    "qwen2_sliding": lambda: Qwen2Config(**LAYERS4, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "mistral": lambda: MistralConfig(**LAYERS4, sliding_window=8),
    "gemma2": lambda: Gemma2Config(**LAYERS4, head_dim=16, sliding_window=8, attn_implementation="eager"),
    "gemma3": lambda: Gemma3TextConfig(**LAYERS4, head_dim=16, sliding_window=8),
    "phi3": lambda: Phi3Config(**LAYERS4, sliding_window=8),
}


def deep_model(arch="qwen2", lora=False, targets=("q_proj", "v_proj")):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DEEP[arch]())
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    return model.eval()


@pytest.mark.parametrize("shared, kv_cache", [(False, "model"), (True, "model"), (False, "fp8"), (True, "fp8")])
def test_fixed_cache_compiles_the_step_once_across_prompt_lengths(compiles, caches, shared, kv_cache):
    model = tiny_model("qwen2")
    config = EngineConfig(**FIXED, shared_prefix=shared, compile_scope="step", kv_cache=kv_cache)
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
    config = EngineConfig(**{**FIXED, "max_prompt_length": None}, compile_scope="step")
    for prompts in PROMPT_SETS:
        run(model, prompts, config)
    assert compiles.frame_count == 3


# rotary modules that HF updates by position (rollout/rope_step.py); the longrope threshold past every call's rows
ROPE_UPDATED = {
    "dynamic": lambda: LlamaConfig(**SIZES, rope_scaling=dict(rope_type="dynamic", factor=2.0)),
    "longrope": lambda: Phi3Config(**SIZES, original_max_position_embeddings=64, rope_scaling=dict(
        type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0] * 8)),
}


@pytest.mark.parametrize("rope", list(ROPE_UPDATED))
def test_rope_updated_by_position_compiles_the_step_once_across_calls(compiles, rope):
    """compile_scope="step" traces the rotary module. Without HF's update it is one frame (the dynamic update's
    host read broke the graph in two), and its forward, bound anew per call, is not guarded by identity (one
    recompile per call)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ROPE_UPDATED[rope]()).eval()
    config = EngineConfig(**FIXED, compile_scope="step")
    counts = []
    for prompts in PROMPT_SETS:
        run(model, prompts, config)
        counts.append(compiles.frame_count)
    assert counts == [1, 1, 1]


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


def test_prompt_longer_than_max_prompt_length_gets_its_own_cache(monkeypatch):
    """An evaluation's prompts are not cut to the trainer's max_prompt_length: a longer one decodes as without it.
    (The op's plain-torch path, as above: under the interpreter this was the CPU suite's slowest test.)"""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model("qwen2")
    # 16-slot buckets: a cache sized by max_prompt_length (8) would not hold the 39-token prompt
    base = dict(attention="triton", length_bucket=16)
    for shared in (False, True):
        got = run(model, PROMPT_SETS[2], EngineConfig(**base, shared_prefix=shared, max_prompt_length=8))
        want = run(model, PROMPT_SETS[2], EngineConfig(**base, shared_prefix=shared))
        assert completions(got) == completions(want)


@pytest.mark.parametrize("kwargs, match", [
    # sdpa: the larger cache would cost attention time
    (dict(attention="sdpa", max_prompt_length=64), "max_prompt_length"),
    (dict(attention="triton", max_prompt_length=0), "max_prompt_length"),
    (dict(compile_scope="model"), "compile_scope"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("arch, shared, lora, kv_cache", [
    ("qwen2", False, False, "model"), ("llama", True, False, "model"), ("qwen3", False, False, "model"),
    ("llama", False, True, "model"), ("qwen2", False, False, "fp8"), ("llama", True, False, "fp8")])
def test_layers_scope_compiles_one_layer_for_all_layers(compiles, arch, shared, lora, kv_cache):
    """4 layers, 3 calls of other prompt lengths: one frame for the layer, one for the sampling, nothing more;
    tokens and log-probs equal to the uncompiled engine's. fp8: the scales reach each layer on its LayerCache view."""
    model = deep_model(arch, lora)
    config = EngineConfig(**FIXED, shared_prefix=shared, compile_scope="layers", kv_cache=kv_cache)
    counts, got = [], []
    for prompts in PROMPT_SETS:
        got.append(run(model, prompts, config))
        counts.append(compiles.frame_count)
    assert counts == [2, 2, 2]
    for prompts, layered in zip(PROMPT_SETS, got):
        eager = run(model, prompts, EngineConfig(**{**FIXED, "compile": False}, shared_prefix=shared,
                                                 kv_cache=kv_cache))
        assert completions(layered) == completions(eager)
        torch.testing.assert_close(layered.logprobs, eager.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "phi3"])
def test_layers_scope_on_sdpa_attention_and_other_architectures(compiles, arch):
    """The default attention ("sdpa", which reads the whole cache), sliding windows, soft-capping (gemma2 stays on
    eager attention): still one frame for the layers and the engine's tokens."""
    model = deep_model(arch)
    got = run(model, PROMPT_SETS[1], EngineConfig(compile=True, compile_scope="layers"))
    assert compiles.frame_count == 2
    assert completions(got) == completions(run(model, PROMPT_SETS[1], EngineConfig(compile=False)))


def test_layers_scope_serves_sliding_and_full_layers_with_one_frame(compiles):
    """The window lives in each layer kind's mask (kv_cache.attention_masks), which the layer gets as an input; the
    engine's attention never reads the layer's own sliding_window, so both kinds share the compiled layer. Tokens
    equal eager's: each layer still gets its kind's mask."""
    model = deep_model("qwen2_sliding")
    config = EngineConfig(**{**FIXED, "length_bucket": 128}, compile_scope="layers")
    got = run(model, PROMPT_SETS[1], config)
    assert compiles.frame_count == 2
    eager = run(model, PROMPT_SETS[1], EngineConfig(**{**FIXED, "length_bucket": 128, "compile": False}))
    assert completions(got) == completions(eager)


@pytest.mark.parametrize("offload", [False, True])
def test_layers_scope_compiles_one_layer_of_a_patched_model(compiles, offload):
    """patch_model binds forwards on every norm, MLP, attention and LoRA linear (and, with offload, on the layers):
    dynamo would trace each layer apart (it guards an instance's forward by identity); still one frame for all."""
    model = fastgrpo.patch_model(deep_model("llama", lora=True), offload_activations=offload)
    got = run(model, PROMPT_SETS[1], EngineConfig(**FIXED, compile_scope="layers"))
    assert compiles.frame_count == 2
    eager = run(model, PROMPT_SETS[1], EngineConfig(**{**FIXED, "compile": False}))
    assert completions(got) == completions(eager)
    torch.testing.assert_close(got.logprobs, eager.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), "all-linear"])
def test_layers_scope_with_a_dense_lora_copy_compiles_one_layer(compiles, targets):
    """What a LoRA model decodes with on a GPU by default (weights 'auto' -> 'fused' or 'dense' when it fits): the copy swaps
    each linear's class, the same for every layer, so one layer frame still serves them all; with every linear
    adapted, q/k/v and gate/up run fused (each member holds its siblings and hands them their outputs), still
    one frame."""
    model = fastgrpo.patch_model(deep_model("llama", lora=True, targets=targets))
    got = run(model, PROMPT_SETS[1], EngineConfig(**FIXED, compile_scope="layers", weights="dense"))
    assert compiles.frame_count == 2
    eager = run(model, PROMPT_SETS[1], EngineConfig(**{**FIXED, "compile": False}, weights="dense"))
    assert completions(got) == completions(eager)


@pytest.mark.parametrize("weights", ["fp8", "w8a8"])
def test_layers_scope_with_an_fp8_copy_compiles_one_layer(compiles, weights):
    """The FP8 copies ("w8a8": each linear quantizes its input and calls _scaled_mm, lm_head its fp8_linear
    fallback) keep one frame for the layers across calls of three prompt lengths; tokens and log-probs equal the
    uncompiled engine's with the same copy."""
    model = deep_model("qwen2")
    config = EngineConfig(**FIXED, compile_scope="layers", weights=weights)
    for prompts in PROMPT_SETS:
        got = run(model, prompts, config)
        assert compiles.frame_count == 2
    eager = run(model, PROMPT_SETS[-1], EngineConfig(**{**FIXED, "compile": False}, weights=weights))
    assert completions(got) == completions(eager)
    torch.testing.assert_close(got.logprobs, eager.logprobs, atol=1e-5, rtol=0)


def test_layers_scope_leaves_the_model_as_it_was(compiles):
    """The compiled forwards are bound for a step only: afterwards (and for the prefill) every module has the
    forward it had (patch_model's included), and a training forward matches an untouched copy's."""
    model, twin = deep_model("llama"), deep_model("llama")
    fastgrpo.patch_model(model, fused_loss=False), fastgrpo.patch_model(twin, fused_loss=False)
    before = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
    run(model, PROMPT_SETS[0], EngineConfig(**FIXED, compile_scope="layers"))
    assert {name: module.__dict__.get("forward") for name, module in model.named_modules()} == before
    assert any(forward is not None for forward in before.values())
    ids = torch.randint(3, SIZES["vocab_size"], (2, 9))
    torch.testing.assert_close(model(input_ids=ids).logits, twin(input_ids=ids).logits, atol=0, rtol=0)


def test_layer_options_are_inductor_options():
    """The tests' counting backends drop the layer compile's Inductor options, so this checks them: torch.compile
    with Inductor accepts every engine's layer options (an unknown name raises at that call, before any compile)."""
    torch._dynamo.reset()
    for weights in ("model", "w8a8"):
        decode._compiled.__wrapped__(lambda x: x + 1, layer_options(weights))
    with pytest.raises(RuntimeError, match="not_an_option"):
        decode._compiled.__wrapped__(lambda x: x + 1, (("not_an_option", False),))


def test_layers_scope_through_aot_autograd(monkeypatch):
    """aot_eager functionalizes the layer (the cache writes become mutations of graph inputs, as under Inductor):
    the layer views' in-place writes must reach the cache."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(decode, "_compiled", functools.cache(
        lambda fn, options=(): torch.compile(fn, backend="aot_eager", dynamic=False)))
    torch._dynamo.reset()
    model = deep_model("qwen2")
    got = run(model, PROMPT_SETS[1], EngineConfig(**FIXED, compile_scope="layers"))
    eager = run(model, PROMPT_SETS[1], EngineConfig(**{**FIXED, "compile": False}))
    assert completions(got) == completions(eager)
    torch._dynamo.reset()


def test_layers_scope_falls_back_to_the_step_for_an_unknown_model(compiles, monkeypatch):
    monkeypatch.setattr(decode, "layer_indices", lambda model: None)
    with pytest.warns(UserWarning, match="compile_scope='layers'"):
        run(tiny_model("qwen2"), PROMPT_SETS[0], EngineConfig(**FIXED, compile_scope="layers"))
    assert compiles.frame_count == 1


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
@pytest.mark.parametrize("scope, shared, patched, kv_cache", [
    ("step", False, False, "model"), ("step", True, False, "model"), ("layers", False, False, "model"),
    ("layers", True, False, "model"), ("layers", False, True, "model"),
    ("step", False, False, "fp8"), ("layers", False, False, "fp8"), ("layers", True, True, "fp8")])
# patched: patch_model's Triton kernels and fused LoRA inside the compiled layer
def test_gpu_no_recompile_and_one_capture_per_call(graphed_steps, scope, shared, patched, kv_cache):
    """With Inductor and CUDA graphs: the first call compiles, calls with other prompt lengths compile nothing
    (dynamo's unique_graphs stays put), each call captures one CUDA graph and no call falls back; tokens equal those
    of the uncompiled engine with a cache sized per call."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = fastgrpo.patch_model(deep_model("llama", lora=True)) if patched else deep_model("qwen2")
    model = model.cuda()
    config = EngineConfig(**{**FIXED, "compile": None}, shared_prefix=shared, compile_scope=scope, kv_cache=kv_cache)
    graphs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for prompts in PROMPT_SETS:
            got = run(model, prompts, config)
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            # the reference sizes its cache per call: the kernel must ignore the fixed cache's extra slots
            eager = run(model, prompts, EngineConfig(**{**FIXED, "compile": False, "max_prompt_length": None},
                                                     shared_prefix=shared, kv_cache=kv_cache))
            assert completions(got) == completions(eager)
    fallbacks = [str(w.message) for w in caught if "rollout:" in str(w.message)]
    assert not fallbacks, fallbacks
    assert graphs == [2 if scope == "layers" else 1] * 3
    assert [s.captures for s in graphed_steps] == [1, 1, 1]
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["fp8", "w8a8"])
def test_gpu_fp8_copy_compiles_one_layer_and_captures_once_per_call(graphed_steps, weights):
    """Inductor and CUDA graphs over a bf16 model's FP8 copy ("w8a8": the activations' quantizer fused by Inductor,
    _scaled_mm, lm_head's Triton fp8_linear in the same graph): one layer frame and the sampling for all three
    calls, one capture per call, no fallback to eager."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = deep_model("llama").cuda().bfloat16()
    config = EngineConfig(**{**FIXED, "compile": None}, compile_scope="layers", weights=weights)
    graphs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for prompts in PROMPT_SETS:
            got = run(model, prompts, config)
            assert torch.isfinite(got.logprobs).all()
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    fallbacks = [str(w.message) for w in caught if "rollout:" in str(w.message)]
    assert not fallbacks, fallbacks
    assert graphs == [2, 2, 2]
    assert [s.captures for s in graphed_steps] == [1, 1, 1]
    torch._dynamo.reset()
