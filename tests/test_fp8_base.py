"""patch_model(fp8_base=True): the frozen base of each LoRA layer multiplies in FP8 (fastgrpo.ops.fp8_base).

- fp8_base_product against the fp64 reference of the quantized product (fp8_scaled_linear_reference), within
  test_fp8_scaled_linear's bounds (a) and (b): the same math as the rollout's W8A8 op, at training shapes.
- fp8_input_grad (g W through the copy, the weight's scales moved into g) against the same reference for g * scale
  and q^T, within the same bounds.
- lora_linear with an e4m3 copy: the base product and input gradient are those ops', each adapter's delta and
  input-gradient term are added as without it (fp32 inputs: the adapters' GEMMs bounded in fp32), and the adapters'
  weight gradients are the op's without the copy, bit for bit.
- In a patched PEFT model every LoRA layer runs it, with the adapters disabled too (the reference pass), the copy
  is made again after the weight changes, and unpatch_model drops it.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import fastgrpo
from fastgrpo.ops.fp8_base import FP8_WEIGHT_ATTR, fp8_base_product, fp8_input_grad, fp8_weight_of
from fastgrpo.ops.fp8_linear import quantize_fp8, quantize_rows
from fastgrpo.ops.fp8_scaled_linear import fp8_scaled_linear_reference
from fastgrpo.ops.lora import lora_linear_of_checked_values
from tests.error_bounds import assert_within
from tests.test_fp8_scaled_linear import CPU_ACC, GPU_ACC, U32, bound, exact, make, rounding_x


def check_product(x, q, scale, bias, c_acc, what):
    got = fp8_base_product(x, q, scale, bias)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], q.shape[0])
    # The reference quantizes x on the CPU: IEEE divisions, the bytes of the op's quantizer (CUDA's eager divide by
    # a scalar is a multiply by its reciprocal, one ulp off in about half the scales: kernels/quantize_fp8.py).
    x, q, scale, bias, got = (None if t is None else t.cpu() for t in (x, q, scale, bias, got))
    ref = fp8_scaled_linear_reference(x, q, scale, bias)
    tol = bound(ref, x, q, scale, bias, x.dtype, c_acc)
    assert_within(got, ref, tol, f"{what} vs the reference")
    assert_within(got, exact(x, q, scale, bias), tol + rounding_x(x, q, scale), f"{what} vs unquantized x")
    return got


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 40), N=st.integers(1, 5).map(lambda n: 16 * n), K=st.integers(1, 6).map(lambda k: 16 * k),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), with_bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_product_matches_reference(M, N, K, dtype, with_bias, seed):
    x, q, scale, bias = make(torch.Generator().manual_seed(seed), M, N, K, dtype, with_bias)
    got = check_product(x, q, scale, bias, CPU_ACC, f"M{M} N{N} K{K} {dtype}")
    out = torch.full_like(got, float("nan"))
    assert fp8_base_product(x, q, scale, bias, out=out) is out and torch.equal(out, got)


def lora_case(seed, dtype, rank=4, adapters=2, M=13, N=48, K=32):
    g = torch.Generator().manual_seed(seed)
    x, _, _, bias = make(g, M, N, K, dtype)
    weight = (torch.randn(N, K, generator=g) * 0.1).to(dtype)
    pairs = [(torch.randn(rank, K, generator=g) * 0.1, torch.randn(N, rank, generator=g) * 0.1, 0.5 + i)
             for i in range(adapters)]
    return x, weight, bias, pairs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lora_linear_adds_deltas_to_the_fp8_product(seed):
    """fp32 x: the base product as fp8_base_product rounds it (bf16), each delta within its two fp32 GEMMs'
    accumulation (K + r + 2 roundings of its terms' size, plus the add into the output)."""
    x, weight, bias, pairs = lora_case(seed, torch.float32)
    q, scale = quantize_fp8(weight)
    got = lora_linear_of_checked_values(x, weight, bias, pairs, (q, scale))
    base = fp8_scaled_linear_reference(x, q, scale, bias)
    deltas = sum(s * (x.double() @ a.double().T @ b.double().T) for a, b, s in pairs)
    size = sum(s * (x.double().abs() @ a.double().abs().T @ b.double().abs().T) for a, b, s in pairs)
    K, r = x.shape[1], pairs[0][0].shape[0]
    tol = bound(base, x, q, scale, bias, torch.float32) + (K + r + 2) * U32 * size + 2 * U32 * (base + deltas).abs()
    assert_within(got, base + deltas, tol, f"seed {seed}")
    plain = lora_linear_of_checked_values(x, weight, bias, pairs)
    assert (got - plain).abs().max() > 0, "the e4m3 product must differ from the exact one"


def input_grad_reference(g, q, scale, c_acc=CPU_ACC):
    """g W as fp8_input_grad computes it, fp64: the GEMM of g * scale (fp32) quantized per row with q^T as it is
    (scale 1), in fp8_scaled_linear's terms; and that GEMM's bound (a) + (b) against the exact g (q scale)."""
    gs = g.float() * scale
    qt, ones = q.t().contiguous(), torch.ones(q.shape[1])
    ref = fp8_scaled_linear_reference(gs, qt, ones)
    return ref, bound(ref, gs, qt, ones, None, g.dtype, c_acc), rounding_x(gs, qt, ones)


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 40), N=st.integers(1, 5).map(lambda n: 16 * n), K=st.integers(1, 6).map(lambda k: 16 * k),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), seed=st.integers(0, 2**16))
def test_input_grad_matches_reference(M, N, K, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    g = make(gen, M, 16, N, dtype)[0]  # g [M, N]: the output's gradient, rows of different magnitudes
    _, q, scale, _ = make(gen, 1, N, K, dtype)  # the weight [N, K]
    got = fp8_input_grad(g, q, scale)
    assert got.dtype == dtype and got.shape == (M, K)
    ref, tol, rounding = input_grad_reference(g, q, scale)
    assert_within(got, ref, tol, f"M{M} N{N} K{K} {dtype} vs the reference")
    exact_grad = g.double() @ (q.double() * scale.double()[:, None])
    assert_within(got, exact_grad, tol + rounding, "vs unquantized g")


@settings(max_examples=20, deadline=None)
@given(R=st.integers(0, 150), C=st.integers(0, 150), seed=st.integers(0, 2**16))
def test_transpose_bytes(R, C, seed):
    """The Triton tile transpose (the interpreter here) of any shape, odd and empty ones too: torch's, byte for byte."""
    from fastgrpo.kernels.transpose import transpose_bytes

    x = torch.randint(0, 256, (R, C), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    got = transpose_bytes(x.view(torch.float8_e4m3fn))
    assert got.dtype == torch.float8_e4m3fn and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), x.t().contiguous())


