"""A patched model (fused_loss, the default) inside Hugging Face's Trainer and TRL's SFTTrainer, each run against
the same trainer on the unpatched model (fp32, CPU, tiny real models)."""
import copy

import numpy as np
import pytest
import torch

from fastgrpo.patching import patch_model
from tests.test_patching import batch, tiny_model


def rows_of(ids, labels=None):
    labels = ids if labels is None else labels
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, labels)]


def hf_args(tmp_path, **kwargs):
    from transformers import TrainingArguments

    defaults = dict(per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=2, logging_steps=1,
                    report_to=[], save_strategy="no", use_cpu=True, seed=3, disable_tqdm=True)
    return TrainingArguments(str(tmp_path), **{**defaults, **kwargs})


def test_trainer_evaluate_and_predict_give_compute_metrics_the_logits(tmp_path):
    """The Trainer's prediction_step reads the logits of the labels= forward in eval mode: the patched model gave
    logits=None, so compute_metrics ran on no predictions at all (here 0 rows for the unpatched model's 4) and
    predict() returned an empty tuple for them."""
    from transformers import Trainer

    ids, _ = batch(2)
    rows = rows_of(ids.repeat(2, 1))

    def token_accuracy(prediction):
        hits = prediction.predictions[:, :-1].argmax(-1) == prediction.label_ids[:, 1:]
        return {"accuracy": float(hits.mean())}

    results = []
    for model in (tiny_model("llama"), patch_model(tiny_model("llama"))):
        trainer = Trainer(model=model, args=hf_args(tmp_path), eval_dataset=rows, compute_metrics=token_accuracy)
        metrics = trainer.evaluate()
        results.append((metrics["eval_loss"], metrics["eval_accuracy"], trainer.predict(rows).predictions))
        assert model.training is False  # the Trainer evaluates in eval mode
    (loss, accuracy, logits), (loss_p, accuracy_p, logits_p) = results
    assert isinstance(logits_p, np.ndarray) and logits_p.shape == logits.shape == (4, *ids.shape[1:], 128)
    np.testing.assert_allclose(logits_p, logits, rtol=1e-5, atol=1e-5)
    assert accuracy_p == accuracy and loss_p == pytest.approx(loss, rel=1e-6)


def test_eval_mode_labels_forward_is_the_librarys_and_skip_logits_keeps_it_fused():
    """Liger's convention: the loss alone in training mode; in eval mode the library's logits and loss, unless the
    caller passes skip_logits=True (what the Trainer passes for a loss-only evaluation under use_liger_kernel)."""
    model = tiny_model("llama").eval()
    patched = patch_model(copy.deepcopy(model))
    ids, mask = batch(2)
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    with torch.no_grad():
        want, out, fused = model(**kwargs), patched(**kwargs), patched(**kwargs, skip_logits=True)
        unfused_in_training = patched.train()(**kwargs, skip_logits=False)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert fused.logits is None and unfused_in_training.logits is not None
    for loss in (out.loss, fused.loss, unfused_in_training.loss):
        torch.testing.assert_close(loss, want.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value, labelled, expected", [
    (1, True, "expected True, False or None, got 1"),
    (True, False, "True gives the labels= loss without logits, and no labels were passed"),
])
def test_bad_skip_logits_is_one_line(value, labelled, expected):
    model = patch_model(tiny_model("llama"))
    ids, mask = batch(2)
    labels = {"labels": ids} if labelled else {}
    with pytest.raises(ValueError, match=f"^skip_logits: {expected}$"):
        model(input_ids=ids, attention_mask=mask, skip_logits=value, **labels)


CHAT_ROWS = [("2+2=", "4"), ("hi ", "hello"), ("abc", "d"), ("cat ", "dog and more"), ("x", "yz"), ("q ", "r s t")]


def sft_dataset():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": p, "completion": c} for p, c in CHAT_ROWS])


def sft_trainer(tmp_path, model, dataset=None, **options):
    from trl import SFTConfig, SFTTrainer

    from tests.test_algorithms import char_tokenizer

    args = SFTConfig(str(tmp_path), per_device_train_batch_size=2, max_steps=2, logging_steps=1, report_to=[],
                     save_strategy="no", use_cpu=True, seed=3, disable_tqdm=True, **options)
    return SFTTrainer(model=model, args=args, train_dataset=dataset or sft_dataset(), processing_class=char_tokenizer())


def logged(trainer, keys=("loss", "grad_norm", "mean_token_accuracy", "entropy")):
    """[steps, keys]: what each logged training step reported."""
    return torch.tensor([[log[k] for k in keys] for log in trainer.state.log_history if "loss" in log])


def sft_logs(tmp_path, model, patch_after=False, dataset=None, **options):
    """logged() of TRL's SFTTrainer trained on `model`; patch_after: patch_model(trainer.model) once the trainer is
    built (TRL has wrapped the forward by then)."""
    trainer = sft_trainer(tmp_path, model, dataset, **options)
    if patch_after:
        patch_model(trainer.model)
    trainer.train()
    return logged(trainer)


