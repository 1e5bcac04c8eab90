"""patch_model(fp8_base=True) on a model without LoRA layers (full fine-tuning): fastgrpo.ops.fp8_trained.

- A patched linear against fp64: the forward is fp8_base_product's (within test_fp8_scaled_linear's bounds (a) and
  (b) of the quantized product's fp64 reference), the input gradient fp8_input_grad's (the same bounds), the weight
  and bias gradients nn.Linear's bit for bit and within their GEMM's bound of the fp64 sums.
- In a patched Qwen2 every decoder linear runs it (not the lm_head). Each keeps its weight's e4m3 copy and, after a
  backward, the copy's transpose; both are made again after an optimizer step, a fused AdamW's too (which moves no
  version counter: a copy kept by version alone gives the old weights' output). A frozen deep copy (full fine-
  tuning's reference) gives the same output and keeps its copies across the policy's steps. Copies follow
  load_state_dict (in place, assign=True) and go at a .float() with their transposes.
- A partly frozen model (biases alone, attention frozen, embeddings and norms frozen) gets the fully trained one's
  gradients bit for bit; a frozen linear saves nothing of its input; calls FP8 cannot take (autocast, mixed dtypes,
  a resized weight) are F.linear's; an nn.Linear subclass is left alone.
- The engine's decode over the model's own weights: compiled, the uncompiled tokens; after an optimizer step, the
  tokens and log-probs of a model patched afresh over the new weights.
- `fastgrpo train --lora-rank 0 --fp8-base` runs, the reference pass included.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.optim.optimizer import _global_optimizer_post_hooks
from transformers import Qwen2Config, Qwen2ForCausalLM

import fastgrpo
from fastgrpo.ops.fp8_base import (
    FP8_TRANSPOSED_ATTR, FP8_WEIGHT_ATTR, _cpu_takes_row_scales, fp8_base_product, fp8_input_grad,
)
from fastgrpo.ops.fp8_linear import quantize_fp8
from fastgrpo.ops.fp8_trained import fp8_linear_forward, fp8_linears
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams
from tests.error_bounds import assert_within
from tests.test_fp8_base import check_product, input_grad_reference
from tests.test_fp8_scaled_linear import CPU_ACC, U32, make
from tests.test_rollout import char_tokenizer

# the CPU tests' FP8 GEMMs are torch's CPU _scaled_mm
cpu_scaled_mm = pytest.mark.skipif(not _cpu_takes_row_scales(), reason="this torch's CPU _scaled_mm takes no row scales")

LAYERS = 2


def gemm_bound(ref_abs: torch.Tensor, terms: int, dtype: torch.dtype) -> torch.Tensor:
    """A GEMM of exact `dtype` inputs summed in fp32 (terms roundings of at most U32 of the absolute sum) and rounded
    once to `dtype` (half its eps relative to normals, half the subnormals' spacing below): against the fp64 sums."""
    info = torch.finfo(dtype)
    return terms * U32 * ref_abs + info.eps / 2 * ref_abs + info.smallest_normal * info.eps / 2


@cpu_scaled_mm
@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 40), N=st.integers(1, 5).map(lambda n: 16 * n), K=st.integers(1, 6).map(lambda k: 16 * k),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), with_bias=st.booleans(),
       batched=st.booleans(), seed=st.integers(0, 2**16))