@pytest.mark.parametrize("seed", [0, 1])
def test_backward(seed):
    """The same upstream gradient: the adapters' gradients are the op's without the copy, bit for bit (they never
    read the base weight); the input gradient is fp8_input_grad's plus each adapter's term, within that GEMM's
    bound and the adapter GEMMs' fp32 roundings."""
    x, weight, bias, pairs = lora_case(seed, torch.float32)
    q, scale = quantize_fp8(weight)
    grads, g = [], None
    for fp8 in ((q, scale), None):
        xg = x.clone().requires_grad_()
        leaves = [(a.clone().requires_grad_(), b.clone().requires_grad_(), s) for a, b, s in pairs]
        out = lora_linear_of_checked_values(xg, weight, bias, leaves, fp8)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
        out.backward(g)
        grads.append([xg.grad] + [t.grad for a, b, _ in leaves for t in (a, b)])
    for got, want in zip(grads[0][1:], grads[1][1:]):
        assert torch.equal(got, want)
    ref, tol, _ = input_grad_reference(g, q, scale)
    terms = sum(s * (g.double() @ b.double() @ a.double()) for a, b, s in pairs)
    size = sum(s * (g.double().abs() @ b.double().abs() @ a.double().abs()) for a, b, s in pairs)
    N, r = g.shape[1], pairs[0][0].shape[0]
    tol = tol + (N + r + 2) * U32 * size + 2 * U32 * (ref + terms).abs()
    assert_within(grads[0][0], ref + terms, tol, f"input gradient, seed {seed}")
    assert (grads[0][0] - grads[1][0]).abs().max() > 0, "the e4m3 input gradient must differ from the exact one"


