"""EngineConfig(weights="fp8" | "dense" | "fused"): the decode steps multiply a copy of the model's current weights,
e4m3 or in the model's dtype, with q/k/v and gate/up stacked where every member is copied.

Checked here: every dense linear (lm_head, LoRA layers merged, a 4-bit base dequantized once per rollout) runs
fp8_linear over quantize_fp8 of its effective weight inside the context and its own forward after; on weights
already on the fp8 grid the FP8 engine gives the model engine's tokens and log-probs; the trainer's parameters,
grads and patched forwards come back untouched; the compiled step is traced once for all FP8 rollouts (the
forwards installed are kept per module, so torch.compile's identity guards hold); the engine's log-probs go
through the gap measure and the rollout importance-sampling correction into the loss.

The engine runs use the op's plain-torch path (TRITON_INTERPRET unset: the interpreter takes ~0.1 s per linear and
step); the kernel is checked against that reference in tests/test_fp8_linear.py.
"""
import copy
import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import fastgrpo
from fastgrpo.hf.peft import dense_linears, dense_weight
from fastgrpo.loss.correction import logprob_gap, rollout_correction
from fastgrpo.loss.model import sequence_logprobs
from fastgrpo.ops.fp8_linear import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8
from fastgrpo.rollout import decode, decode_weights
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams
from tests.test_rollout import PROMPTS, SIZES, char_tokenizer, completions, tiny_model

FP8 = EngineConfig(weights="fp8")
LAYERS = SIZES["num_hidden_layers"]


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """Every op on its plain-torch path (quick on the CPU). Not by unsetting TRITON_INTERPRET: a model built while
    it is unset left the interpreter unable to run Triton's own jit helpers (tl.cdiv) in later tests."""
    for name, module in list(sys.modules.items()):
        if name.startswith("fastgrpo.ops.") and hasattr(module, "use_triton"):
            monkeypatch.setattr(module, "use_triton", lambda *tensors: False)


def run(model, config, params=SamplingParams(max_new_tokens=20, temperature=0), G=2, seed=3):
    return generate_with_config(model, char_tokenizer(), PROMPTS, G, params, seed=seed, config=config)


def on_fp8_grid(model):
    """Move every dense linear's weight onto the e4m3 grid with power-of-two row scales and a +-448 in each row,
    so that quantize_fp8 gives it back exactly (tests/test_fp8_linear.py: test_quantizer_keeps_fp8_weights)."""
    with torch.no_grad():
        for module in dense_linears(model):
            w = module.weight
            scale = 2.0 ** torch.ceil(torch.log2(w.abs().amax(1) / FP8_MAX))
            q = (w / scale[:, None]).to(FP8_DTYPE)
            q[:, 0] = FP8_MAX
            w.copy_(dequantize_fp8(q, scale))
    return model


def fake_quantized(module):
    """What one dense linear computes from its FP8 copy, in plain torch: F.linear with the dequantized weight."""
    weight, bias = dense_weight(module)
    q, scale = quantize_fp8(weight)
    return lambda x: F.linear(x, dequantize_fp8(q, scale, x.dtype), bias)


def test_weights_option_is_checked():
    with pytest.raises(ValueError, match="weights"):
        EngineConfig(weights="int4")


@pytest.mark.parametrize("lora", [False, True])
def test_auto_keeps_the_model_weights_on_the_cpu(lora):
    model = tiny_model("llama", lora=lora)
    assert decode_weights.resolved_weights(model, "auto") == "model"
    assert decode_weights.resolved_weights(model, "dense") == "dense"


def test_dense_copy_keeps_each_layer_dtype_and_counts_only_lora_and_4bit():
    """A plain layer in another dtype than the embedding (an fp32 lm_head) is no reason for a copy, and its dense
    'copy' is its own weight, dtype kept: a cast to the embedding's dtype would break its fp32 input."""
    model = tiny_model("llama").bfloat16()
    model.lm_head.float()
    assert decode_weights.copy_bytes(model, "dense") == 0
    with decode_weights.copied_weights(model, "dense"):
        copy = model.lm_head.fastgrpo_copy_weight
        assert copy.dtype == torch.float32 and copy.data_ptr() == model.lm_head.weight.data_ptr()
    lora = tiny_model("llama", lora=True)
    H = SIZES["hidden_size"]
    kv = H // SIZES["num_attention_heads"] * SIZES["num_key_value_heads"]
    assert decode_weights.copy_bytes(lora, "dense") == LAYERS * (H + kv) * H * 4  # q_proj, v_proj; an fp32 model


