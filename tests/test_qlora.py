"""4-bit bitsandbytes bases (QLoRA) on the CPU: bitsandbytes >= 0.46 runs NF4 layers there (slowly, tiny shapes).

The same model objects serve the rollout engine, patch_model and the fused loss: greedy rollouts equal HF
generate on the 4-bit model with its LoRA adapter active, and a patched 4-bit model gives the same log-probs and
LoRA gradients as the unpatched one.
"""
import copy

import pytest
import torch

pytest.importorskip("bitsandbytes")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config  # noqa: E402

import fastgrpo  # noqa: E402
from fastgrpo.rollout import generate  # noqa: E402
from tests.test_rollout import EOS, PAD, PROMPTS, SIZES, char_tokenizer, completions, hf_greedy  # noqa: E402


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
    assert patched.base_model.model.fastgrpo_patch_summary["patched"]["swiglu"] == SIZES["num_hidden_layers"]
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
    from fastgrpo.checkpoint import export_model

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
