"""Per-architecture data of the patch table that the fp32 model tests cannot see (found by the patching mutation
audit): each mutant of these entries passed tests/test_patching*.py."""
import copy

import pytest
import torch

from fastgrpo.patching import patch_model
from tests.test_patching import CONFIGS, batch, tiny_model


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_rms_norm_of_bf16_activations_over_fp32_weights_rounds_and_promotes_as_hf(model_type):
    """bf16 activations through fp32 norm weights (PEFT's prepare_model_for_kbit_training keeps norms in fp32):
    Llama-like norms round x * rstd to bf16 and multiply by the fp32 weight (an fp32 output), Gemma's multiply in fp32
    and round once to bf16. In an fp32 model both read alike, so the table's norm_cast_before_weight swapped for one
    family passed every other test. Tolerance: the kernel's rstd may differ from torch's rsqrt in the last fp32 bit,
    which can move the output's bf16 rounding by one bf16 ulp (at most bf16's eps, 2^-7, relative); a wrong rounding
    order changes the output's dtype."""
    model = tiny_model(model_type)
    norm = model.model.norm if hasattr(model.model, "norm") else model.model.language_model.norm
    torch.manual_seed(0)
    x = torch.randn(2, 5, norm.weight.shape[0]).bfloat16()
    with torch.no_grad():
        want = norm(x)
        patch_model(model)
        assert "forward" in norm.__dict__
        got = norm(x)
    assert got.dtype == want.dtype, f"{model_type}: patched RMSNorm gives {got.dtype}, HF's {want.dtype}"
    bf16_ulp = torch.finfo(torch.bfloat16).eps
    err = ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-6)).max().item()
    assert err <= bf16_ulp, f"{model_type}: relative error {err:.3g} > one bf16 ulp {bf16_ulp:.3g}"


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_patched_attention_runs_fastgrpos_rotary(model_type, monkeypatch):
    """Each attention layer's forward rotates q and k through fastgrpo's apply_rotary, once per layer and call: an
    attention forward copied without the override computes HF's rotary, the same numbers, so the summary's rope
    count alone told nothing (a mutant that dropped the override passed the suite)."""
    import fastgrpo.patching.forwards as forwards

    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return forwards.apply_rotary.__wrapped__(*args, **kwargs)

    counting.__wrapped__ = forwards.apply_rotary
    monkeypatch.setattr(forwards, "apply_rotary", counting)
    model = tiny_model(model_type)
    patch_model(model)
    ids, mask = batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert len(calls) == model.config.num_hidden_layers


@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh", "gelu_new", "gelu_python_tanh"])
def test_each_activation_of_the_table_fuses_the_same_function(hidden_act):
    """Every hidden_act whose activation class the table maps to a fused kernel gives HF's MLP output and gradients.
    The suite drew hidden_act with hypothesis (12 examples) and never drew gelu_new: mapping NewGELUActivation to
    SiLU passed it. fp32; the bound of test_patching's fp32 comparisons."""
    import transformers

    from fastgrpo.hf.architectures import ACTIVATIONS

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      vocab_size=16, hidden_act=hidden_act)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    act = type(model.model.layers[0].mlp.act_fn).__name__
    if act not in ACTIVATIONS:
        pytest.skip(f"{hidden_act}: {act} has no fused kernel in this transformers")
    reference = copy.deepcopy(model.model.layers[0].mlp)
    patch_model(model, rms_norm=False, rope=False, fused_loss=False)
    mlp = model.model.layers[0].mlp
    assert "forward" in mlp.__dict__
    x = torch.randn(2, 5, 32) * 2  # activations past +-2, where SiLU and the GELUs differ most
    outs, grads = [], []
    for module in (reference, mlp):
        xi = x.clone().requires_grad_()
        out = module(xi)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append([xi.grad] + [p.grad for p in module.parameters()])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