@example(M=1, N=16, K=16, dtype=torch.bfloat16, with_bias=True, batched=True, seed=0)  # one row: its bias gradient
def test_fp8_linear_matches_fp64(M, N, K, dtype, with_bias, batched, seed):
    gen = torch.Generator().manual_seed(seed)
    x2, _, _, bias = make(gen, M, N, K, dtype, with_bias)
    layer = linear_of((torch.randn(N, K, generator=gen) * 0.1).to(dtype), bias)
    q, scale = quantize_fp8(layer.weight.detach())
    what = f"M{M} N{N} K{K} {dtype}"
    x = (x2.view(1, M, K) if batched else x2).clone().requires_grad_()
    out = fp8_linear_forward(layer, x)
    assert out.shape == (*x.shape[:-1], N) and out.dtype == dtype
    assert torch.equal(out.detach().reshape(M, N), check_product(x2, q, scale, bias, CPU_ACC, what))
    g = make(gen, M, 16, N, dtype)[0]
    out.backward(g.view(out.shape))

    grad_x = x.grad.reshape(M, K)
    ref, tol, _ = input_grad_reference(g, q, scale)
    assert_within(grad_x, ref, tol, f"{what} input gradient")
    assert torch.equal(grad_x, fp8_input_grad(g, q, scale))
    assert (grad_x - g.mm(layer.weight.detach())).abs().max() > 0, "the input gradient must be the e4m3 one"

    plain = linear_of(layer.weight.detach(), bias)
    F.linear(x.detach(), plain.weight, plain.bias).backward(g.view(out.shape))
    wanted = [("weight", g.double().t() @ x2.double(), g.double().abs().t() @ x2.double().abs(), M)]
    if with_bias:
        wanted.append(("bias", g.double().sum(0), g.double().abs().sum(0), M))
    for (name, exact, size, terms), got, want in zip(wanted, (layer.weight, layer.bias), (plain.weight, plain.bias)):
        assert torch.equal(got.grad, want.grad), f"{what} {name} gradient is not nn.Linear's"
        assert_within(got.grad, exact, gemm_bound(size, terms, dtype), f"{what} {name} gradient")


def linear_of(weight, bias):
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                            device=weight.device)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def tiny_qwen(seed=0, vocab=96):
    """Qwen2 (q/k/v with biases) whose decoder linears' sides are multiples of 16, bf16, full fine-tuning."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2)
    return Qwen2ForCausalLM(config).to(torch.bfloat16)


def decoder_linears(model):
    return [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


@cpu_scaled_mm
def test_every_decoder_linear_multiplies_in_fp8():
    """Each decoder linear's output is fp8_base_product's over its weight's e4m3 copy, bit for bit, not F.linear's;
    the lm_head (sides multiples of 16 too) is the fused loss's, not bound."""
    model = fastgrpo.patch_model(tiny_qwen(), fp8_base=True)
    linears = decoder_linears(model)
    assert set(fp8_linears(model)) == set(linears) and len(linears) == 7 * LAYERS
    assert model.fastgrpo_patch_summary["patched"]["fp8_linear"] == 7 * LAYERS
    assert "forward" not in model.lm_head.__dict__
    seen = {}
    handles = [m.register_forward_hook(lambda mod, args, out: seen.__setitem__(mod, (args[0], out))) for m in linears]
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    model(ids).logits.float().square().mean().backward()
    for handle in handles:
        handle.remove()
    assert set(seen) == set(linears)
    with torch.no_grad():
        for layer, (x, out) in seen.items():
            q, scale = quantize_fp8(layer.weight)
            want = fp8_base_product(x.reshape(-1, x.shape[-1]), q, scale, layer.bias).view(out.shape)
            assert torch.equal(out, want)
            assert not torch.equal(out, F.linear(x, layer.weight, layer.bias))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    fastgrpo.unpatch_model(model)
    assert not fp8_linears(model)
    assert not [m for m in linears if FP8_WEIGHT_ATTR in m.__dict__ or FP8_TRANSPOSED_ATTR in m.__dict__]


def copies(model):
    return [(layer.__dict__[FP8_WEIGHT_ATTR][1][0], layer.__dict__[FP8_TRANSPOSED_ATTR][1])
            for layer in fp8_linears(model)]


