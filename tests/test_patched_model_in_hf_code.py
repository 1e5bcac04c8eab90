"""A patched model in the Hugging Face code users hand it to: generate, the Trainer, torch.save (fp32, CPU, real
transformers classes)."""
import copy
import inspect
import io

import pytest
import torch

from fastgrpo.patching import patch_model
from tests.test_patching import batch, tiny_model


def test_patched_forward_shows_the_library_signature():
    """HF reads the forward's parameter names (generate, the Trainer): the patched causal-LM forward showed
    (*args, **kwargs)."""
    model = tiny_model("qwen2")
    patched = patch_model(copy.deepcopy(model))
    assert inspect.signature(patched.forward) == inspect.signature(model.forward)
    assert inspect.signature(copy.deepcopy(patched).forward) == inspect.signature(model.forward)


def test_generate_without_attention_mask_masks_the_pad_tokens_as_hf():
    """generate builds the attention mask from the pad tokens only for a forward that names attention_mask: the
    patched model attended to the pad tokens of a left-padded batch (scores off by 2e-2)."""
    model = tiny_model("llama").eval()
    patched = patch_model(copy.deepcopy(model))
    ids, mask = batch(1)
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    out = model.generate(input_ids=ids, **kwargs)
    out_p = patched.generate(input_ids=ids, **kwargs)
    assert torch.equal(out_p.sequences, out.sequences)
    for s, s_p in zip(out.scores, out_p.scores):
        torch.testing.assert_close(s_p, s, rtol=1e-5, atol=1e-5)


def test_hf_trainer_trains_a_patched_model_as_the_unpatched_one(tmp_path):
    """The Trainer drops the dataset columns the forward does not name: with (*args, **kwargs) it dropped input_ids
    too, and the first step failed with 'You must specify exactly one of input_ids or inputs_embeds'."""
    from transformers import Trainer, TrainingArguments

    ids, _ = batch(2)
    rows = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids.repeat(2, 1)]
    losses = []
    for model in (tiny_model("llama"), patch_model(tiny_model("llama"))):
        args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, max_steps=2, logging_steps=1,
                                 report_to=[], save_strategy="no", use_cpu=True, seed=3)
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        losses.append(torch.tensor([log["loss"] for log in trainer.state.log_history if "loss" in log]))
    assert len(losses[0]) == 2
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [{}, {"offload_activations": True}])
def test_torch_save_of_a_patched_model_is_one_line(options):
    """torch.save(model) of a patched model failed deep in pickle, naming a transformers function ('Can't pickle
    <function LlamaAttention.forward ...>: attribute lookup ... on transformers.utils.deprecation failed')."""
    from fastgrpo.patching import unpatch_model

    model = patch_model(tiny_model("llama"), **options)
    with pytest.raises(TypeError, match=r"^model: a model patched by fastgrpo cannot be pickled \(Llama\w+\.forward "
                                        r"is bound on the instance\); save its state_dict\(\) or .*unpatch_model"):
        torch.save(model, io.BytesIO())
    torch.save(unpatch_model(model), io.BytesIO())
