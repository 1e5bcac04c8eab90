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