@cpu_scaled_mm
@pytest.mark.parametrize("recompute", ["offload", "hf-checkpointing"])
def test_recomputed_layers_give_the_gradients_of_kept_ones(recompute):
    """Offload checkpointing (the layer's input in CPU memory, the layer run again in the backward) and HF's gradient
    checkpointing: the same gradients, bit for bit, as a model that keeps every activation (the recompute multiplies
    by the same copies)."""
    from fastgrpo.offload import ActivationOffloader

    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    grads = []
    for checkpointed in (False, True):
        model = tiny_qwen()
        offload = ActivationOffloader("cpu") if checkpointed and recompute == "offload" else False
        fastgrpo.patch_model(model, fp8_base=True, offload_activations=offload)
        if checkpointed and recompute == "hf-checkpointing":
            model.gradient_checkpointing_enable()
        model.train()(ids).logits.float().square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@cpu_scaled_mm
def test_copies_are_kept_until_an_optimizer_step_a_fused_one_too():
    """The copies (and transposes) of one step serve every forward and backward until the optimizer steps; torch's
    fused AdamW writes the weights without moving their version counters, and the next forward multiplies the new
    weights, as a model patched afresh over them does."""
    model = fastgrpo.patch_model(tiny_qwen(), fp8_base=True)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    before = model(ids).logits
    before.float().square().mean().backward()
    kept = copies(model)
    model(ids).logits.float().square().mean().backward()
    assert all(a is c and b is d for (a, b), (c, d) in zip(kept, copies(model))), "one copy for one step"
    versions = [p._version for p in model.parameters()]
    optimizer.step()
    assert [p._version for p in model.parameters()] == versions, "the scenario: no version moved"
    with torch.no_grad():
        got = model(ids).logits
        fresh = tiny_qwen()
        fresh.load_state_dict(model.state_dict())
        want = fastgrpo.patch_model(fresh, fp8_base=True)(ids).logits
    assert torch.equal(got, want) and not torch.equal(got, before.detach())
    got.requires_grad_()  # (no graph: the copies' transposes are remade by the next backward)
    model(ids).logits.float().square().mean().backward()
    assert all(a is not c and b is not d for (a, b), (c, d) in zip(kept, copies(model)))


def held(model, attr):
    return [layer for layer in fp8_linears(model) if attr in layer.__dict__]


@cpu_scaled_mm
def test_copies_follow_loads_and_moves():
    """load_state_dict in place (no optimizer step: the version counter) and with assign=True (new tensors: the
    address) gives the loaded weights' output; a forward after an optimizer step holds no old transpose (a rollout
    between steps would keep 1 byte a parameter for nothing); .float() drops copies and transposes at once; the
    optimizer step hook is registered once, not at each forward."""
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(7))
    model = fastgrpo.patch_model(tiny_qwen(), fp8_base=True)
    model(ids).logits.float().square().mean().backward()
    hooks = len(_global_optimizer_post_hooks)
    torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True).step()
    with torch.no_grad():
        model(ids)
    assert len(held(model, FP8_WEIGHT_ATTR)) == 7 * LAYERS and not held(model, FP8_TRANSPOSED_ATTR)
    for seed, assign in ((1, True), (2, False)):  # assign first: new tensors at the old ones' version 0
        other = tiny_qwen(seed)
        model.load_state_dict(other.state_dict(), assign=assign)
        with torch.no_grad():
            got = model(ids).logits
            want = fastgrpo.patch_model(other, fp8_base=True)(ids).logits
        assert torch.equal(got, want), f"assign={assign}"
    model(ids).logits.float().square().mean().backward()
    assert len(_global_optimizer_post_hooks) == hooks, "one step hook"
    model.float()
    assert not held(model, FP8_WEIGHT_ATTR) and not held(model, FP8_TRANSPOSED_ATTR)


@cpu_scaled_mm
def test_a_frozen_copy_gives_the_same_output():
    """Full fine-tuning's reference (a deep copy, frozen): each linear's e4m3 copy made once and kept across the
    policy's optimizer steps, its output the trained model's bit for bit."""
    model = fastgrpo.patch_model(tiny_qwen(), fp8_base=True)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.eval()(ids).logits
        got = reference(ids).logits
        kept = [layer.__dict__[FP8_WEIGHT_ATTR][1] for layer in fp8_linears(reference)]
        torch.optim.SGD(model.parameters(), lr=0.1).step()  # the policy's step: the frozen copies stay
        reference(ids)
    assert torch.equal(got, want)
    assert len(kept) == 7 * LAYERS
    assert all(layer.__dict__[FP8_WEIGHT_ATTR][1] is k for layer, k in zip(fp8_linears(reference), kept))


