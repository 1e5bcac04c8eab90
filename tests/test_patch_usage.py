"""patch_model as users call it: argument checks, patching around PEFT's wrapping, the labels= loss's HF options and
errors (fp32, CPU interpreter, real transformers / PEFT classes)."""
import copy

import pytest
import torch

from fastgrpo.patching import patch_model
from tests.test_patching import assert_fp32_grads_close, batch, forward_logps_grads, tiny_model


@pytest.mark.parametrize("name", ["rms_norm", "rope", "swiglu", "fused_loss", "fused_lora", "tiled_mlp"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_switches_take_bools_only(name, value):
    """A truthy stand-in ("no" from a config file) used to patch what it meant to leave alone; None is tiled_mlp's
    'decide for me'."""
    model = tiny_model("llama")
    if name == "tiled_mlp" and value is None:
        assert patch_model(model, tiled_mlp=None).fastgrpo_patch_summary["arguments"]["tiled_mlp"] is None
        return
    expected = "True, False or None" if name == "tiled_mlp" else "True or False"
    with pytest.raises(ValueError, match=f"^{name}: expected {expected}, got {value!r}$"):
        patch_model(model, **{name: value})
    assert "fastgrpo_patch_summary" not in model.__dict__


def lora_model(model, targets=("q_proj", "gate_proj")):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at 0: make the adapters do something
            torch.nn.init.normal_(p, 0.0, 0.1)
    return model


def test_patching_again_after_peft_wrapped_the_patched_model_fuses_its_lora(delta_calls):
    """Patch, then get_peft_model (Unsloth's order), then patch_model again with the same arguments: the LoRA layers
    PEFT added get the fused branch (it returned early, the arguments being the same, and left them PEFT's)."""
    torch.manual_seed(1)
    reference = lora_model(tiny_model("qwen2"))
    torch.manual_seed(1)
    model = lora_model(patch_model(tiny_model("qwen2")))
    assert patch_model(model) is model
    assert model.get_base_model().fastgrpo_patch_summary["patched"]["fused_lora"] == 2 * 2  # q, gate x 2 layers
    ids, mask = batch(4)
    _, logps, grads = forward_logps_grads(reference, ids, mask)
    delta_calls.clear()
    _, logps_p, grads_p = forward_logps_grads(model, ids, mask)
    assert delta_calls == ["lora_linear"] * 4
    torch.testing.assert_close(logps_p, logps, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_p.keys()
    assert_fp32_grads_close(grads_p, grads)
    merged = model.merge_and_unload()  # the LoRA layers are gone: patching again says so
    assert "fused_lora" not in patch_model(merged).fastgrpo_patch_summary["patched"]
    assert not any("forward" in m.__dict__ for m in merged.modules() if hasattr(m, "lora_A"))


def labels_loss_and_grads(model, **kwargs):
    model.zero_grad()
    out = model(**kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])  # gemma2: soft-capped, tied embeddings
def test_shift_labels_are_hfs_targets(model_type):
    """HF's loss takes `shift_labels` ([B, T], position t's target, already shifted; what the Trainer passes under
    context parallelism) in place of shifting `labels`: the patched loss did too (it shifted labels, ignoring them)."""
    model = tiny_model(model_type)
    patched = patch_model(copy.deepcopy(model))
    ids, mask = batch(2)
    labels = ids.masked_fill(mask == 0, -100)
    shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    shift_labels[:, :5] = -100  # differs from shifting `labels`: a prompt of 5 tokens left out
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shift_labels)
    loss, grads = labels_loss_and_grads(model, **kwargs)
    loss_p, grads_p = labels_loss_and_grads(patched, **kwargs)
    unshifted, _ = labels_loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert abs(float(loss - unshifted)) > 1e-3  # the test can tell the two apart
    torch.testing.assert_close(loss_p, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_p.keys()
    assert_fp32_grads_close(grads_p, grads)


def test_labels_loss_carries_the_cache_without_transformers_deprecation_warning(monkeypatch):
    """transformers 5.24 renamed the outputs' past_key_values field to cache and warns on the old name: the patched
    loss, which read and passed past_key_values, printed that warning to users who never used the old name."""
    from transformers.utils import generic

    warned = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *args, **kwargs: warned.append(message))
    model = patch_model(tiny_model("llama"))
    ids, mask = batch(2)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=True)
    assert warned == []
    cache_field = "cache" if "cache" in type(out).__dataclass_fields__ else "past_key_values"
    assert out[cache_field] is not None and out[cache_field].get_seq_length() == ids.shape[1]


@pytest.mark.parametrize("case", ["longer", "shorter", "fewer rows", "float", "out of the vocabulary", "negative"])
@pytest.mark.parametrize("keyword", ["labels", "shift_labels"])
def test_bad_labels_are_one_line_naming_the_keyword(case, keyword):
    """HF raises an IndexError or a cross-entropy message; the patched loss raised IndexErrors from its own
    indexing ('The shape of the mask [2, 11] at index 1 does not match ...') or named its internal target_ids."""
    model = patch_model(tiny_model("llama"))
    ids, mask = batch(2)
    bad = {
        "longer": torch.cat([ids, ids[:, :1]], 1), "shorter": ids[:, 1:], "fewer rows": ids[:1], "float": ids.float(),
        "out of the vocabulary": ids.masked_fill(ids == ids[0, 3], 999),
        "negative": ids.masked_fill(ids == ids[0, 3], -5),
    }[case]
    expected = {
        "longer": r"expected shape \[2, 10\], got \[2, 11\]", "shorter": r"expected shape \[2, 10\], got \[2, 9\]",
        "fewer rows": r"expected shape \[2, 10\], got \[1, 10\]",
        "float": "expected an integer dtype, got torch.float32",
        "out of the vocabulary": r"expected ids in \[0, 128\) or -100 \(ignored\), got min \d+ max 999",
        "negative": r"expected ids in \[0, 128\) or -100 \(ignored\), got min -5 max \d+",
    }[case]
    kwargs = {"labels": bad} if keyword == "labels" else {"labels": ids, "shift_labels": bad}
    with pytest.raises(ValueError, match=f"^{keyword}: {expected}$"):
        model(input_ids=ids, attention_mask=mask, **kwargs)
