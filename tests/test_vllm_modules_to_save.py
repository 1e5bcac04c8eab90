"""PEFT's modules_to_save (LoraConfig(modules_to_save=["lm_head"]): a trained copy of the head) under vLLM's merged
weight sync, against test_rollout_vllm's stand-in for vLLM's model (its fused names and padded vocabulary rows).
bind refused it once vLLM had built its engine (~140 s cold), saying vLLM's model had no weight for
lm_head.modules_to_save.default.weight. Now vLLM runs the wrapper's trained copy, aliased like any trained weight;
a tied embedding / lm_head the copy unties is refused before vLLM builds. The engine runs in tests/test_vllm_gpu.py
(test_merge_sync_runs_the_trained_lm_head_copy)."""
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_rollout_vllm import HEAD_DIM, HEADS, V, assert_runs, logits, tiny, trained_away, vllm_like

from fastgrpo.rollout import vllm as vllm_engine
from fastgrpo.rollout.vllm_lora import merged_sources
from fastgrpo.rollout.vllm_weights import bind
from fastgrpo.train.default_task import build_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
TIED = r"^model: modules_to_save \[{}\]: vLLM ties the embedding and lm_head to one weight, while the trained " \
       r"model runs them apart \(a trained copy in place of {}\); pass ensure_weight_tying=True to the LoraConfig " \
       r"\(one trained copy for both\) or use the built-in engine \(GRPOConfig\(rollout_engine='builtin'\), " \
       r"--rollout-engine builtin, or fastgrpo\.rollout\.BuiltinEngine in place of VLLMEngine\)$"


def saved_head(tied: bool = False, **options):
    """LoRA on q/v plus a trained copy of lm_head, both away from their initial values (a copy equal to the original
    would hide which of the two vLLM runs)."""
    model = get_peft_model(tiny(tied=tied), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       modules_to_save=["lm_head"], init_lora_weights=False,
                                                       **options))
    return trained_away(model)


def head_of(model):
    return model.base_model.model.lm_head


def vllm_values(model, **bind_options):
    """The stand-in vLLM model bound to `model`; its parameters (rows HF fills) by name."""
    fake = vllm_like(tied=False)
    copies = bind(model, fake, **bind_options)
    return fake, copies


@pytest.mark.parametrize("share", [True, False], ids=["shared", "copied"])
def test_vllm_runs_the_trained_copy_of_the_head(share):
    model = saved_head()
    head = head_of(model)
    original = head.original_module.weight.detach().clone()
    plain = copy.deepcopy(model).merge_and_unload()
    want = logits(model)
    fake, copies = vllm_values(model, share=share, merged=merged_sources(model))
    assert_runs(fake, plain)
    torch.testing.assert_close(logits(model), want, rtol=0, atol=0)  # the trainer's forward is unchanged
    trained = head.modules_to_save["default"].weight
    assert not torch.equal(fake.lm_head.weight[:V], original)  # not the frozen original...
    assert torch.equal(head.original_module.weight, original)  # ...which stays the trainer's, for the reference
    assert head.original_module.weight.data_ptr() != fake.lm_head.weight.data_ptr()
    assert (trained.data_ptr() == fake.lm_head.weight.data_ptr()) == share and trained.requires_grad
    assert ("lm_head.weight" in {c.hf_name for c in copies}) != share


@pytest.mark.parametrize("share", [True, False], ids=["shared", "copied"])
def test_an_optimizer_step_on_the_copy_reaches_vllm_with_the_sync(share):
    """A real AdamW step after bind (the trainer builds its optimizer once the engine is built), then the sync's
    refresh of the copies (load_weights): vLLM holds the stepped model, head included."""
    model = saved_head()
    fake, copies = vllm_values(model, share=share, merged=merged_sources(model))
    before = fake.lm_head.weight[:V].clone()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(input_ids=torch.arange(3, 12)[None]).logits.logsumexp(-1).sum().backward()
    optimizer.step()
    trained = head_of(model).modules_to_save["default"].weight
    assert not torch.equal(trained.detach(), before)
    with torch.no_grad():  # as load_weights refreshes them
        for rows in copies:
            rows.refresh()
    assert_runs(fake, copy.deepcopy(model).merge_and_unload())
    assert torch.equal(fake.lm_head.weight[:V], trained.detach())


def test_an_active_adapter_without_a_copy_runs_the_original_head():
    """The wrapper runs its original where the active adapter has no copy (PEFT's set_adapter to another one)."""
    model = saved_head()
    model.add_adapter("other", LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    model.set_adapter("other")
    head = head_of(model)
    fake, _ = vllm_values(model, merged=merged_sources(model))
    assert_runs(fake, copy.deepcopy(model).merge_and_unload())
    assert head.original_module.weight.data_ptr() == fake.lm_head.weight.data_ptr()
    q = fake.model.layers[0].self_attn.qkv_proj.weight[: HEADS * HEAD_DIM]
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    torch.testing.assert_close(q, layer.base_layer.weight + layer.get_delta_weight("other"), rtol=0, atol=1e-6)


@pytest.mark.parametrize("saved, named, copied", [
    (["lm_head"], "'lm_head'", "lm_head"),
    (["embed_tokens"], "'model.embed_tokens'", "model.embed_tokens"),
    (["embed_tokens", "lm_head"], "'model.embed_tokens', 'lm_head'", "model.embed_tokens and lm_head"),
], ids=["head", "embedding", "both-apart"])
def test_a_copy_that_unties_a_tied_embedding_is_refused_before_vllm_builds(no_vllm, saved, named, copied):
    """vLLM's tied lm_head IS its embedding: one weight cannot be both the trained copy and the original (or two
    copies trained apart). bind said 'no weight for lm_head.modules_to_save.default.weight', after vLLM built."""
    model = get_peft_model(tiny(tied=True), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=saved))
    refusal = TIED.format(named, copied)
    with pytest.raises(ValueError, match=refusal):
        merged_sources(model)
    with pytest.raises(ValueError, match=refusal):
        vllm_engine.VLLMEngine(model, build_tokenizer(), max_model_len=32, lora_sync="merge")


def test_one_copy_for_a_tied_embedding_and_head_is_vllms_tied_weight():
    """PEFT's ensure_weight_tying=True: the embedding and the head run one trained copy, as vLLM's tied weight."""
    model = saved_head(tied=True, ensure_weight_tying=True)
    embedding, head = model.base_model.model.model.embed_tokens, head_of(model)
    assert embedding.modules_to_save["default"].weight is head.modules_to_save["default"].weight
    fake = vllm_like(tied=True)
    assert [c.hf_name for c in bind(model, fake, merged=merged_sources(model))] == [
        f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qv"]
    trained = embedding.modules_to_save["default"].weight
    assert trained is head.modules_to_save["default"].weight  # still one weight, now vLLM's
    assert trained.data_ptr() == fake.model.embed_tokens.weight.data_ptr() and trained.requires_grad
    assert embedding.original_module.weight.data_ptr() != trained.data_ptr()


def test_the_adapter_sync_refuses_modules_to_save_before_vllm_builds(no_vllm):
    """vLLM's LoRA path runs the adapter over vLLM's own base: no trained copy of a module."""
    model = saved_head()
    with pytest.raises(ValueError, match=r"^model: vLLM's LoRA does not run adapters with \['modules_to_save'\]; "
                                         r"use lora_sync='merge' \(GRPOConfig\(vllm_lora_sync='merge'\), "
                                         r"--vllm-lora-sync merge\)$"):
        vllm_engine.VLLMEngine(model, build_tokenizer(), max_model_len=32, lora_sync="adapter")