def test_auto_copies_only_what_exists_and_fits():
    headroom = decode_weights.AUTO_HEADROOM_BYTES
    assert not decode_weights.copy_fits(0, 10 * headroom)  # a plain bf16 model's dense copy: nothing to copy
    assert decode_weights.copy_fits(headroom, 2 * headroom)
    assert not decode_weights.copy_fits(headroom + 1, 2 * headroom)
    assert decode_weights.copy_fits(headroom // 2, 2 * headroom, build=headroom // 2)
    assert not decode_weights.copy_fits(headroom // 2, 2 * headroom, build=headroom // 2 + 1)


def test_building_a_copy_needs_room_for_its_largest_merged_layer():
    """Plain weights are stacked as they are (no temporaries); a LoRA layer's merge holds its base, the delta and
    their fp32 sum: the largest adapted layer (q_proj: H x H here) times BUILD_BYTES_PER_WEIGHT."""
    assert decode_weights.build_bytes(tiny_model("llama")) == 0
    H = SIZES["hidden_size"]
    assert decode_weights.build_bytes(tiny_model("llama", lora=True)) == H * H * decode_weights.BUILD_BYTES_PER_WEIGHT


@pytest.mark.parametrize("lora", [False, True])
def test_auto_takes_the_fused_copy_then_the_dense_one_as_memory_allows(lora):
    """With q and v adapted, "fused" copies k and gate/up on top of "dense"'s q and v; a plain model has no dense
    copy to fall back on. Each needs the room to build it too."""
    model = tiny_model("llama", lora=lora)
    fused, dense = (decode_weights.copy_bytes(model, kind) for kind in ("fused", "dense"))
    assert fused > dense and (dense > 0) == lora
    extra = decode_weights.AUTO_HEADROOM_BYTES + decode_weights.build_bytes(model)
    assert decode_weights.auto_weights(model, fused + extra) == "fused"
    assert decode_weights.auto_weights(model, fused + extra - 1) == ("dense" if lora else "model")
    assert decode_weights.auto_weights(model, dense + extra - 1) == "model"


def test_auto_decodes_from_the_model_when_building_its_copy_runs_out_of_memory(monkeypatch):
    """The copy "auto" chose fails to build (the third layer copied raises the allocator's error): the rollout goes
    on with the model's own weights, a warning says so, and no module keeps a swapped class or a copy attribute."""
    model = tiny_model("llama", lora=True)
    classes = {name: type(m) for name, m in model.named_modules()}
    copy_layer, calls = decode_weights._copy, []

    def out_of_memory_on_the_third(*args):
        calls.append(args[0])
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 224.00 MiB")
        return copy_layer(*args)

    monkeypatch.setattr(decode_weights, "_copy", out_of_memory_on_the_third)
    name, q_proj = next((n, m) for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
    x = torch.randn(2, 3, SIZES["hidden_size"])
    want = q_proj(x)
    with pytest.warns(UserWarning, match="ran out of device memory"):
        with decode_weights._copy_or_fallback(model, "dense") as modules:
            assert modules == []
            assert {name: type(m) for name, m in model.named_modules()} == classes
            torch.testing.assert_close(q_proj(x), want, rtol=0, atol=0)
    assert len(calls) == 3
    assert not [n for n, m in model.named_modules() if any(a.startswith("fastgrpo_") for a in vars(m))]
    monkeypatch.setattr(decode_weights, "_copy", copy_layer)
    with decode_weights._copy_or_fallback(model, "dense") as modules:  # with the memory there, the copy is made
        assert modules and type(q_proj) is not classes[name]


def test_auto_falls_back_from_the_fused_copy_to_the_dense_one(monkeypatch):
    """Through decode_weights(model, "auto"): "fused" (k and gate/up stacked too) fails to build, so the smaller
    "dense" copy (the adapted q and v) is made, with a warning; only then would the model's weights be used."""
    model = tiny_model("llama", lora=True)
    copy_layer = decode_weights._copy

    def fused_runs_out_of_memory(module, kind, dtype):
        if kind == "fused":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 224.00 MiB")
        return copy_layer(module, kind, dtype)

    monkeypatch.setattr(decode_weights, "_copy", fused_runs_out_of_memory)
    monkeypatch.setattr(decode_weights, "resolved_weights", lambda model, weights: "fused")
    with pytest.warns(UserWarning, match="took 'fused'.*decoding with 'dense'"):
        with decode_weights.decode_weights(model, "auto") as modules:
            kinds = {getattr(m, "fastgrpo_copy_kind", None) for m in modules}
            assert kinds == {"dense"} and hasattr(modules[0], "fastgrpo_copy_weight")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp8_engine_equals_the_model_on_fp8_grid_weights(arch):
    """Weights the copy holds exactly: the FP8 engine decodes as the model does (greedy and sampled), while on
    the model's own (off-grid) weights its log-probs move: the decode steps did use the copy."""
    model = tiny_model(arch)
    off_grid = run(model, FP8)
    assert (off_grid.logprobs - run(model, EngineConfig()).logprobs).abs().max() > 1e-3
    on_fp8_grid(model)
    sampled = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=10)
    for params in (SamplingParams(max_new_tokens=20, temperature=0), sampled):
        got, want = run(model, FP8, params), run(model, EngineConfig(), params)
        assert completions(got) == completions(want)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lora", [False, True])
def test_every_dense_linear_runs_its_fp8_copy(lora):
    """Inside copied_weights("fp8") each dense linear (7 per layer and lm_head; a LoRA layer counts once, its adapters
    merged) computes F.linear with its dequantized copy; outside, the module's own forward, bit for bit."""
    model = tiny_model("llama", lora=lora)
    modules = dense_linears(model)
    assert len(modules) == 7 * LAYERS + 1
    assert sum(hasattr(m, "base_layer") for m in modules) == (2 * LAYERS if lora else 0)  # q_proj, v_proj
    g = torch.Generator().manual_seed(0)
    inputs = {m: torch.randn(3, 1, m.in_features, generator=g) for m in modules}
    with torch.no_grad():
        before = {m: m(inputs[m]) for m in modules}
        expected = {m: fake_quantized(m)(inputs[m]) for m in modules}
        with decode_weights.copied_weights(model, "fp8") as swapped:
            assert swapped == modules
            for m in modules:
                torch.testing.assert_close(m(inputs[m]), expected[m], atol=1e-6, rtol=1e-6)
        for m in modules:
            assert torch.equal(m(inputs[m]), before[m]) and "forward" not in m.__dict__


def test_lora_merge_equals_peft_merge():
    model = tiny_model("qwen2", lora=True)
    merged = copy.deepcopy(model).merge_and_unload()
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "base_layer"):
            want = merged.get_submodule(name).weight
            torch.testing.assert_close(dense_weight(module)[0], want, atol=1e-6, rtol=1e-6)
    with model.disable_adapter():
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        assert dense_weight(layer)[0].data_ptr() == layer.base_layer.weight.data_ptr()  # the base, no copy


def test_trainer_state_is_untouched():
    """Parameters and grads bit for bit, and patch_model's bound forwards (fused LoRA, ...) are back in place."""
    model = fastgrpo.patch_model(tiny_model("llama", lora=True))
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    params = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    before = {id(m): (type(m), dict(m.__dict__)) for m in model.modules()}
    assert sum("forward" in d for _, d in before.values()) > 0  # patch_model's bound forwards
    run(model, FP8)
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n][0]) and torch.equal(p.grad, params[n][1]), n
    assert {id(m): (type(m), dict(m.__dict__)) for m in model.modules()} == before


