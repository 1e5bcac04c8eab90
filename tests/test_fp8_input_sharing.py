"""quantized_input: a layer input read by several FP8 base linears (q, k and v; gate and up) is quantized once.

- In a patched LoRA model's forward, backward and recompute, one quantization per distinct input (4 a decoder layer:
  q/k/v's, o's, gate/up's, down's), and the same bits as a quantization per linear: outputs, adapter gradients,
  input gradients.
- The entry is of one tensor object at one version: an in-place change, or another tensor over the same bytes, is
  quantized again; the entry (and its e4m3 rows) goes with its tensor. Under torch.inference_mode (tensors without a
  version counter) and under torch.compile every linear quantizes its input: the model's output is no_grad's, and the
  engine's compiled decode step over the model's own weights gives the uncompiled step's tokens.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import fastgrpo
from fastgrpo.offload import ActivationOffloader
from fastgrpo.ops import fp8_base, lora
from fastgrpo.ops.fp8_base import _cpu_takes_row_scales, quantized_input
from fastgrpo.ops.fp8_linear import quantize_fp8
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams
from tests.test_fp8_base import tiny_lora_model
from tests.test_rollout import char_tokenizer

pytestmark = pytest.mark.skipif(not _cpu_takes_row_scales(), reason="this torch's CPU _scaled_mm takes no row scales")

LAYERS = 2  # tiny_lora_model's decoder layers


def quantize_per_linear(x):
    """What each linear did before quantized_input (through fp8_base's quantize_fp8: the spy counts it)."""
    return fp8_base.quantize_fp8(x.reshape(-1, x.shape[-1]))


def step(monkeypatch, share: bool, offload: bool):
    """(the loss's logits, {name: gradient} of the adapters and the embeddings' output, forward quantizations)."""
    model = tiny_lora_model()
    fastgrpo.patch_model(model, fp8_base=True, offload_activations=ActivationOffloader("cpu") if offload else False)
    model.train()
    ids = torch.randint(0, 80, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids)  # the base weights' e4m3 copies are made here, before the count
    if not share:
        monkeypatch.setattr(lora, "quantized_input", quantize_per_linear)
    calls = []
    counted = fp8_base.quantize_fp8

    def counting(x, *args, **kwargs):
        calls.append("input grad" if "column_scale" in kwargs else "input")
        return counted(x, *args, **kwargs)

    monkeypatch.setattr(fp8_base, "quantize_fp8", counting)
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeddings).logits
    (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    monkeypatch.undo()
    return logits.detach(), {**grads, "inputs_embeds": embeddings.grad}, calls


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload-recompute"])
def test_one_quantization_per_input_and_the_bits_of_one_per_linear(monkeypatch, offload):
    logits, grads, calls = step(monkeypatch, share=True, offload=offload)
    want_logits, want_grads, want_calls = step(monkeypatch, share=False, offload=offload)
    passes = 2 if offload else 1  # the recompute in the backward runs each layer's forward again
    assert calls.count("input") == 4 * LAYERS * passes, calls
    assert want_calls.count("input") == 7 * LAYERS * passes, want_calls
    assert calls.count("input grad") == want_calls.count("input grad") == 7 * LAYERS
    assert torch.equal(logits, want_logits)
    assert grads.keys() == want_grads.keys() and len(grads) == 7 * LAYERS * 2 + 1
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


def test_an_input_changed_in_place_is_quantized_again():
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    before = quantized_input(x)
    assert quantized_input(x) is before  # the sibling's call
    x.mul_(-3)
    after = quantized_input(x)
    assert after is not before
    assert torch.equal(after[0].view(torch.uint8), quantize_fp8(x)[0].view(torch.uint8))
    assert torch.equal(after[1], quantize_fp8(x)[1])


def test_another_tensor_over_the_same_bytes_is_quantized_for_itself():
    """Same address, shape and version, other values: the transposed view of one buffer."""
    buffer = torch.randn(160, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x, y = buffer.view(5, 32), buffer.view(32, 5).t()
    assert x.data_ptr() == y.data_ptr() and x.shape == y.shape and x._version == y._version
    quantized_input(x)
    got = quantized_input(y)
    want = quantize_fp8(y.contiguous())
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


def test_the_entry_goes_with_its_input():
    x = torch.randn(7, 48).to(torch.bfloat16)
    xq = weakref.ref(quantized_input(x)[0])
    del x
    gc.collect()
    assert fp8_base._last_input[0] is None and xq() is None


def test_inference_mode_quantizes_each_time_and_gives_no_grads_output():
    model = tiny_lora_model()
    fastgrpo.patch_model(model, fp8_base=True)
    model.eval()
    ids = torch.randint(0, 80, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids).logits
    with torch.inference_mode():
        got = model(ids).logits
        x = torch.randn(3, 32).to(torch.bfloat16)
        assert quantized_input(x) is not quantized_input(x)
    assert torch.equal(got, want)


def test_the_compiled_decode_step_over_the_models_own_weights_gives_the_eager_tokens(compiles):
    model = tiny_lora_model(vocab=128)
    fastgrpo.patch_model(model, fp8_base=True)
    model.eval()
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    tokens = {}
    for compile_step in (False, True):
        config = EngineConfig(weights="model", compile=compile_step, max_prompt_length=16)
        tokens[compile_step] = generate_with_config(model, char_tokenizer(), ["abc", "hello"], 2, params, seed=0,
                                                    config=config).completion_ids
    assert compiles.frame_count > 0
    assert torch.equal(tokens[True], tokens[False]), (tokens[True], tokens[False])


def test_the_compiled_decode_step_over_the_models_own_weights_compiles_no_frame_per_layer(compiles):
    """The e4m3 copy's key (its weight's address, one per layer) is not read in the compiled rollout step, which
    takes the copy the eager prefill just checked (fp8_copies_held): as many frames for 2 decoder layers as for 1 (reading it, dynamo
    compiled again for each linear of each layer, and past its limit of 8 ran the rest eagerly), and the eager
    tokens."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    frames, tokens = {}, {}
    for layers, compile_step in ((1, True), (2, True), (2, False)):
        model = fastgrpo.patch_model(tiny_lora_model(vocab=128, layers=layers), fp8_base=True)
        model.eval()
        torch._dynamo.reset()
        before = compiles.frame_count
        config = EngineConfig(weights="model", compile=compile_step, compile_scope="layers", max_prompt_length=16)
        tokens[layers, compile_step] = generate_with_config(model, char_tokenizer(), ["abc", "hello"], 2, params,
                                                            seed=0, config=config).completion_ids
        frames[layers, compile_step] = compiles.frame_count - before
    assert frames[1, True] == frames[2, True] > 0, frames
    assert torch.equal(tokens[2, True], tokens[2, False]), (tokens[2, True], tokens[2, False])


def test_a_compiled_forward_outside_a_rollout_sees_weights_changed_in_place(monkeypatch):
    """Only the rollout's decode holds the copies: a user's compiled no-grad forward, traced over copies an eager
    forward made, multiplies the new weights after they were loaded in place (a shortcut taken in every compiled
    no-grad forward gave the old copy's logits, without a word)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # torch's ops on the CPU: the interpreter is not traceable
    model = fastgrpo.patch_model(tiny_lora_model(), fp8_base=True)
    model.eval()
    ids = torch.randint(0, 80, (2, 9), generator=torch.Generator().manual_seed(5))
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        model(ids)  # the copies made
        compiled(ids)  # the compiled frames, over the copies
        new = {name: 2 * value for name, value in model.state_dict().items() if name.endswith("base_layer.weight")}
        model.load_state_dict(new, strict=False)
        got = compiled(ids).logits
        want = model(ids).logits
    torch._dynamo.reset()
    assert torch.equal(got, want), (got - want).abs().max()
