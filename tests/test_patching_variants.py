"""patch_model on the configuration variants released checkpoints of the supported families use (rope scaling of
every type, partial rotary, biases, head_dim != hidden / heads, tied or untied embeddings, soft-caps, sliding
windows, activations, norm epsilons, a vocabulary not a multiple of 8), with and without PEFT LoRA.

The oracle is eager HF on the unpatched model (same weights): its logits (soft-capped as its forward does), their
log_softmax and fastgrpo.loss.grpo's per-token GRPO math on them, and its labels= loss. The patched side is what
training runs: grpo_loss (fused lm_head + loss) through the patched backbone, and the patched forward's labels= loss.
fp32 on the CPU with the kernels under Triton's interpreter, judged as tests/test_patching.py judges them (its
interpreter truncates fp32 -> bf16: bf16 is its GPU test's matter).
"""
import copy

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from fastgrpo.loss.grpo import aggregation_weights, grpo_per_token_loss
from fastgrpo.loss.model import grpo_loss
from fastgrpo.patching import patch_model
from tests.test_patching import assert_fp32_grads_close

VOCAB = 131  # not a multiple of 8
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
B, T, PROMPT = 2, 12, 4  # T past every sliding window and original context below: the long-context paths run
LOSS = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.28, loss_type="grpo")


def _longrope(rotary_dim: int) -> dict:
    """Phi-3-mini-128k / Phi-3.5-mini / Phi-4-mini rope: a short and a long factor per frequency, the long ones
    past original_max_position_embeddings."""
    half = rotary_dim // 2
    return dict(
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + i / half for i in range(half)],
                          long_factor=[2.0 + 3 * i / half for i in range(half)]),
        original_max_position_embeddings=8, max_position_embeddings=32,
    )


def _gemma3(**text) -> transformers.Gemma3Config:
    """Gemma-3 4B and up: the text model inside Gemma3ForConditionalGeneration (model_type gemma3)."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return transformers.Gemma3Config(text_config={**SHAPE, **text}, vision_config=vision, mm_tokens_per_image=4)


GEMMA3_TEXT = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=100.0, rope_theta=1e6)
# name -> a function of the fields over SHAPE, and those fields: ways released checkpoints configure each family
VARIANTS = {
    "llama-3.1: llama3 rope, untied": (transformers.LlamaConfig, dict(
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8), rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-3.2: tied, head_dim 16": (transformers.LlamaConfig, dict(tie_word_embeddings=True, head_dim=16)),
    "llama: attention_bias, mlp_bias": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
    "llama: dynamic rope past max_position_embeddings": (transformers.LlamaConfig, dict(
        rope_scaling=dict(rope_type="dynamic", factor=2.0), max_position_embeddings=8)),
    "llama: exact gelu (no fused kernel)": (transformers.LlamaConfig, dict(hidden_act="gelu")),
    "mistral: sliding_window, head_dim 16": (transformers.MistralConfig, dict(sliding_window=4, head_dim=16)),
    "qwen2.5: tied, sliding windows in later layers": (transformers.Qwen2Config, dict(
        tie_word_embeddings=True, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen2.5: yarn rope": (transformers.Qwen2Config, dict(
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16))),
    "qwen3: head_dim 16, q/k norms, tied": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True)),
    "gemma: head_dim 24, gelu_pytorch_tanh": (transformers.GemmaConfig, dict(
        head_dim=24, hidden_activation="gelu_pytorch_tanh")),
    "gemma2: soft-caps, query_pre_attn_scalar, sliding": (transformers.Gemma2Config, dict(
        head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=0.5, final_logit_softcapping=0.2,
        sliding_window=4)),
    "gemma3_text: local/global rope bases, linear global scaling": (transformers.Gemma3TextConfig, dict(
        **GEMMA3_TEXT, rope_scaling=dict(rope_type="linear", factor=8.0))),
    "gemma3_text: final soft-cap, untied": (transformers.Gemma3TextConfig, dict(
        **GEMMA3_TEXT, final_logit_softcapping=0.3, tie_word_embeddings=False)),
    "gemma3: the multimodal model's text": (_gemma3, dict(**GEMMA3_TEXT, final_logit_softcapping=0.3)),
    "phi3-mini-128k: longrope": (transformers.Phi3Config, _longrope(12)),
    "phi4-mini: partial rotary 0.75, longrope, tied": (transformers.Phi3Config, dict(
        num_attention_heads=3, num_key_value_heads=1, partial_rotary_factor=0.75, tie_word_embeddings=True,
        **_longrope(12))),  # head_dim 16 (Phi-4-mini's 128), of which 12 rotate
}
SKIPPED = {"llama: exact gelu (no fused kernel)": {"swiglu": "LlamaMLP: activation GELUActivation has no fused kernel"}}
# LoRA where the variant changes a projection or what PEFT wraps: biases of the base linears, Phi-3's fused
# projections, vision-tower linears the text forward never calls (the drawn test below puts LoRA on the others)
WITH_LORA = ["llama: attention_bias, mlp_bias", "phi4-mini: partial rotary 0.75, longrope, tied",
             "gemma3: the multimodal model's text"]
NOT_RUN = ("model.vision_tower.", "model.multi_modal_projector.")  # Gemma-3's, without images
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                "gate_up_proj"]


def build(make_config, fields: dict, lora: bool) -> torch.nn.Module:
    config = make_config(**copy.deepcopy(fields))  # configs write into the rope dicts given
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for p in model.parameters():  # norm weights start at 1 (0 for Gemma), biases at 0: randomize both
        if p.dim() == 1:
            torch.nn.init.normal_(p, 0.0, 0.5)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    targets = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules()} & set(LORA_TARGETS))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at 0: make the adapters do something
            torch.nn.init.normal_(p, 0.0, 0.1)
    return model


def rollout(vocab: int):
    """Left padding, completions of two lengths (right padding), advantages of both signs."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab, (B, T), generator=g)
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[1, :2] = 0
    completion_mask = torch.zeros(B, T, dtype=torch.long)
    completion_mask[:, PROMPT:] = 1
    completion_mask[0, T - 2:] = 0
    attention_mask[0, T - 2:] = 0
    return input_ids, attention_mask, completion_mask, torch.tensor([1.0, -0.7])