@pytest.mark.parametrize("kind", ["fp8", "w8a8"])
def test_compiled_step_traces_once_for_all_fp8_rollouts(monkeypatch, kind):
    """Two FP8 rollouts and a model rollout: two graphs (FP8 and model), not one per rollout. fullgraph: the FP8
    forwards trace whole ("w8a8": the activations' quantizer and _scaled_mm, lm_head's fp8_linear). Backend
    "eager": the trace is the point (test_shared_prefix does the same)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(decode._forward_sample, backend="eager", fullgraph=True, dynamic=False)
    monkeypatch.setattr(decode, "_compiled", {decode._forward_sample: step}.__getitem__)
    model = tiny_model("qwen2")
    compiled_fp8 = EngineConfig(weights=kind, compile=True, compile_scope="step")
    first = run(model, compiled_fp8)
    with torch.no_grad():  # a training step changes the weights in place between rollouts
        model.lm_head.weight.mul_(1.5)
    second = run(model, compiled_fp8)
    run(model, EngineConfig(compile=True, compile_scope="step"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert not torch.equal(first.logprobs, second.logprobs)  # the second copy was built from the new weights
    torch.testing.assert_close(second.logprobs, run(model, EngineConfig(weights=kind)).logprobs, atol=1e-5, rtol=0)
    torch._dynamo.reset()


def test_dense_copy_merges_lora_and_copies_only_what_it_must():
    """weights="dense": the LoRA layers' merged weights are the only copy (plain weights are used as they are), and
    the engine decodes as the model does (one GEMM instead of base + adapter: fp32 rounding apart)."""
    model = tiny_model("llama", lora=True)
    H = SIZES["hidden_size"]
    kv = H // SIZES["num_attention_heads"] * SIZES["num_key_value_heads"]
    assert decode_weights.copy_bytes(model, "dense") == LAYERS * (H * H + kv * H) * 4  # q_proj, v_proj in fp32
    assert decode_weights.copy_bytes(tiny_model("llama"), "dense") == 0
    with decode_weights.copied_weights(model, "dense") as modules:
        plain = [m for m in modules if not hasattr(m, "base_layer")]
        assert all(m.fastgrpo_copy_weight.data_ptr() == m.weight.data_ptr() for m in plain)
    sampled = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=10)
    for params in (SamplingParams(max_new_tokens=20, temperature=0), sampled):
        got, want = run(model, EngineConfig(weights="dense"), params), run(model, EngineConfig(), params)
        assert completions(got) == completions(want)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


def siblings(model):
    """Each layer's (q, k, v) and (gate, up) modules: the groups the copy fuses on llama-like models."""
    layers = model.get_base_model().model.layers if hasattr(model, "get_base_model") else model.model.layers
    return {g for layer in layers for g in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                                             (layer.mlp.gate_proj, layer.mlp.up_proj))}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "phi3"])
