"""4-bit bitsandbytes bases (QLoRA) on the CPU: bitsandbytes >= 0.46 runs NF4 layers there (slowly, tiny shapes).

The same model objects serve the rollout engine, patch_model and the fused loss: greedy rollouts equal HF
generate on the 4-bit model with its LoRA adapter active, and a patched 4-bit model gives the same log-probs and
LoRA gradients as the unpatched one. fused_lora on PEFT's bitsandbytes LoRA classes (Linear4bit, Linear8bitLt):
lora_dtype "adapter": forward and one-chunk gradients bitwise PEFT's; "input" (the default): within lora_add's
rounding bound of fp64; both save the input instead of fp32 copies; fallbacks run PEFT.
"""
import contextlib
import copy
import types

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.helpers import disable_input_dtype_casting  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config  # noqa: E402

import fastgrpo  # noqa: E402
from fastgrpo.hf.architectures import loaded_lora_classes
from fastgrpo.patching.forwards import lora_linear_forward  # noqa: E402
from fastgrpo.rollout import generate  # noqa: E402
from tests.test_lora import (  # noqa: E402
    LORA_ADD_ROUNDINGS, PEFT_BITWISE, assert_within, branch_exact, loss_and_grads, rounding_bound, saved_tensors,
)
from tests.test_rollout import PROMPTS, SIZES, char_tokenizer, completions, hf_greedy  # noqa: E402


@pytest.fixture
def qlora_model(tmp_path):
    # One model per test: on CPUs with AVX512-BF16, bitsandbytes 0.50 repacks 4-bit weights at the first eval-mode
    # forward, after which its training forward fails (in-place bias add on the inference path), with or without
    # fastgrpo: a rollout must not run before training on the same CPU model.
    torch.manual_seed(0)
    path = tmp_path
    AutoModelForCausalLM.from_config(Qwen2Config(**SIZES)).save_pretrained(path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu")
    assert type(base.model.layers[0].mlp.gate_proj).__name__ == "Linear4bit"
    # init_lora_weights=False: a non-zero adapter, so "adapter active" changes the outputs
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False)
    return get_peft_model(base, lora).eval()


def test_rollout_of_a_4bit_base_with_lora_equals_hf_generate(qlora_model):
    tok = char_tokenizer()
    result = generate(qlora_model, tok, PROMPTS, max_new_tokens=12, temperature=0)
    for i, prompt in enumerate(PROMPTS):
        assert completions(result)[i] == hf_greedy(qlora_model, tok, prompt, 12)[0]
    with qlora_model.disable_adapter():
        without_adapter = generate(qlora_model, tok, PROMPTS, max_new_tokens=12, temperature=0)
    assert completions(without_adapter) != completions(result)