def eager_hf_step(model, input_ids, attention_mask, completion_mask, advantages):
    """The oracle: HF's logits, their log_softmax, the GRPO loss and its gradients. Returns (loss, per-token
    log-probs [B, T] (position t: token t; 0 outside completions), gradients, old and ref log-probs near them)."""
    model.zero_grad()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    logps = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    logps = torch.cat((torch.zeros(B, 1), logps), 1) * completion_mask
    g = torch.Generator().manual_seed(1)
    old, ref = ((logps.detach() + 0.1 * torch.randn(B, T, generator=g) * completion_mask).clamp(max=0.0)
                for _ in range(2))
    mask = completion_mask.float()
    terms = {k: v for k, v in LOSS.items() if k != "loss_type"}
    per_token, *_ = grpo_per_token_loss(logps, mask, advantages, old, ref, **terms)
    loss = (per_token * aggregation_weights(mask, LOSS["loss_type"])).sum()
    loss.backward()
    return loss.detach(), logps.detach(), _grads(model), old, ref


def patched_step(model, input_ids, attention_mask, completion_mask, advantages, old_logps, ref_logps):
    model.zero_grad()
    loss, metrics = grpo_loss(model, input_ids, attention_mask, completion_mask, advantages, old_logps=old_logps,
                              ref_logps=ref_logps, return_logps=True, **LOSS)
    loss.backward()
    return loss.detach(), metrics["logps"], _grads(model)


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grpo_step(model, patched) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One GRPO step of eager HF `model` and of `patched` (its patch_model copy) on the same rollout: the same
    per-token log-probs, loss and gradients. Returns the rollout's ids and mask, and the eager gradients."""
    ids, mask, completion, advantages = rollout(patched.get_output_embeddings().weight.shape[0])
    loss, logps, grads, old, ref = eager_hf_step(model, ids, mask, completion, advantages)
    loss_p, logps_p, grads_p = patched_step(patched, ids, mask, completion, advantages, old, ref)
    torch.testing.assert_close(logps_p, logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_p, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_p.keys() and grads
    assert_fp32_grads_close(grads_p, grads)
    return ids, mask, grads


def assert_patched_matches_eager_hf(model, lora: bool, skipped: dict | None = None) -> None:
    patched = patch_model(copy.deepcopy(model))
    summary = patched.fastgrpo_patch_summary
    layers = patched.config.get_text_config().num_hidden_layers
    assert summary["skipped"] == (skipped or {})
    assert summary["patched"]["rope"] == layers and summary["patched"]["rms_norm"] >= 2 * layers + 1
    assert summary["patched"].get("swiglu", 0) == (0 if skipped else layers)
    assert summary["patched"].get("fused_lora", 0) > 0 if lora else "fused_lora" not in summary["patched"]

    ids, mask, grads = assert_same_grpo_step(model, patched)
    trained = [n for n, _ in model.named_parameters() if not n.startswith(NOT_RUN)]
    assert all("lora_" in n for n in grads) if lora else sorted(grads) == sorted(trained)

    # The patched forward's own labels= loss (fused, training mode), soft-capped as the config says.
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        want = model.train()(input_ids=ids, attention_mask=mask, labels=labels).loss
        out = patched.train()(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_eager_hf(name):
    make_config, fields = VARIANTS[name]
    assert_patched_matches_eager_hf(build(make_config, {**SHAPE, **fields}, lora=False), lora=False,
                                    skipped=SKIPPED.get(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_LORA)
def test_variant_with_lora_matches_eager_hf(name):
    make_config, fields = VARIANTS[name]
    assert_patched_matches_eager_hf(build(make_config, {**SHAPE, **fields}, lora=True), lora=True)


ROPE_SCALINGS = [
    None, dict(rope_type="linear", factor=2.0), dict(rope_type="dynamic", factor=2.0),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=2),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8),
]
LLAMA_LIKE = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
              "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}


@given(
    family=st.sampled_from(sorted(LLAMA_LIKE)),
    biases=st.booleans(),
    tied=st.booleans(),
    head_dim=st.sampled_from([12, 16, 20]),
    rope_scaling=st.sampled_from(ROPE_SCALINGS),
    hidden_act=st.sampled_from(["silu", "gelu_pytorch_tanh", "gelu_new"]),
    rms_norm_eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
    vocab=st.sampled_from([97, 128, 131]),
    lora=st.booleans(),
)
def test_drawn_llama_like_config_matches_eager_hf(family, biases, tied, head_dim, rope_scaling, hidden_act,
                                                  rms_norm_eps, vocab, lora):
    """The fields of the llama-like families drawn together (one layer: the layer count changes no per-layer math).
    Mistral and Qwen2 have no bias switch (Qwen2's q/k/v always have biases)."""
    fields = dict(SHAPE, num_hidden_layers=1, vocab_size=vocab, tie_word_embeddings=tied, head_dim=head_dim,
                  rope_scaling=rope_scaling, hidden_act=hidden_act, rms_norm_eps=rms_norm_eps, max_position_embeddings=8)
    if family in ("llama", "qwen3"):
        fields["attention_bias"] = biases
    if family == "llama":
        fields["mlp_bias"] = biases
    assert_patched_matches_eager_hf(build(LLAMA_LIKE[family], fields, lora), lora)