def test_fp8_fuses_q_k_v_and_gate_up_of_every_layer(arch):
    """"fp8" copies every linear, so every group of siblings is fused; Phi-3 stores q/k/v and gate/up stacked
    already: nothing to fuse."""
    model = tiny_model(arch)
    groups = decode_weights.fused_groups(model, dense_linears(model), "fp8")
    assert groups == [] if arch == "phi3" else set(groups) == siblings(model) and len(groups) == 2 * LAYERS


def test_dense_fuses_only_groups_it_copies_anyway():
    """"dense" copies LoRA layers only: with q and v adapted, k would need a copy of its own (memory the copy does
    not take), so nothing is fused; with every linear adapted, every group is, at the same copy bytes."""
    for targets, fused in ((("q_proj", "v_proj"), set()), ("all-linear", None)):
        model = tiny_model("llama", lora=True, targets=targets)
        groups = decode_weights.fused_groups(model, dense_linears(model), "dense")
        assert set(groups) == (siblings(model) if fused is None else fused)
    H, I = SIZES["hidden_size"], SIZES["intermediate_size"]
    kv = H // SIZES["num_attention_heads"] * SIZES["num_key_value_heads"]
    assert decode_weights.copy_bytes(model, "dense") == LAYERS * (2 * H * H + 2 * kv * H + 3 * H * I) * 4


