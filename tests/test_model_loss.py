"""fastgrpo.loss.model: grpo_loss and sequence_logprobs of a model against the eager oracle on its hidden states."""
import copy
import os

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from fastgrpo.loss import reference
from fastgrpo.loss.correction import RolloutCorrection
from fastgrpo.loss.grpo import aggregation_weights, grpo_per_token_loss
from fastgrpo.loss.model import grpo_loss, sequence_logprobs
from fastgrpo.patching import patch_model

B, T, PROMPT = 3, 11, 5
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors reach Triton only under TRITON_INTERPRET=1",
    )),
]


def tiny_qwen2(seed=0, attn_implementation="eager", **overrides):
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0, **overrides,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tiny_gemma2(softcap, seed=0):
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=softcap, pad_token_id=0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def rollout_batch(seed=0):
    """Left-padded prompts of PROMPT columns, then completions of varying length (right padding)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 128, (B, T), generator=g)
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[0, :2] = 0
    completion_mask = torch.zeros(B, T, dtype=torch.long)
    completion_mask[:, PROMPT:] = 1
    completion_mask[1, T - 3 :] = 0  # a shorter completion
    attention_mask[1, T - 3 :] = 0
    return input_ids, attention_mask, completion_mask


def eager_logps(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.double() / temperature
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat((torch.zeros(B, 1, dtype=logps.dtype), logps), 1) * completion_mask


def reference_loss(model, input_ids, attention_mask, completion_mask, advantages, **options):
    """reference.grpo_loss on all T - 1 shifted positions (the oracle: no window, logits materialized)."""
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]

    def shift(t):
        return t if t is None or t.dim() == 1 else t[:, 1:]

    for name in ("old_logps", "ref_logps"):
        options[name] = shift(options.get(name))
    return reference.grpo_loss(
        hidden, model.lm_head.weight, input_ids[:, 1:], completion_mask[:, 1:], shift(advantages), **options
    )


def test_sequence_logprobs_alignment_and_values():
    model = tiny_qwen2()
    ids, mask, completion = rollout_batch()
    patched = patch_model(copy.deepcopy(model))
    want = eager_logps(model, ids, mask, completion, temperature=0.7)
    logps, entropy = sequence_logprobs(patched, ids, mask, completion, temperature=0.7, return_entropy=True)
    assert logps.shape == (B, T) and logps.dtype == torch.float32 and not logps.requires_grad
    torch.testing.assert_close(logps.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.all(logps[completion == 0] == 0) and torch.all(entropy[completion == 0] == 0)
    assert torch.all(entropy[completion == 1] > 0)


OPTION_SETS = {
    "bnpo_token_old_ref": dict(loss_type="bnpo", beta=0.05, old=True, ref=True),
    "grpo_sequence_per_token_adv": dict(loss_type="grpo", importance_sampling_level="sequence", old=True, adv_2d=True),
    "dr_grpo_temperature_on_policy": dict(loss_type="dr_grpo", max_completion_length=T - PROMPT, temperature=0.8),
}


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_grpo_loss_matches_reference(name):
    options = dict(OPTION_SETS[name])
    old, ref, adv_2d = options.pop("old", False), options.pop("ref", False), options.pop("adv_2d", False)
    model = tiny_qwen2(1)
    patched = patch_model(copy.deepcopy(model))
    ids, mask, completion = rollout_batch(1)
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn((B, T) if adv_2d else (B,), generator=g)
    with torch.no_grad():
        base = eager_logps(model, ids, mask, completion).float()
    if old:
        options["old_logps"] = (base + 0.2 * torch.randn(B, T, generator=g) * completion).clamp(max=0.0)
    if ref:
        options["ref_logps"] = (base + 0.3 * torch.randn(B, T, generator=g) * completion).clamp(max=0.0)
    loss, metrics = grpo_loss(patched, ids, mask, completion, advantages, **options)
    want, want_metrics = reference_loss(model, ids, mask, completion, advantages, **options)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for key in want_metrics:
        torch.testing.assert_close(metrics[key], want_metrics[key], rtol=1e-5, atol=1e-6)
    loss.backward()
    want.backward()
    grads = dict(model.named_parameters())
    for n, p in patched.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-4, atol=1e-6, msg=n)


def ragged_batch(seed=4):
    """4 rows laid out as the trainer lays out a rollout: prompts of 5, 3, 4 and 2 tokens left-padded to 5 columns,
    completions of 6, 3, 0 and 1 tokens, right-padded to 7 (the last column holds no completion token: it is
    outside the loss's window)."""
    prompts, completions, P, L = [5, 3, 4, 2], [6, 3, 0, 1], 5, 7
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 128, (4, P + L), generator=g)
    attention_mask = torch.zeros(4, P + L, dtype=torch.long)
    completion_mask = torch.zeros(4, P + L, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        attention_mask[row, P - p : P + c] = 1
        completion_mask[row, P : P + c] = 1
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask, completion_mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])  # the gradient formed in the forward / in a second pass
def test_grpo_loss_returns_the_logprobs_of_sequence_logprobs(backend, level):
    model = tiny_qwen2(4)
    ids, mask, completion = ragged_batch()
    want = sequence_logprobs(model, ids, mask, completion, temperature=0.8, backend=backend)
    options = dict(ref_logps=want - 0.1 * completion, beta=0.1, temperature=0.8, importance_sampling_level=level,
                   backend=backend)
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.0])
    loss, metrics = grpo_loss(model, ids, mask, completion, advantages, return_logps=True, **options)
    logps = metrics["logps"]
    assert logps.shape == ids.shape and logps.dtype == torch.float32 and not logps.requires_grad
    assert torch.all(logps[completion == 0] == 0) and torch.all(logps[completion == 1] < 0)
    # The same fp32 ops on the same hidden states: equal to a few ulps of |logp| ~ log(128) = 4.9.
    torch.testing.assert_close(logps, want, rtol=1e-6, atol=1e-6)
    loss.backward()
    assert model.lm_head.weight.grad.abs().max() > 0  # asking for the log-probs leaves the gradient in place
    with torch.no_grad():
        _, no_grad = grpo_loss(model, ids, mask, completion, advantages, return_logps=True, **options)
    torch.testing.assert_close(no_grad["logps"], want, rtol=1e-6, atol=1e-6)
    assert "logps" not in grpo_loss(model, ids, mask, completion, advantages, **options)[1]