def tiny_lora_model(seed=0, targets="all-linear", vocab=80, layers=2):
    """Llama with every decoder linear's sides multiples of 16 (q 64, k/v 32, MLP 96), bf16, LoRA r4 with random
    weights on the targets."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


def lora_layers(model):
    return [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def record_io(layers):
    seen, handles = {}, []
    for layer in layers:
        handles.append(layer.register_forward_hook(
            lambda module, args, out: seen.__setitem__(module, (args[0].detach(), out.detach()))))
    return seen, handles


@pytest.mark.parametrize("disabled", [False, True])
def test_every_lora_layer_multiplies_in_fp8(disabled):
    """Each LoRA layer's output is lora_linear's with its base weight's e4m3 copy, bit for bit; with the adapters
    disabled (the reference pass) the FP8 product alone. The hooks stay off the base layers (lora_linear stands in
    only for an unhooked base)."""
    model = tiny_lora_model()
    fastgrpo.patch_model(model, fp8_base=True)
    layers = lora_layers(model)
    seen, handles = record_io(layers)
    ids = torch.randint(0, 80, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if disabled:
            with model.disable_adapter():
                model(ids)
        else:
            model(ids)
    for handle in handles:
        handle.remove()
    assert set(seen) == set(layers)
    for layer, (x, out) in seen.items():
        base = layer.base_layer
        adapters = [] if disabled else [(layer.lora_A[n].weight, layer.lora_B[n].weight, layer.scaling[n])
                                        for n in layer.active_adapters]
        want = lora_linear_of_checked_values(x, base.weight, base.bias, adapters, quantize_fp8(base.weight))
        assert torch.equal(out, want)
        assert not torch.equal(out, lora_linear_of_checked_values(x, base.weight, base.bias, adapters))


def test_copy_follows_the_weight_and_goes_with_unpatch():
    model = tiny_lora_model()
    fastgrpo.patch_model(model, fp8_base=True)
    layer = lora_layers(model)[0]
    base = layer.base_layer
    first = fp8_weight_of(base)
    assert fp8_weight_of(base)[0] is first[0], "the copy is made once while the weight stays"
    with torch.no_grad():
        base.weight.mul_(2)  # in place: the version counter moves
    assert torch.equal(fp8_weight_of(base)[1], 2 * first[1])
    base.weight = nn.Parameter(torch.ones_like(base.weight), requires_grad=False)  # replaced
    assert torch.equal(fp8_weight_of(base)[0].float(), quantize_fp8(base.weight)[0].float())
    fastgrpo.unpatch_model(model)
    assert not [m for m in model.modules() if FP8_WEIGHT_ATTR in m.__dict__]


def test_trains_and_odd_sides_stay_bf16():
    """A LoRA step runs end to end; a base whose sides _scaled_mm cannot take (an lm_head of 44 words) multiplies
    in bf16 with the op's plain bits."""
    model = tiny_lora_model(targets=["q_proj", "lm_head"], vocab=44)
    fastgrpo.patch_model(model, fp8_base=True, fused_loss=False)
    head = model.base_model.model.lm_head
    assert fp8_weight_of(head.base_layer) is None and fp8_weight_of(lora_layers(model)[0].base_layer) is not None
    seen, handles = record_io([head])
    ids = torch.randint(0, 44, (2, 7), generator=torch.Generator().manual_seed(2))
    model(ids).logits.float().square().mean().backward()
    handles[0].remove()
    x, out = seen[head]
    adapters = [(head.lora_A[n].weight, head.lora_B[n].weight, head.scaling[n]) for n in head.active_adapters]
    assert torch.equal(out, lora_linear_of_checked_values(x, head.base_layer.weight, None, adapters))
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("kwargs, words", [
    (dict(lora_dtype="adapter"), "fp8_base: runs in fastgrpo's LoRA forward, which needs fused_lora=True and "
                                 "lora_dtype='input'; got fused_lora=True, lora_dtype='adapter'"),
    (dict(fused_lora=False), "needs fused_lora=True"),
    (dict(fp8_base="yes"), "fp8_base: expected True or False, got 'yes'"),
])
def test_refused_settings(kwargs, words):
    with pytest.raises(ValueError, match=None) as caught:
        fastgrpo.patch_model(tiny_lora_model(), **{"fp8_base": True, **kwargs})
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_refused_without_a_linear_it_takes():
    """A model without LoRA layers is full fine-tuning's (tests/test_fp8_trained.py): refused where none of its
    decoder linears has sides _scaled_mm takes."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=80, hidden_size=40, intermediate_size=72, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=10))
    with pytest.raises(ValueError) as caught:
        fastgrpo.patch_model(model, fp8_base=True)
    assert str(caught.value) == (
        "fp8_base: multiplies the decoder's nn.Linear layers in FP8 (a LoRA model's frozen bases, or every one in "
        "full fine-tuning), and this LlamaForCausalLM has none of bf16 / fp16 / fp32 weights with both sides "
        "multiples of 16")
    assert "fastgrpo_patch_summary" not in model.__dict__


# ---- GPU -------------------------------------------------------------------------------------------------------

# (M, N, K): Llama-3.1-8B's q and k/v sides, gate, down, at 2048 tokens (the fp64 reference runs on the CPU);
# Qwen2.5-1.5B's down at a ragged M
GPU_SHAPES = [(2048, 4096, 4096), (2048, 1024, 4096), (2048, 14336, 4096), (2048, 4096, 14336), (1037, 1536, 8960)]


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K", GPU_SHAPES)
def test_gpu_product_matches_reference(M, N, K):
    """bf16 on the FP8 tensor cores (quantize_fp8's Triton pass, _scaled_mm) within bounds (a) and (b); the Triton
    quantizer gives the CPU's bytes."""
    x, q, scale, bias = make(torch.Generator().manual_seed(0), M, N, K, torch.bfloat16, device="cuda")
    on_gpu, on_cpu = quantize_fp8(x), quantize_rows(x.cpu())
    assert torch.equal(on_gpu[0].cpu().view(torch.uint8), on_cpu[0].view(torch.uint8))
    assert torch.equal(on_gpu[1].cpu(), on_cpu[1])
    check_product(x, q, scale, bias, GPU_ACC, f"gpu M{M} N{N} K{K}")
    check_product(x, q, scale, None, GPU_ACC, f"gpu M{M} N{N} K{K} no bias")


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K", GPU_SHAPES)
def test_gpu_input_grad_matches_reference(M, N, K):
    """g W on the FP8 tensor cores within bounds (a) and (b); the Triton quantizer of g * scale gives the CPU's
    bytes."""
    gen = torch.Generator().manual_seed(0)
    g = make(gen, M, 16, N, torch.bfloat16, device="cuda")[0]
    _, q, scale, _ = make(gen, 1, N, K, torch.bfloat16, device="cuda")
    on_gpu, on_cpu = quantize_fp8(g, column_scale=scale), quantize_rows(g.cpu().float() * scale.cpu())
    assert torch.equal(on_gpu[0].cpu().view(torch.uint8), on_cpu[0].view(torch.uint8))
    assert torch.equal(on_gpu[1].cpu(), on_cpu[1])
    got = fp8_input_grad(g, q, scale).cpu()
    g, q, scale = g.cpu(), q.cpu(), scale.cpu()
    ref, tol, rounding = input_grad_reference(g, q, scale, GPU_ACC)
    assert_within(got, ref, tol, f"gpu M{M} N{N} K{K} vs the reference")
    assert_within(got, g.double() @ (q.double() * scale.double()[:, None]), tol + rounding, "vs unquantized g")


@pytest.mark.gpu
def test_gpu_every_lora_layer_multiplies_in_fp8():
    model = tiny_lora_model().cuda()
    fastgrpo.patch_model(model, fp8_base=True)
    seen, handles = record_io(lora_layers(model))
    model(torch.randint(0, 80, (2, 7), device="cuda")).logits.float().square().mean().backward()
    for handle in handles:
        handle.remove()
    for layer, (x, out) in seen.items():
        base = layer.base_layer
        adapters = [(layer.lora_A[n].weight, layer.lora_B[n].weight, layer.scaling[n]) for n in layer.active_adapters]
        with torch.no_grad():
            want = lora_linear_of_checked_values(x, base.weight, base.bias, adapters, quantize_fp8(base.weight))
        assert torch.equal(out, want)
    assert all(torch.isfinite(p.grad).all() for n, p in model.named_parameters() if "lora_" in n)


# ---- the commands ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "8", "--no-patch"], "fp8_base: runs in patch_model's layers, and patch is off (pass --patch)"),
    (["--lora-rank", "0", "--no-patch"], "fp8_base: runs in patch_model's layers, and patch is off (pass --patch)"),
])
def test_commands_refuse_before_loading(argv, message, capsys):
    from fastgrpo.train.cli import main

    for command in ("train", "sft", "ei"):
        assert main([command, "--fp8-base", *argv]) == 2
        assert message in capsys.readouterr().err