def test_fused_stacks_plain_siblings_at_their_bytes():
    """"fused" stacks plain q/k/v and gate/up too (a copy: their bytes), o_proj, down_proj and lm_head are used as
    they are; a model outside the patch table gets no groups."""
    model = tiny_model("llama")
    H, I = SIZES["hidden_size"], SIZES["intermediate_size"]
    kv = H // SIZES["num_attention_heads"] * SIZES["num_key_value_heads"]
    assert set(decode_weights.fused_groups(model, dense_linears(model), "fused")) == siblings(model)
    assert decode_weights.copy_bytes(model, "fused") == LAYERS * (H * H + 2 * kv * H + 2 * I * H) * 4
    assert decode_weights.fused_groups(model.model, dense_linears(model.model), "fused") == []


def test_a_projection_shared_by_two_layers_is_fused_once_and_restored():
    """Layer 1 reusing layer 0's k_proj (tied weights): layer 0's group is fused, layer 1's is not (its k_proj would be
    swapped twice), the decode matches the unfused copy's, and every module comes back as it was."""
    model = tiny_model("llama")
    layers = model.model.layers
    layers[1].self_attn.k_proj = layers[0].self_attn.k_proj
    groups = decode_weights.fused_groups(model, dense_linears(model), "fused")
    attention = [g for g in groups if len(g) == 3]
    assert attention == [(layers[0].self_attn.q_proj, layers[0].self_attn.k_proj, layers[0].self_attn.v_proj)]
    before = {id(m): (type(m), dict(m.__dict__)) for m in model.modules()}
    got = run(model, EngineConfig(weights="fused"))
    assert {id(m): (type(m), dict(m.__dict__)) for m in model.modules()} == before
    assert completions(got) == completions(run(model, EngineConfig()))


def counted_gemms(monkeypatch):
    """Calls of the copy's GEMMs (F.linear for "dense", fp8_linear for "fp8", fp8_scaled_linear for "w8a8") in
    decode_weights."""
    calls = []
    fp8, w8a8, linear = decode_weights.fp8_linear, decode_weights.fp8_scaled_linear, F.linear
    monkeypatch.setattr(decode_weights, "fp8_linear", lambda *a, **k: calls.append(1) or fp8(*a, **k))
    monkeypatch.setattr(decode_weights, "fp8_scaled_linear", lambda *a, **k: calls.append(1) or w8a8(*a, **k))
    monkeypatch.setattr(decode_weights, "F", type(sys)("F_counted"))
    decode_weights.F.linear = lambda *a, **k: calls.append(1) or linear(*a, **k)
    return calls


@pytest.mark.parametrize("kind, lora", [("fp8", True), ("w8a8", True), ("dense", True), ("fused", False),
                                        ("fused", True)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_groups_decode_as_unfused_with_4_gemms_per_layer(monkeypatch, arch, kind, lora):
    """The same tokens and log-probs as the copy without fusion (qwen2: q/k/v biases stacked too), greedy and
    sampled, and a decode step runs 4 GEMMs per layer (q/k/v, o, gate/up, down) + lm_head instead of 7 + 1 ("fused"
    stacks plain siblings as well: a model without LoRA or with q and v adapted fuses every group too)."""
    model = tiny_model(arch, lora=lora, targets="all-linear" if kind != "fused" else ("q_proj", "v_proj"))
    calls = counted_gemms(monkeypatch)
    sampled = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=10)
    for params in (SamplingParams(max_new_tokens=20, temperature=0), sampled):
        calls.clear()
        got = run(model, EngineConfig(weights=kind), params)
        fused_calls = len(calls)
        with monkeypatch.context() as m:
            m.setattr(decode_weights, "fused_groups", lambda *args: [])
            calls.clear()
            want = run(model, EngineConfig(weights=kind), params)
        assert completions(got) == completions(want)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
        assert fused_calls * (7 * LAYERS + 1) == len(calls) * (4 * LAYERS + 1) and fused_calls > 0


def test_group_members_called_in_any_order_or_on_other_inputs_give_their_own_outputs():
    """A member hands its siblings the outputs of its input only: called in another order, twice, or on another
    input, each returns its own copy's x W^T + b."""
    model = tiny_model("qwen2")
    attn = model.model.layers[0].self_attn
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(3, 1, SIZES["hidden_size"], generator=g) for _ in range(2))
    with torch.no_grad():
        expected = {(m, t): fake_quantized(m)(inp) for m in (q, k, v) for t, inp in (("x", x), ("y", y))}
        with decode_weights.copied_weights(model, "fp8"):
            for calls in ([(v, "x"), (q, "x"), (k, "x")], [(q, "x"), (q, "x"), (k, "y"), (v, "x"), (v, "y")],
                          [(k, "x"), (k, "y"), (q, "y"), (v, "y")]):
                for m, t in calls:
                    torch.testing.assert_close(m(x if t == "x" else y), expected[(m, t)], atol=1e-6, rtol=1e-6)