def assert_logs_close(got, want):
    """fp32 on the CPU: the fused kernels round differently from eager (hidden states a few ulps apart, 2e-7 here),
    which moved the logged loss by up to 1e-6 relative and the gradient norm by up to 8e-5 (seen), while a wrong
    normalizer or a target across a sequence boundary moves the loss by more than 1e-2."""
    assert got.shape == want.shape and len(want) == 2
    torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-5)


def test_sft_trainer_trains_a_model_patched_after_it_was_built(tmp_path):
    """TRL's SFTTrainer wraps the model's forward with its fused lm_head (add_fused_lm_head) and calls it with
    fused_lm_head=True: a model patched once the trainer was built took those labels for its own loss and returned
    no log_probs ("'CausalLMOutputWithPast' object has no attribute 'log_probs'")."""
    want = sft_logs(tmp_path / "plain", tiny_model("llama"))
    assert_logs_close(sft_logs(tmp_path / "after", tiny_model("llama"), patch_after=True), want)
    assert_logs_close(sft_logs(tmp_path / "before", patch_model(tiny_model("llama"))), want)


def test_unpatching_a_model_trls_trainer_wrapped_keeps_trls_forward(tmp_path):
    """SFTTrainer wraps the patched forward (add_fused_lm_head puts its own in the model's __dict__): unpatch_model
    deleted TRL's forward, and the trainer's next step failed ("'CausalLMOutputWithPast' object has no attribute
    'log_probs'"). Now TRL's forward stays and the fastgrpo forward it wraps runs the library's: the run is the
    unpatched model's, bit for bit."""
    from fastgrpo.patching import unpatch_model

    want = sft_logs(tmp_path / "plain", tiny_model("llama"))
    model = patch_model(tiny_model("llama"))
    trainer = sft_trainer(tmp_path / "unpatched", model)
    unpatch_model(model)
    assert not any("forward" in m.__dict__ for m in model.model.modules())
    trainer.train()
    assert torch.equal(logged(trainer), want)


def uneven_rows(n=4):
    """Rows whose labels leave out prompts of different lengths: each micro-batch has its own count of targets, so
    a loss that averaged per micro-batch instead of dividing by the Trainer's num_items_in_batch would differ."""
    ids, _ = batch(4)
    ids = torch.cat([ids, ids.flip(1)])[:n]
    labels = ids.clone()
    for i, prompt in enumerate((1, 6, 3, 8, 2, 5)[:n]):
        labels[i, :prompt] = -100
    return rows_of(ids, labels)


def hf_train_logs(tmp_path, model, collator=None, **options):
    from transformers import Trainer

    trainer = Trainer(model=model, args=hf_args(tmp_path, **options), train_dataset=uneven_rows(),
                      data_collator=collator)
    trainer.train()
    return trainer, logged(trainer, keys=("loss", "grad_norm"))


HF_SETTINGS = {
    "accumulation": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2),
    "label smoothing": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, label_smoothing_factor=0.5),
    "tokens per device": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2,
                              average_tokens_across_devices=False),
    "padding-free": dict(per_device_train_batch_size=2),
}


def confident_llama():
    """tiny_model("llama") whose lm_head is scaled up: its next-token distributions are far from uniform, where
    label smoothing (which mixes in the uniform's cross-entropy) changes the loss."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


@pytest.mark.parametrize("setting", sorted(HF_SETTINGS))
def test_hf_trainer_settings_train_the_patched_model_as_the_unpatched_one(tmp_path, setting):
    """HF's Trainer passes num_items_in_batch to a model that accepts loss kwargs (the patched forward shows the
    library's signature, so the Trainer decides alike) and divides by it across gradient accumulation; label
    smoothing pops the labels and smooths the logits of a labels-free forward; padding-free (DataCollatorWithFlattening)
    packs rows into one with position_ids, the first label of each -100, so no target crosses a boundary."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening() if setting == "padding-free" else None
    plain, want = hf_train_logs(tmp_path / "plain", confident_llama(), collator, **HF_SETTINGS[setting])
    patched, got = hf_train_logs(tmp_path / "patched", patch_model(confident_llama()), collator,
                                 **HF_SETTINGS[setting])
    assert patched.model_accepts_loss_kwargs is plain.model_accepts_loss_kwargs is True
    assert_logs_close(got, want)
    if setting == "label smoothing":
        _, unsmoothed = hf_train_logs(tmp_path / "unsmoothed", confident_llama(), **HF_SETTINGS["accumulation"])
        assert abs(float(unsmoothed[0, 0] - want[0, 0])) > 1e-2  # the test tells smoothing from none


def test_sft_trainer_packing_trains_the_patched_model_as_the_unpatched_one(tmp_path):
    """Packing (TRL's bfd: padding-free rows with position_ids restarting per sequence, no attention_mask): the
    patched rotary embedding reads each token's own position, and attention stays within each packed sequence."""
    options = dict(packing=True, max_length=16)
    want = sft_logs(tmp_path / "plain", tiny_model("llama"), **options)
    assert_logs_close(sft_logs(tmp_path / "patched", patch_model(tiny_model("llama")), **options), want)