def test_patched_4bit_model_matches_unpatched(qlora_model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, SIZES["vocab_size"], (2, 12), generator=g)
    attention = torch.ones_like(ids)
    completion = torch.zeros_like(ids)
    completion[:, 6:] = 1
    advantages = torch.tensor([1.0, -0.5])

    def loss_and_lora_grads(model):
        model.train()
        model.zero_grad()
        loss, _ = fastgrpo.grpo_loss(model, ids, attention, completion, advantages, loss_type="grpo")
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    patched = fastgrpo.patch_model(copy.deepcopy(qlora_model))
    summary = patched.base_model.model.fastgrpo_patch_summary["patched"]
    assert summary["swiglu"] == SIZES["num_hidden_layers"]
    assert summary["fused_lora"] == 3 * SIZES["num_hidden_layers"]  # q_proj, v_proj, gate_proj
    loss, grads = loss_and_lora_grads(qlora_model)
    loss_p, grads_p = loss_and_lora_grads(patched)
    torch.testing.assert_close(loss_p, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_p.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads_p[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        ref = fastgrpo.sequence_logprobs(patched, ids, attention, completion, disable_adapter=True)
        pol = fastgrpo.sequence_logprobs(patched, ids, attention, completion)
    assert not torch.allclose(ref, pol)  # the reference really is the 4-bit base without the adapter


def test_export_merges_lora_into_the_dequantized_base(qlora_model, tmp_path):
    from fastgrpo.train.final_export import export_model

    out = export_model(qlora_model, None, tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert getattr(merged.config, "quantization_config", None) is None
    assert all(type(m).__name__ != "Linear4bit" for m in merged.modules())
    ids = torch.randint(3, SIZES["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(2))
    qlora_model.train()  # see the fixture: no eval-mode forward on this CPU model
    with torch.no_grad():
        want = qlora_model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        with qlora_model.disable_adapter():
            without_adapter = qlora_model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(without_adapter, want, atol=1e-3)  # the adapter was merged, not dropped


def test_fused_4bit_lora_layers_match_unpatched(qlora_model, delta_calls):
    """fused_lora alone: logits bitwise; LoRA grads to fp32 rounding (dx of q and v adds up in another order)."""
    qlora_model.train()  # see the fixture: no eval-mode forward on this CPU model
    patched = fastgrpo.patch_model(copy.deepcopy(qlora_model), **PEFT_BITWISE)
    layers = SIZES["num_hidden_layers"]
    assert patched.base_model.model.fastgrpo_patch_summary["patched"] == {"fused_lora": 3 * layers}
    ids = torch.randint(3, SIZES["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    logits, grads = loss_and_grads(qlora_model, ids, mask)
    logits_p, grads_p = loss_and_grads(patched, ids, mask)
    assert len(delta_calls) == 3 * layers
    assert torch.equal(logits_p, logits)
    assert grads.keys() == grads_p.keys() and len(grads) == 2 * 3 * layers
    for name in grads:
        torch.testing.assert_close(grads_p[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


# --- one PEFT bitsandbytes LoRA layer ------------------------------------------------------------------------------


class QuantizedProj(nn.Module):
    """One bitsandbytes linear (NF4 or int8) named as PEFT targets it, with the flag PEFT reads off a quantized
    transformers model to pick its bnb LoRA class."""

    def __init__(self, bits: int, in_features: int, out_features: int, compute_dtype: torch.dtype) -> None:
        super().__init__()
        setattr(self, f"is_loaded_in_{bits}bit", True)
        weight = nn.Linear(in_features, out_features).weight.data
        if bits == 4:
            self.proj = bnb.nn.Linear4bit(in_features, out_features, compute_dtype=compute_dtype, quant_type="nf4")
            self.proj.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
        else:
            self.proj = bnb.nn.Linear8bitLt(in_features, out_features, has_fp16_weights=False)
            self.proj.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def quantized_lora_layer(bits, in_features, out_features, r, alpha, x_dtype, adapter_dtype, seed=0, **config):
    """PEFT's bnb.Linear4bit / Linear8bitLt around a frozen quantized linear (quantized by .to("cpu")), in
    training mode (see the fixture above); init_lora_weights=False: B is not zero."""
    torch.manual_seed(seed)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], init_lora_weights=False, **config)
    base = QuantizedProj(bits, in_features, out_features, x_dtype).to("cpu")
    layer = get_peft_model(base, lora, autocast_adapter_dtype=False).base_model.model.proj
    assert type(layer).__module__ == "peft.tuners.lora.bnb"
    for name, p in layer.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)
    return layer.train()


def fused(layer, lora_dtype="adapter"):
    """The forward patch_model binds on the layer, found in the same table (lora_dtype "adapter": bitwise PEFT)."""
    forward = lora_linear_forward(layer.forward, loaded_lora_classes()[type(layer)], lora_dtype)
    return types.MethodType(forward, layer)


def out_and_grads(layer, forward, x, grad_out, **kwargs):
    """Output and the gradients of x, lora_A and lora_B (None where one gets none)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = forward(x, **kwargs)
    if out.requires_grad:
        out.backward(grad_out.to(out.dtype))
    return [out.detach(), x.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad]


def assert_bitwise(got, want):
    for name, a, b in zip(["out", "dx", "dA", "dB"], got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name


BITS = [4, 8]
# (x and compute dtype, adapter dtype): bf16 x on fp32 adapters rounds each delta to bf16 before the add (PEFT's
# bnb casts), where peft.tuners.lora.layer.Linear adds in fp32: a forward of the wrong class is not bitwise.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtypes", DTYPES, ids=str)
@pytest.mark.parametrize("n, in_features, out_features, r, alpha", [(7, 47, 33, 3, 6), (13, 64, 40, 8, 32)])
def test_fused_quantized_layer_is_bitwise_peft(bits, dtypes, n, in_features, out_features, r, alpha, delta_calls):
    layer = quantized_lora_layer(bits, in_features, out_features, r, alpha, *dtypes)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, n, in_features, generator=g).to(dtypes[0])
    grad_out = torch.randn(2, n, out_features, generator=g)
    want = out_and_grads(layer, layer.forward, x, grad_out)
    got = out_and_grads(layer, fused(layer), x, grad_out)
    assert delta_calls == ["lora_delta"]
    assert want[0].dtype == dtypes[0]
    assert_bitwise(got, want)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_quantized_layer_in_the_input_dtype_is_within_the_bound(bits, x_dtype, delta_calls):
    """lora_dtype "input" on fp32 adapters: the output and the adapters' gradients within lora_add's bound of fp64 on
    the base layer's own output (a bf16 delta_in_result_dtype layer adds in bf16 anyway: one rounding, in the GEMM)."""
    n, in_features, out_features, r = 13, 64, 40, 8
    layer = quantized_lora_layer(bits, in_features, out_features, r, 32, x_dtype, torch.float32)
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2, n, in_features, generator=g).to(x_dtype)
    grad_out = torch.randn(2, n, out_features, generator=g).to(x_dtype)
    out, _, grad_a, grad_b = out_and_grads(layer, fused(layer, "input"), x, grad_out)
    assert delta_calls == ["lora_add"] and out.dtype == x_dtype
    a, b, scaling = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    with torch.no_grad():
        inputs = (layer.base_layer(x), x, a, b)
    exact = branch_exact(*(t.double() for t in inputs), scaling, grad_out.double())
    magnitude = branch_exact(*(t.double().abs() for t in inputs), scaling, grad_out.double().abs())
    rel = rounding_bound(x_dtype, LORA_ADD_ROUNDINGS, 2 * n + in_features + out_features + r + 2)
    for i, name, got in [(0, "out", out), (3, "dA", grad_a), (4, "dB", grad_b)]:
        assert_within(name, got, exact[i], magnitude[i], rel)


@pytest.mark.parametrize("lora_dtype", ["input", "adapter"])
@pytest.mark.parametrize("bits", BITS)
def test_quantized_layers_save_the_input_not_fp32_copies(bits, lora_dtype):
    """q, k and v analogues on one bf16 input with fp32 adapters: PEFT's bnb layers save three fp32 copies of it
    (4 B per element each); the fused layers save the input itself (2 B per element, once). The bnb base layers
    keep theirs on ctx attributes, unseen by saved-tensor hooks, on both sides."""
    layers = [quantized_lora_layer(bits, 64, 40, 4, 8, torch.bfloat16, torch.float32, seed=s) for s in range(3)]
    x = torch.randn(2, 9, 64, dtype=torch.bfloat16, requires_grad=True)  # x: [B, T, in]

    def activations(forwards):
        saved = saved_tensors(lambda: [f(x) for f in forwards])
        # the parameters' addresses after the forward: bitsandbytes' first 8-bit forward replaces its weight's
        # storage, and a saved activation may then be allocated at the freed address
        params = {p.data_ptr() for m in layers for p in m.parameters()}
        unique = {t.untyped_storage().data_ptr(): t for t in saved if t.data_ptr() not in params}
        return list(unique.values())

    def inputs(saved):  # tensors of x's size
        return [t for t in saved if t.numel() == x.numel() and t.shape[-1] == x.shape[-1]]

    peft_saved = activations([m.forward for m in layers])
    fused_saved = activations([fused(m, lora_dtype) for m in layers])
    assert [t.dtype for t in inputs(peft_saved)] == [torch.float32] * 3
    assert [t.data_ptr() for t in inputs(fused_saved)] == [x.data_ptr()]
    nbytes = [sum(t.nbytes for t in s) for s in (peft_saved, fused_saved)]
    r_outputs = 3 * 2 * 9 * 4 * 4  # the [N, r] fp32 lora_A outputs PEFT keeps ("input": bf16, half of it)
    # "input" also keeps the adapters' bf16 casts for the backward: r x (in + out) each, not per token
    casts = 3 * 2 * (4 * 64 + 40 * 4) if lora_dtype == "input" else 0
    fused_bytes = x.numel() * 2 + r_outputs // (2 if lora_dtype == "input" else 1) + casts
    assert nbytes == [3 * x.numel() * 4 + r_outputs, fused_bytes]


@contextlib.contextmanager
def cuda_autocast_flag():
    """PEFT's bnb layers read torch.is_autocast_enabled() (CUDA's): set on a CPU build without a CUDA autocast."""
    torch.set_autocast_enabled("cuda", True)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", False)


QUANTIZED_FALLBACKS = {
    "dropout_in_training": (dict(lora_dropout=0.5), contextlib.nullcontext),
    "dora": (dict(use_dora=True), contextlib.nullcontext),
    "lora_bias": (dict(lora_bias=True), contextlib.nullcontext),
    "merged": ({}, contextlib.nullcontext),
    "disabled": ({}, contextlib.nullcontext),
    # PEFT's mixed batch adds into the bnb base's output in place, which autograd refuses: no grad.
    "adapter_names": ({}, torch.no_grad),
    "cpu_autocast": ({}, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
    "cuda_autocast": ({}, cuda_autocast_flag),
    "no_input_cast": ({}, None),
}


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("case", QUANTIZED_FALLBACKS)
def test_quantized_cases_outside_the_vanilla_branch_run_peft(bits, case, delta_calls):
    if (bits, case) == (8, "dora"):
        pytest.skip("after PEFT's DoRA init, bitsandbytes 0.50's int8 base forward fails on the CPU, fastgrpo or not")
    config, context = QUANTIZED_FALLBACKS[case]
    layer = quantized_lora_layer(bits, 48, 40, 4, 8, torch.float32, torch.float32, **config)
    context = context or (lambda: disable_input_dtype_casting(layer))
    kwargs = {}
    if case == "merged":
        layer.merge()
    if case == "disabled":
        layer.enable_adapters(False)
    if case == "adapter_names":  # a mixed batch: PEFT allows it in eval mode only
        layer.eval()
        kwargs = dict(adapter_names=["default", "__base__"])
    x, grad_out = torch.randn(2, 5, 48), torch.randn(2, 5, 40)
    results = []
    for forward in (layer.forward, fused(layer, "input")):  # patch_model's default
        torch.manual_seed(5)  # the same dropout masks
        with context():
            results.append(out_and_grads(layer, forward, x, grad_out, **kwargs))
    assert delta_calls == []
    assert_bitwise(results[1], results[0])


@pytest.mark.parametrize("lora_dtype", ["input", "adapter"])
def test_4bit_output_is_cloned_as_in_peft(lora_dtype):
    """PEFT clones the 4-bit base output, a view made by bitsandbytes' autograd Function: with no adapter of the
    layer active (the active one targets other modules) that clone is the output, and in-place ops on it work."""
    layer = quantized_lora_layer(4, 48, 40, 4, 8, torch.float32, torch.float32)
    layer._active_adapter = ["elsewhere"]
    x = torch.randn(2, 5, 48, requires_grad=True)
    outputs = [forward(x).mul_(2) for forward in (layer.forward, fused(layer, lora_dtype))]
    assert torch.equal(outputs[1], outputs[0])