def test_per_layer_compiled_code_traces_once_for_all_layers():
    """Compiled per decoder layer (one code object run for every layer, as a regionally compiled step does): the
    copy's forward is guarded by class and tensor shapes, the same in every layer of a shape, so the layers of
    the tiny llama (2 layers, one shape each) trace once in all, across two rollouts' copies."""
    model = tiny_model("llama")
    layers = list(model.model.layers)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mlp = torch.compile(lambda layer, x: layer.mlp(x), backend="eager", fullgraph=True, dynamic=False)
    x = torch.randn(3, 1, SIZES["hidden_size"], generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        with torch.no_grad(), decode_weights.copied_weights(model, "fp8"):
            outs = [mlp(layer, x) for layer in layers]
        with torch.no_grad():
            assert not torch.equal(outs[0], layers[0].mlp(x))  # the copy ran, not the model's own weights
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_copy_bytes():
    model = tiny_model("llama")
    H, I, V = SIZES["hidden_size"], SIZES["intermediate_size"], SIZES["vocab_size"]
    kv = H // SIZES["num_attention_heads"] * SIZES["num_key_value_heads"]
    per_layer = (H + 4) * (2 * H + 2 * kv) + (H + 4) * 2 * I + (I + 4) * H  # q, o, k, v; gate, up; down
    assert decode_weights.copy_bytes(model, "fp8") == LAYERS * per_layer + (H + 4) * V


def test_gap_metrics_match_hand_math():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -1.0, float("nan")], [-0.3, -0.2, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # (0, 2): NaN, left out; (1, 2): padding
    d = [-0.5, 1.0, 0.0, 1.0]
    got = logprob_gap(train, rollout, mask)
    assert got["tokens"] == 4 and got["max_abs_gap"] == 1.0
    assert math.isclose(got["mean_abs_gap"], 2.5 / 4) and math.isclose(got["kl_k1"], 1.5 / 4)
    assert math.isclose(got["kl_k3"], sum(math.expm1(-x) + x for x in d) / 4, rel_tol=1e-12)


def test_fp8_logprobs_go_through_the_correction_into_the_loss():
    """On the FP8 engine's samples: the trainer's log-probs (sequence_logprobs) against the engine's give a gap
    above the model engine's own, the correction's weights are finite and within its clip, and the loss takes
    them and backpropagates."""
    model = tiny_model("qwen2", lora=True)
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    gaps = {}
    for name, config in (("model", EngineConfig()), ("fp8", FP8)):
        result = run(model, config, params, G=4, seed=0)
        prompt_mask, comp_mask = result.prompt_mask, result.completion_mask
        ids = torch.cat([result.prompt_ids, result.completion_ids], 1)
        attention = torch.cat([prompt_mask, comp_mask], 1)
        mask = torch.cat([torch.zeros_like(prompt_mask), comp_mask], 1)
        engine = torch.cat([prompt_mask * 0.0, result.logprobs], 1)
        train = sequence_logprobs(model, ids, attention, mask)
        gaps[name] = logprob_gap(train, engine, mask)
    assert gaps["fp8"]["tokens"] > 0 and gaps["fp8"]["kl_k3"] >= 0
    assert gaps["fp8"]["mean_abs_gap"] > 10 * gaps["model"]["mean_abs_gap"]
    weights, metrics = rollout_correction(train, engine, mask, "truncate", "token", clip_min=0.5, clip_max=2.0)
    assert math.isclose(metrics["rollout_logp_diff"], gaps["fp8"]["mean_abs_gap"], rel_tol=1e-5)
    valid = mask.bool()
    assert torch.isfinite(weights).all() and (weights[valid] >= 0.5).all() and (weights[valid] <= 2.0).all()
    model.train()
    advantages = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(0))
    loss, _ = fastgrpo.grpo_loss(model, ids, attention, mask, advantages, old_logps=train, token_weights=weights)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def four_bit_model(path):
    """A Qwen2 of SIZES with a bitsandbytes NF4 base and LoRA on q, v, gate (tests/test_qlora.py's fixture)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(**SIZES)).save_pretrained(path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu")
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora).eval()
    for module in model.modules():  # bitsandbytes' CPU repacking (test_4bit_cpu_repacked_layers_stay_whole) off
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def test_4bit_base_is_dequantized_once_per_rollout(monkeypatch, tmp_path):
    """A bitsandbytes 4-bit base with LoRA: the copy is quantize_fp8(dequantized base + delta) ("fp8") or the
    dequantized base + delta ("dense", which decodes as the model does), built once per rollout (one dequantization
    per 4-bit layer, not per token); the 4-bit weights are untouched."""
    pytest.importorskip("bitsandbytes")
    from peft.utils import integrations

    model = four_bit_model(tmp_path)
    packed = {n: p.detach().clone() for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    assert len(packed) == 7 * LAYERS
    calls = []
    dequantize = integrations.dequantize_bnb_weight

    def counted(*args, **kwargs):
        calls.append(1)
        return dequantize(*args, **kwargs)

    monkeypatch.setattr(integrations, "dequantize_bnb_weight", counted)
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    result = run(model, FP8, greedy)
    assert result.completion_ids.shape[1] == 12 and len(calls) == len(packed)
    calls.clear()
    dense, own = run(model, EngineConfig(weights="dense"), greedy), run(model, EngineConfig(), greedy)
    assert len(calls) == len(packed)  # "dense" too: once per rollout (the model's own forward is bitsandbytes')
    assert completions(dense) == completions(own)
    torch.testing.assert_close(dense.logprobs, own.logprobs, atol=1e-4, rtol=0)
    for n, p in model.named_parameters():
        if n in packed:
            assert torch.equal(p, packed[n]), n
    layer = model.base_model.model.model.layers[0].mlp.gate_proj  # a LoRA layer over a 4-bit base
    with torch.no_grad():
        want = dequantize(layer.base_layer.weight, state=layer.base_layer.weight.quant_state).float()
        torch.testing.assert_close(dense_weight(layer)[0], want + layer.get_delta_weight("default").float())


def test_4bit_cpu_repacked_layers_stay_whole(tmp_path):
    """After bitsandbytes repacks a 4-bit weight for its AVX512-BF16 CPU kernel (at its first eval forward on such a
    CPU) the weight cannot be dequantized: that layer keeps its own forward."""
    pytest.importorskip("bitsandbytes")
    model = four_bit_model(tmp_path)
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    assert layer in dense_linears(model)
    layer.weight.quant_state.packing_format_for_cpu = True  # what the repacking sets (bitsandbytes 0.50)
    assert layer not in dense_linears(model) and len(dense_linears(model)) == 7 * LAYERS
    layer.weight.quant_state.packing_format_for_cpu = False


# ---- GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("arch, lora", [("qwen2", False), ("llama", True)])
def test_gpu_fp8_engine_compiled_and_graphed(arch, lora):
    """On CUDA (compiled step, CUDA graph, the Triton kernel): no fallback warning; the eager step gives the
    same tokens; on fp8-grid fp32 weights the model engine's tokens (fp32 activations: "ieee" dots)."""
    torch._dynamo.reset()
    model = tiny_model(arch, lora=lora).cuda()
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = run(model, FP8, params, G=4)
    assert not [w for w in caught if str(w.message).startswith("rollout:")], [str(w.message) for w in caught]
    eager = run(model, EngineConfig(weights="fp8", compile=False), params, G=4)
    assert completions(graphed) == completions(eager)
    torch.testing.assert_close(graphed.logprobs, eager.logprobs, atol=1e-4, rtol=0)
    if not lora:  # eager steps (compiling is checked above): the kernel against cuBLAS, on fp8-grid weights
        on_fp8_grid(model)
        got = run(model, EngineConfig(weights="fp8", compile=False), params, G=4)
        want = run(model, EngineConfig(compile=False), params, G=4)
        assert completions(got) == completions(want)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=0)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_bf16_model_fp8_gap_is_small():
    """bf16 weights of a tiny llama, 48 rows, compiled and graphed: the gap of the FP8 engine's log-probs to the
    trainer's goes through logprob_gap finite, with a KL estimate under a loose 0.05 nats per token (a sanity
    check of the bf16 path end to end, not a claim about trained models)."""
    model = tiny_model("llama").cuda().bfloat16()
    params = SamplingParams(max_new_tokens=32, temperature=1.0)
    result = run(model, FP8, params, G=16, seed=1)
    prompt_mask, comp_mask = result.prompt_mask, result.completion_mask
    ids = torch.cat([result.prompt_ids, result.completion_ids], 1)
    mask = torch.cat([torch.zeros_like(prompt_mask), comp_mask], 1)
    train = sequence_logprobs(model, ids, torch.cat([prompt_mask, comp_mask], 1), mask)
    gap = logprob_gap(train, torch.cat([prompt_mask * 0.0, result.logprobs], 1), mask)
    assert gap["tokens"] > 0 and gap["kl_k3"] < 0.05, gap