def test_train_runs_with_fp8_base(tmp_path):
    """The built-in task's LoRA run (its linears' sides are multiples of 16: every base multiplies in FP8 on the CPU's
    _scaled_mm), the reference pass included."""
    import json

    from fastgrpo.train.cli import main

    assert main(["train", "--patch", "--fp8-base", "--lora-rank", "8", "--beta", "0.04", "--output-dir", str(tmp_path),
                 "--no-progress-bar", "--max-steps", "2"]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    from fastgrpo.train.checkpoint import CONFIG_FILE

    assert json.loads((tmp_path / "checkpoint-2" / CONFIG_FILE).read_text())["fp8_base"] is True


# ---- TRL's drop-in ---------------------------------------------------------------------------------------------

def test_trl_drop_in_trains_on_the_fp8_base(tmp_path_factory, tmp_path):
    """FastGRPOTrainer(fp8_base=True) with a peft_config: two TRL steps with beta > 0 (the reference pass through
    the disabled adapters), every LoRA layer's base multiplied through its e4m3 copy; refused without patch before TRL
    loads the model. Without a peft_config it is full fine-tuning: tests/test_trl_fp8_full.py."""
    from datasets import Dataset
    from peft import LoraConfig as PeftLoraConfig

    from fastgrpo.integrations.trl import FastGRPOTrainer
    from tests.test_trl import build_tokenizer, grpo_config, model_dir, vowel_reward

    def trainer(model, **kwargs):
        return FastGRPOTrainer(model=model, reward_funcs=vowel_reward, args=grpo_config(tmp_path, beta=0.04),
                               train_dataset=Dataset.from_dict({"prompt": ["2+2=", "abc"] * 4}),
                               processing_class=build_tokenizer(), fp8_base=True, **kwargs)

    lora = PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    run = trainer(model_dir.__wrapped__(tmp_path_factory), peft_config=lora)
    run.train()
    layers = lora_layers(run.model)
    assert len(layers) == 6 and all(FP8_WEIGHT_ATTR in layer.base_layer.__dict__ for layer in layers)
    with pytest.raises(ValueError) as caught:
        trainer("/nonexistent/model", patch=False, peft_config=lora)
    assert str(caught.value) == ("FastGRPOTrainer cannot honour: fp8_base: runs in fastgrpo.patch_model's layers; "
                                 "keep patch=True")