@cpu_scaled_mm
@pytest.mark.parametrize("compile_step", [False, True], ids=["eager", "compiled"])
def test_decode_over_the_models_weights_follows_an_optimizer_step(request, compile_step):
    """weights="model", greedy: the compiled decode gives the uncompiled tokens; after a fused AdamW step the
    rollout's tokens and log-probs are those of a model patched afresh over the new weights."""
    if compile_step:
        assert request.getfixturevalue("compiles") is not None  # torch's compile over ops the CPU runs
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    configs = [EngineConfig(weights="model", compile=on, max_prompt_length=16) for on in (False, compile_step)]

    def run(model, config):
        result = generate_with_config(model.eval(), char_tokenizer(), ["abc", "hello"], 2, params, seed=0,
                                      config=config)
        return result.completion_ids, result.logprobs

    model = fastgrpo.patch_model(tiny_qwen(vocab=128), fp8_base=True)
    first = [run(model, config) for config in configs]
    assert all(torch.equal(a, b) for a, b in zip(*first))
    model.train()(torch.randint(0, 128, (2, 9))).logits.float().square().mean().backward()
    torch.optim.AdamW(model.parameters(), lr=1e-1, fused=True).step()
    got = run(model, configs[1])
    fresh = tiny_qwen(vocab=128)
    fresh.load_state_dict(model.state_dict())
    want = run(fastgrpo.patch_model(fresh, fp8_base=True), configs[0])
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert not torch.equal(got[1], first[0][1])


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
def test_refused_under_torchrun(monkeypatch, tmp_path, capsys, command):
    """Full fine-tuning under torchrun is FSDP2's: each process would keep e4m3 copies of whole weights."""
    from fastgrpo.train.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([command, "--patch", "--fp8-base", "--lora-rank", "0", "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"fastgrpo {command}: error: fp8_base: keeps e4m3 copies of the weights it multiplies, and with --lora-rank 0 "
        "under torchrun FSDP2 shards them: every process would keep copies of every weight, unsharded; run one "
        "process, or train LoRA")


def test_lora_is_not_refused_under_torchrun(monkeypatch):
    """LoRA under torchrun is DDP's, each process holding the whole frozen base anyway: fp8_base is taken."""
    from fastgrpo.train.config import GRPOConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert GRPOConfig(fp8_base=True, lora_rank=16).fp8_base


@cpu_scaled_mm
def test_full_fine_tuning_trains_with_fp8_base(tmp_path):
    """The built-in task with lora_rank 0: two steps with the frozen reference copy's pass (beta > 0)."""
    import json

    from fastgrpo.train.cli import main

    assert main(["train", "--patch", "--fp8-base", "--lora-rank", "0", "--beta", "0.04", "--output-dir",
                 str(tmp_path), "--no-progress-bar", "--max-steps", "2"]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]


# the parameters a partly frozen model trains, by name
TRAINED = {
    "biases-alone": lambda name: name.endswith(".bias"),  # BitFit
    "attention-frozen": lambda name: ".self_attn." not in name,
    "embeddings-and-norms-frozen": lambda name: "embed_tokens" not in name and "norm" not in name,
}


@cpu_scaled_mm
@pytest.mark.parametrize("trained", list(TRAINED))
def test_a_partly_frozen_model_gets_the_gradients_of_a_fully_trained_one(trained):
    """The trained parameters get the fully trained model's gradients bit for bit, the frozen ones none. Biases alone:
    layer 0's q/k/v have an input and a weight that need no gradient, and their bias, added by _scaled_mm (which has
    no derivative), failed the backward before. A linear whose input needs no gradient keeps no transpose for one."""
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    full = fastgrpo.patch_model(tiny_qwen(), fp8_base=True)
    full(ids).logits.float().square().mean().backward()
    model = fastgrpo.patch_model(tiny_qwen(), fp8_base=True)
    for name, param in model.named_parameters():
        param.requires_grad_(TRAINED[trained](name))
    input_grad = {}
    for layer in fp8_linears(model):
        layer.register_forward_pre_hook(lambda mod, args: input_grad.__setitem__(mod, args[0].requires_grad))
    model(ids).logits.float().square().mean().backward()
    for (name, want), got in zip(full.named_parameters(), model.parameters()):
        assert got.grad is None if not got.requires_grad else torch.equal(got.grad, want.grad), name
    if trained != "attention-frozen":  # (there: frozen weights whose inputs need gradients)
        assert not all(input_grad.values()), "the scenario: a linear whose input needs no gradient"
    assert {layer: FP8_TRANSPOSED_ATTR in layer.__dict__ for layer in fp8_linears(model)} == input_grad


@cpu_scaled_mm
def test_a_frozen_linear_keeps_nothing_for_its_backward():
    """A frozen weight needs no x^T g: nothing of the input is saved (its backward multiplies by the kept copy)."""
    gen = torch.Generator().manual_seed(8)
    layer = linear_of(torch.randn(32, 16, generator=gen).bfloat16(), None).requires_grad_(False)
    x = torch.randn(3, 16, generator=gen).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fp8_linear_forward(layer, x)
    assert not saved
    out.backward(torch.ones_like(out))
    assert x.grad is not None and layer.weight.grad is None


def outcome(call):
    """call()'s result, or its RuntimeError's line."""
    try:
        return call()
    except RuntimeError as err:
        return str(err)


def linear_cases():
    """(what, layer, x, context) of the calls the patched forward leaves to F.linear."""
    gen = torch.Generator().manual_seed(6)
    fp32 = linear_of(torch.randn(32, 16, generator=gen), torch.randn(32, generator=gen))
    x = torch.randn(3, 16, generator=gen)
    mixed_bias = linear_of(fp32.weight.detach().bfloat16(), None)
    mixed_bias.bias = torch.nn.Parameter(torch.randn(32, generator=gen))
    resized = linear_of(fp32.weight.detach().bfloat16(), None)
    resized.weight = torch.nn.Parameter(torch.randn(32, 40, generator=gen).bfloat16())  # 40: not a multiple of 16
    return [("autocast", fp32, x, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
            ("input of another dtype", linear_of(fp32.weight.detach().bfloat16(), None), x, contextlib.nullcontext),
            ("bias of another dtype", mixed_bias, x.bfloat16(), contextlib.nullcontext),
            ("weight replaced by one _scaled_mm cannot take", resized, torch.randn(3, 40).bfloat16(),
             contextlib.nullcontext)]


@cpu_scaled_mm
@pytest.mark.parametrize("case", range(len(linear_cases())), ids=[case[0] for case in linear_cases()])
def test_calls_fp8_cannot_take_are_f_linears(case):
    """Autocast (TRL's bf16: documented to multiply in the autocast dtype), mixed dtypes, a weight replaced by one of
    a shape _scaled_mm cannot take: the output (or the error) of F.linear, as the layer unpatched gives."""
    what, layer, x, context = linear_cases()[case]
    with context():
        want = outcome(lambda: F.linear(x, layer.weight, layer.bias))
        got = outcome(lambda: fp8_linear_forward(layer, x))
    assert type(got) is type(want) and (got == want if isinstance(want, str) else torch.equal(got, want)), what


class ScaledLinear(torch.nn.Linear):
    """A user's nn.Linear subclass with math of its own."""

    def forward(self, x):
        return super().forward(x) * 0.5


@cpu_scaled_mm
def test_linears_of_their_own_math_or_dtype_are_left_alone():
    """An nn.Linear subclass keeps its forward; a model in fp64 (which _scaled_mm's operands cannot carry) is
    refused in one line."""
    model = tiny_qwen()
    mlp = model.model.layers[0].mlp
    mlp.down_proj = ScaledLinear(96, 64, bias=False, dtype=torch.bfloat16)
    fastgrpo.patch_model(model, fp8_base=True)
    assert mlp.down_proj not in fp8_linears(model) and "forward" not in mlp.down_proj.__dict__
    assert len(fp8_linears(model)) == 7 * LAYERS - 1
    with pytest.raises(ValueError) as caught:
        fastgrpo.patch_model(tiny_qwen().double(), fp8_base=True)
    assert str(caught.value) == (
        "fp8_base: multiplies the decoder's nn.Linear layers in FP8 (a LoRA model's frozen bases, or every one in "
        "full fine-tuning), and this Qwen2ForCausalLM has none of bf16 / fp16 / fp32 weights with both sides "
        "multiples of 16")


# ---- GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K", [(1037, 2048, 1536), (1037, 1536, 8960), (2048, 17920, 1536)])
def test_gpu_fp8_linear_matches_fp64(M, N, K):
    """Qwen2.5-1.5B's q/k/v, down and gate/up at training rows on the FP8 tensor cores: the forward and input
    gradient within bounds (a) and (b), the weight gradient within its bf16 GEMM's bound (fp64 references on the
    CPU)."""
    from tests.test_fp8_scaled_linear import GPU_ACC

    gen = torch.Generator().manual_seed(0)
    x, _, _, bias = make(gen, M, N, K, torch.bfloat16, True, device="cuda")
    layer = linear_of((torch.randn(N, K, generator=gen) * 0.02).to(torch.bfloat16).cuda(), bias)
    xg = x.clone().requires_grad_()
    out = fp8_linear_forward(layer, xg)
    q, scale = quantize_fp8(layer.weight.detach())
    assert torch.equal(out.detach().cpu(), check_product(x, q, scale, bias, GPU_ACC, f"gpu M{M} N{N} K{K}"))
    cpu = [t.cpu() for t in (x, q, scale)]
    g = make(gen, M, 16, N, torch.bfloat16, device="cuda")[0]
    out.backward(g)
    g, x = g.cpu(), x.cpu()
    ref, tol, _ = input_grad_reference(g, *cpu[1:3], GPU_ACC)
    assert_within(xg.grad.cpu(), ref, tol, f"gpu M{M} N{N} K{K} input gradient")
    exact, size = g.double().t() @ x.double(), g.double().abs().t() @ x.double().abs()
    assert_within(layer.weight.grad.cpu(), exact, gemm_bound(size, M, torch.bfloat16), "weight gradient")


@pytest.mark.gpu
def test_gpu_training_step_and_compiled_decode():
    """A patched model's step on CUDA (every gradient finite) and its compiled, graphed decode over the model's own
    weights: the tokens of the uncompiled decode."""
    model = fastgrpo.patch_model(tiny_qwen(vocab=128).cuda(), fp8_base=True)
    ids = torch.randint(0, 128, (2, 9), device="cuda")
    model(ids).logits.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    configs = [EngineConfig(weights="model", compile=on, max_prompt_length=16) for on in (False, True)]
    tokens = [generate_with_config(model, char_tokenizer(), ["abc", "hello"], 2, params, seed=0,
                                   config=config).completion_ids for config in configs]
    assert torch.equal(*tokens), tokens


@cpu_scaled_mm
def test_lora_switches_do_not_refuse_a_full_model():
    """fused_lora / lora_dtype shape LoRA layers' forward: a full model patched with fp8_base and fused_lora=False runs
    its FP8 linears (it was refused with the LoRA forward's line); a LoRA model still is refused."""
    from tests.test_fp8_base import tiny_lora_model

    model = fastgrpo.patch_model(tiny_qwen(), fp8_base=True, fused_lora=False, lora_dtype="adapter")
    assert len(fp8_linears(model)) == 7 * LAYERS
    with pytest.raises(ValueError, match="needs fused_lora=True"):
        fastgrpo.patch_model(tiny_lora_model(), fp8_base=True, fused_lora=False)