def test_reference_grpo_loss_returns_the_logprobs_of_sequence_logprobs():
    model = tiny_qwen2(4)
    ids, mask, completion = ragged_batch()
    want = sequence_logprobs(model, ids, mask, completion)
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.0])
    _, metrics = reference_loss(model, ids, mask, completion, advantages, return_logps=True)
    logps = metrics["logps"]  # [B, T - 1]: the oracle runs on the shifted positions
    assert logps.dtype == torch.float32 and not logps.requires_grad and torch.all(logps[completion[:, 1:] == 0] == 0)
    # full [V] logits and log_softmax vs the chunked logsumexp: fp32 rounding apart
    torch.testing.assert_close(logps, want[:, 1:], rtol=1e-5, atol=1e-5)


def hf_grpo_loss(model, input_ids, attention_mask, completion_mask, advantages, old_logps, ref_logps, beta,
                 temperature):
    """Token-level bnpo GRPO loss on the logits of the model's own forward (soft-capped there), shifted by one."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1] / temperature
    logps = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    mask = completion_mask[:, 1:].to(logps.dtype)
    per_token_loss, *_ = grpo_per_token_loss(
        logps, mask, advantages, old_logps[:, 1:], ref_logps[:, 1:], beta=beta, epsilon_low=0.2, epsilon_high=0.28
    )
    return (per_token_loss * aggregation_weights(mask, "bnpo")).sum()


def test_gemma2_soft_capped_logits_match_hf():
    # A cap of 0.2 against logits of std 0.14 (max 0.5) in this tiny model: tanh bends them; 30 would be linear.
    model = tiny_gemma2(softcap=0.2, seed=3)
    patched = patch_model(copy.deepcopy(model))
    ids, mask, completion = rollout_batch(3)
    g = torch.Generator().manual_seed(3)
    advantages = torch.randn(B, generator=g)
    with torch.no_grad():
        base = eager_logps(model, ids, mask, completion, temperature=0.8).float()
    old = (base + 0.2 * torch.randn(B, T, generator=g) * completion).clamp(max=0.0)
    ref = (base + 0.3 * torch.randn(B, T, generator=g) * completion).clamp(max=0.0)
    options = dict(old_logps=old, ref_logps=ref, beta=0.05, epsilon_high=0.28, temperature=0.8)
    logps = sequence_logprobs(patched, ids, mask, completion, temperature=0.8)
    torch.testing.assert_close(logps.double(), base.double(), rtol=1e-5, atol=1e-5)
    loss, _ = grpo_loss(patched, ids, mask, completion, advantages, **options)
    want = hf_grpo_loss(model, ids, mask, completion, advantages, old, ref, 0.05, 0.8)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    loss.backward()
    want.backward()
    grads = dict(model.named_parameters())
    for n, p in patched.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-4, atol=1e-6, msg=n)
    # The cap matters at these tolerances: the same weights without it are far off.
    patched.config.final_logit_softcapping = None
    uncapped = sequence_logprobs(patched, ids, mask, completion, temperature=0.8)
    assert (uncapped - logps).abs().max() > 1e-2


def test_peft_reference_logprobs_disable_the_adapter():
    from peft import LoraConfig, get_peft_model

    model = tiny_qwen2(2)
    ids, mask, completion = rollout_batch(2)
    with torch.no_grad():
        base = eager_logps(model, ids, mask, completion)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, 0.0, 0.5)
    patch_model(peft_model)
    ref = sequence_logprobs(peft_model, ids, mask, completion, disable_adapter=True)
    policy = sequence_logprobs(peft_model, ids, mask, completion)
    torch.testing.assert_close(ref.double(), base, rtol=1e-5, atol=1e-5)
    assert (policy - ref).abs().max() > 1e-2  # the adapter is back on afterwards
    loss, _ = grpo_loss(peft_model, ids, mask, completion, torch.ones(B), ref_logps=ref, beta=0.1)
    loss.backward()
    lora_grads = [p.grad for n, p in peft_model.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None for g in lora_grads)
    assert all(p.grad is None for n, p in peft_model.named_parameters() if "lora_" not in n)


def test_lora_on_lm_head_is_rejected_unless_disabled():
    # The fused loss reads lm_head.weight: on a LoRA layer that is the base weight, the adapter would be skipped.
    from peft import LoraConfig, get_peft_model

    model = tiny_qwen2()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    ids, mask, completion = rollout_batch()
    with pytest.raises(ValueError, match="lm_head"):
        grpo_loss(peft_model, ids, mask, completion, torch.ones(B))
    with pytest.raises(ValueError, match="lm_head"):
        sequence_logprobs(peft_model, ids, mask, completion)
    with torch.no_grad():
        base = eager_logps(model, ids, mask, completion)  # LoRA B starts at 0: the adapter adds nothing yet
    ref = sequence_logprobs(peft_model, ids, mask, completion, disable_adapter=True)
    torch.testing.assert_close(ref.double(), base, rtol=1e-5, atol=1e-5)


def test_modules_to_save_lm_head_trains_its_copy():
    from peft import LoraConfig, get_peft_model

    model = tiny_qwen2()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    ids, mask, completion = rollout_batch()
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "modules_to_save" in n:
                p.add_(torch.randn_like(p))
        want = eager_logps(peft_model, ids, mask, completion)
    torch.testing.assert_close(sequence_logprobs(peft_model, ids, mask, completion).double(), want, rtol=1e-5,
                               atol=1e-5)


def test_no_completion_tokens_gives_zero_loss():
    model = tiny_qwen2()
    ids, mask, _ = rollout_batch()
    loss, _ = grpo_loss(model, ids, mask, torch.zeros(B, T), torch.ones(B))
    assert loss.item() == 0.0


def test_bad_input():
    model = tiny_qwen2()
    ids, mask, completion = rollout_batch()
    bad = completion.clone()
    bad[:, 0] = 1
    with pytest.raises(ValueError, match="completion_mask"):
        grpo_loss(model, ids, mask, bad, torch.ones(B))
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(model, ids, mask, completion, torch.ones(B + 1))
    with pytest.raises(ValueError, match="input_ids"):
        grpo_loss(model, ids[0], mask, completion, torch.ones(B))
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(model, ids, mask, completion, [1.0] * B)
    with pytest.raises(ValueError, match="old_logps"):
        grpo_loss(model, ids, mask, completion, torch.ones(B), old_logps=torch.zeros(B, T - 1))
    with pytest.raises(ValueError, match="attention_mask"):
        sequence_logprobs(model, ids, mask[:, 1:], completion)
    with pytest.raises(ValueError, match="disable_adapter"):
        sequence_logprobs(model, ids, mask, completion, disable_adapter=True)


def test_bad_values_name_the_argument():
    model = tiny_qwen2()
    ids, mask, completion = rollout_batch()
    two = mask.clone()
    two[0, 3] = 2
    with pytest.raises(ValueError, match="attention_mask: expected a bool mask or 0/1"):
        grpo_loss(model, ids, two, completion, torch.ones(B))
    with pytest.raises(ValueError, match="completion_mask: expected a bool mask or 0/1"):
        grpo_loss(model, ids, mask, completion * 2, torch.ones(B))
    big = ids.clone()
    big[2, 7] = 128
    with pytest.raises(ValueError, match=r"input_ids: expected ids in \[0, 128\), got min \d+ max 128"):
        grpo_loss(model, big, mask, completion, torch.ones(B))
    with pytest.raises(ValueError, match="input_ids: expected an integer dtype"):
        sequence_logprobs(model, ids.float(), mask, completion)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_unpadded_batch_matches_the_reference(attention):
    """An unpadded batch (HF's sdpa path then attends causally without a mask tensor), eager and sdpa: the loss,
    metrics and gradients of grpo_loss are the reference's."""
    model = tiny_qwen2(attn_implementation=attention).double()
    assert model.config._attn_implementation == attention
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    completion = torch.zeros(B, T, dtype=torch.long)
    completion[:, PROMPT:] = 1
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    loss, metrics = grpo_loss(model, ids, mask, completion, advantages, return_entropy=True)
    got = torch.autograd.grad(loss, model.lm_head.weight)[0]
    want_loss, want_metrics = reference_loss(model, ids, mask, completion, advantages, return_entropy=True)
    want = torch.autograd.grad(want_loss, model.lm_head.weight)[0]
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(metrics["entropy"], want_metrics["entropy"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("path", ["loss", "loss_with_rollout_correction", "sequence_logprobs"])
def test_one_value_read_per_call(monkeypatch, path):
    """grpo_loss (with the self-weighted rollout correction too) and sequence_logprobs read the batch's values once
    (_inspect's read_ints, before the forward is queued), never again after it: the correction's and the log-probs'
    lm_head pass trusts the ids _inspect checked (a second read there made the host wait for the whole forward, once
    per micro-batch). Counted on the CPU by the functions that read; the GPU test below counts real syncs."""
    import fastgrpo._checks as checks
    import fastgrpo.loss.model as model_module
    import fastgrpo.ops.fused_linear as fused_linear

    reads = []
    read_ints = checks.read_ints
    monkeypatch.setattr(model_module, "read_ints", lambda *v: reads.append("read_ints") or read_ints(*v))
    monkeypatch.setattr(fused_linear, "check_index_range", lambda *a: reads.append("check_index_range"))
    model = tiny_qwen2()
    ids, mask, completion = rollout_batch()
    if path == "sequence_logprobs":
        sequence_logprobs(model, ids, mask, completion)
    else:
        extra = dict(rollout_correction=RolloutCorrection("truncate"), rollout_logps=torch.zeros(B, T)) \
            if path == "loss_with_rollout_correction" else {}
        grpo_loss(model, ids, mask, completion, torch.randn(B), **extra)[0].backward()
    assert reads == ["read_ints"]


@pytest.mark.gpu
@pytest.mark.parametrize("correction", [False, True])
def test_gpu_grpo_loss_reads_the_device_once(correction):
    """One host sync from fastgrpo's code per micro-batch (the checks and the completion window, read together), none
    in its loss, also with the self-weighted rollout correction (its lm_head pass): the host queues the loss and the
    backward while the GPU runs the forward. (transformers adds its own:
    1 per forward in 5.17 / 5.24 for an unpadded batch, its test of the attention mask. Syncs inside autograd's C++ nodes
    are reported at this file's backward() line and are not counted here.)"""
    import warnings

    import fastgrpo

    model = tiny_qwen2(attn_implementation="sdpa").cuda()
    ids = torch.randint(3, 128, (B, T), device="cuda")
    mask = torch.ones(B, T, dtype=torch.long, device="cuda")
    completion = torch.zeros(B, T, dtype=torch.long, device="cuda")
    completion[:, PROMPT:] = 1
    completion[1, -2:] = 0  # a shorter completion: masked rows skipped
    advantages = torch.randn(B, device="cuda")
    old = -torch.rand(B, T, device="cuda")  # log-probs (the engine's, rollout_logps, are checked <= 0)
    policy = dict(rollout_correction=RolloutCorrection("truncate"), rollout_logps=old) if correction else \
        dict(old_logps=old)
    grpo_loss(model, ids, mask, completion, advantages, ref_logps=old, beta=0.1, **policy)[0].backward()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss, _ = grpo_loss(model, ids, mask, completion, advantages, ref_logps=old, beta=0.1, **policy,
                                return_entropy=True, return_logps=True)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # A sync is reported at the Python line that called the op (set_sync_debug_mode reports itself once).
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    package = os.path.dirname(fastgrpo.__file__) + os.sep
    ours = [site for site in syncs if site.startswith(package)]
    assert len(ours) == 1, syncs