@pytest.mark.gpu
@pytest.mark.parametrize("arch, lora, kind", [("qwen2", False, "fused"), ("llama", True, "dense")])
def test_gpu_fused_groups_compiled_and_graphed(arch, lora, kind):
    """q/k/v and gate/up as one GEMM each, inside the compiled, CUDA-graphed step: the tokens and log-probs of the
    same copy without fusion (fp32 weights: only the GEMMs' summation order may differ). Tolerance: a GEMM summed in
    another order moves each output by at most K u sum|x w| (K <= 128 here, u = 2^-24: ~1e-5 of the sum), and two
    layers, lm_head and log-softmax carry that into a log-prob at a few times the logits' size (|logit| < 10 for
    these random weights): 1e-4 bounds it; a wrong slice or bias moves log-probs by O(1)."""
    torch._dynamo.reset()
    model = tiny_model(arch, lora=lora, targets="all-linear").cuda()
    assert decode_weights.fused_groups(model, dense_linears(model), kind)
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    got = run(model, EngineConfig(weights=kind), params, G=4)
    unfused = decode_weights.fused_groups
    try:
        decode_weights.fused_groups = lambda *args: []
        torch._dynamo.reset()
        want = run(model, EngineConfig(weights=kind), params, G=4)
    finally:
        decode_weights.fused_groups = unfused
    assert completions(got) == completions(want)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=0)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_auto_copies_within_a_per_process_memory_cap():
    """A cap set with set_per_process_memory_fraction (a 24 GB card emulated on a larger one) bounds what "auto"
    copies, whatever the card has free."""
    model = tiny_model("llama").cuda()
    assert decode_weights.resolved_weights(model, "auto") == "fused"
    total = torch.cuda.get_device_properties(0).total_memory
    need = torch.cuda.memory_allocated() + decode_weights.AUTO_HEADROOM_BYTES + decode_weights.copy_bytes(model, "fused")
    try:
        torch.cuda.set_per_process_memory_fraction((need - 1) / total)
        assert decode_weights.resolved_weights(model, "auto") == "model"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.mark.gpu
def test_gpu_auto_copies_under_a_cap_whose_mem_get_info_reports_the_capped_card(monkeypatch):
    """bench_loop's capped probes answer mem_get_info as a card of the cap would ((cap - used, cap)); the fraction
    stays one of the device's memory, so a cap with room for the copy still copies."""
    from benchmarks.bench_loop import GIB, capped_mem_get_info

    model = tiny_model("llama").cuda()
    total = torch.cuda.get_device_properties(0).total_memory
    copy = decode_weights.copy_bytes(model, "fused")
    cap = 4 * (torch.cuda.memory_allocated() + decode_weights.AUTO_HEADROOM_BYTES + copy)
    monkeypatch.setattr(torch.cuda, "mem_get_info", capped_mem_get_info(cap / GIB, torch.cuda.memory_reserved))
    try:
        torch.cuda.set_per_process_memory_fraction(cap / total)
        assert decode_weights.resolved_weights(model, "auto") == "fused"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
