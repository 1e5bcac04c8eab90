"""fastgrpo.hf: the loss works on any causal LM with an lm_head and a base model, version guards name the version,
the patch summary says why a table class matched nothing, and the built-in engine is a RolloutEngine."""
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from fastgrpo.hf import versions
from fastgrpo.loss import reference
from fastgrpo.loss.model import grpo_loss, sequence_logprobs
from fastgrpo.patching import patch_model
from fastgrpo.rollout import BuiltinEngine, RolloutEngine
from fastgrpo.train import default_task


def tiny_gpt_neox():
    config = transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64)


def test_grpo_loss_and_logprobs_on_a_model_outside_the_patch_table():
    model = tiny_gpt_neox()  # GPT-NeoX: base_model_prefix gpt_neox, not in the patch table
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    attention = torch.ones_like(ids)
    completion = torch.zeros_like(ids)
    completion[:, 3:] = 1
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    eager = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0] * completion[:, 1:]
    logps = sequence_logprobs(model, ids, attention, completion)
    torch.testing.assert_close(logps[:, 1:], eager, rtol=0, atol=1e-12)
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    loss, _ = grpo_loss(model, ids, attention, completion, advantages, loss_type="bnpo")
    hidden = model.gpt_neox(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1]
    expected, _ = reference.grpo_loss(hidden, model.lm_head.weight, ids[:, 1:], completion[:, 1:], advantages)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="model_type 'gpt_neox' is not supported"):
        patch_model(model)


def test_ids_outside_the_vocabulary_and_an_empty_batch_are_value_errors():
    model = tiny_gpt_neox()
    ids = torch.full((1, 4), 64)
    ones = torch.ones_like(ids)
    with pytest.raises(ValueError, match=r"input_ids: expected ids in \[0, 64\)"):
        sequence_logprobs(model, ids, ones, ones * (torch.arange(4) > 0))
    with pytest.raises(ValueError, match="input_ids: expected at least one sequence"):
        sequence_logprobs(model, ids[:0], ones[:0], ones[:0])


def test_weights_on_meta_are_an_error_not_wrong_numbers():
    model = tiny_gpt_neox()
    model.lm_head.weight = torch.nn.Parameter(torch.empty(64, 16, device="meta"))
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="lm_head.weight is on the meta device"):
        sequence_logprobs(model, ids, torch.ones_like(ids), torch.tensor([[0, 1, 1, 1]]))


def test_version_guard_names_the_installed_version(monkeypatch):
    from packaging.requirements import Requirement

    monkeypatch.setattr(versions, "_required", lambda: {"transformers": Requirement("transformers>=99")})
    with pytest.raises(RuntimeError, match=rf"supports transformers>=99 .*transformers {transformers.__version__} is"):
        versions.check_supported("transformers")


def test_a_table_class_that_matches_nothing_is_recorded_as_skipped():
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    for layer in model.model.layers:  # an MLP class outside the table: a custom replacement
        layer.mlp = type("CustomMLP", (torch.nn.Module,), {"forward": lambda self, x: x})()
    summary = patch_model(model, fused_loss=False).fastgrpo_patch_summary
    assert summary["skipped"] == {"swiglu": "no module of class ['Qwen2MLP'] in this Qwen2ForCausalLM"}


def test_the_built_in_engine_is_a_rollout_engine():
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    engine = BuiltinEngine(model, tokenizer)
    assert isinstance(engine, RolloutEngine)
    with pytest.raises(ValueError, match="the built-in engine generates with the model it was built on"):
        engine.load_weights(default_task.build_model(tokenizer))
