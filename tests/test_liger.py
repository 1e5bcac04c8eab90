"""Liger-Kernel beside fastgrpo: patch_model over a Liger-patched model, HF's Trainer and TRL's SFTTrainer with
use_liger_kernel=True over a patched model (real liger-kernel, tiny real models, fp32 on the CPU; FastGRPOTrainer's
use_liger_kernel: tests/test_trl_liger.py).

Liger's Triton kernels fail under Triton's CPU interpreter (its RMSNorm, SwiGLU and fused linear cross-entropy:
"'float' object has no attribute 'to'"), so these tests look at the forwards bound and at the errors raised before a
Liger kernel would run, not at Liger's numbers. Liger rebinds names in transformers' modeling modules for the whole
process: each test puts them back.
"""
import pytest
import torch

pytest.importorskip("liger_kernel.transformers", reason="liger-kernel is not installed (pip install liger-kernel)")

from liger_kernel.transformers import _apply_liger_kernel_to_instance, apply_liger_kernel_to_llama  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402

from fastgrpo.patching import patch_model  # noqa: E402
from fastgrpo.patching.liger import liger_modules  # noqa: E402
from tests.test_patch_hf_trainers import hf_args, rows_of, sft_trainer  # noqa: E402
from tests.test_patching import batch, tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def liger_undone():
    """Liger's apply functions rebind the modeling modules' classes and apply_rotary_pos_emb (every model built
    afterwards gets LigerRMSNorm), and a class's forward when given no model: put them back."""
    modules = (modeling_llama, modeling_qwen2)
    names = [(module, dict(vars(module))) for module in modules]
    classes = [value for module in modules for value in vars(module).values()
               if isinstance(value, type) and value.__module__ == module.__name__]
    forwards = [(cls, cls.__dict__.get("forward")) for cls in classes]
    cross_entropy = torch.nn.functional.cross_entropy
    yield
    for module, saved in names:
        vars(module).update(saved)
    for cls, forward in forwards:
        if forward is not None:
            cls.forward = forward
        elif "forward" in cls.__dict__:
            del cls.forward
    torch.nn.functional.cross_entropy = cross_entropy


def forwards(model):
    """{module class: the module its forward in effect is defined in}."""
    found = {}
    for module in model.modules():
        forward = module.__dict__.get("forward", type(module).forward)
        found[type(module).__name__] = getattr(forward, "__func__", forward).__module__
    return found


def liger_instance(model):
    _apply_liger_kernel_to_instance(model=model)  # what HF's Trainer calls at train() under use_liger_kernel=True
    return model


def accelerate_hooked(model):
    """Every module under an accelerate hook, as device_map offload leaves them: the hook's forward calls
    `_old_forward`, where patch_model binds, and Liger binds its forward over the hook's."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    for module in model.modules():
        add_hook_to_module(module, ModelHook())
    return model


def liger_classes_then_built():
    apply_liger_kernel_to_llama()  # Liger's documented use: patch transformers, then load the model
    return tiny_model("llama")


LIGER_PATCHED = {
    # before: patch_model replaced Liger's forwards with its own without a word
    "liger on the instance": (lambda: liger_instance(tiny_model("llama")), "LlamaForCausalLM, LlamaMLP, LlamaRMSNorm"),
    # before: fastgrpo's RoPE and loss under Liger's RMSNorm and MLP classes, which patch_model skipped (its summary
    # said "no module of class ['LlamaRMSNorm']")
    "liger's classes": (liger_classes_then_built, "LigerRMSNorm, LigerSwiGLUMLP, LlamaForCausalLM"),
    # before: patching again with the same arguments returned at once, the model still running Liger's forwards
    "patched, then liger": (lambda: liger_instance(patch_model(tiny_model("llama"))),
                            "LlamaForCausalLM, LlamaMLP, LlamaRMSNorm"),
    # before: Liger's forwards, over accelerate's hooks, went unseen and patch_model bound its own under the hooks
    "liger over accelerate's hooks": (lambda: liger_instance(accelerate_hooked(tiny_model("llama"))),
                                      "LlamaForCausalLM, LlamaMLP, LlamaRMSNorm"),
}


@pytest.mark.parametrize("case", LIGER_PATCHED)
def test_patch_model_refuses_a_model_liger_patched_and_leaves_it_as_it_was(case):
    build, names = LIGER_PATCHED[case]
    model = build()
    before = forwards(model)
    with pytest.raises(ValueError, match=f"^model: Liger-Kernel's forwards already run in its {names} modules, "
                                         "and fastgrpo.patch_model would mix its kernels with them; build the model "
                                         "in a process where Liger has not run"):
        patch_model(model)
    assert forwards(model) == before


@pytest.mark.parametrize("trainer_kind, names", [
    # Liger's RMSNorm, SwiGLU and fused linear cross-entropy over fastgrpo's (its RoPE stayed: the attention forward
    # patch_model binds reads its own apply_rotary_pos_emb)
    ("Trainer", "LlamaForCausalLM, LlamaMLP, LlamaRMSNorm"),
    ("SFTTrainer", "LlamaMLP, LlamaRMSNorm"),  # TRL turns Liger's loss off for its own fused lm_head
])
def test_use_liger_kernel_over_a_patched_model_is_refused_at_the_first_step(tmp_path, trainer_kind, names):
    """HF's Trainer applies Liger at train(): before, Liger's forwards replaced fastgrpo's and the run went on
    (on a GPU; here Liger's first kernel failed in Triton's interpreter) while fastgrpo_patch_summary still listed
    them. Now the first training forward refuses, before a Liger kernel runs."""
    model = patch_model(tiny_model("llama"))
    if trainer_kind == "Trainer":
        from transformers import Trainer

        ids, _ = batch(2)
        trainer = Trainer(model=model, args=hf_args(tmp_path, use_liger_kernel=True), train_dataset=rows_of(ids))
    else:
        pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]' installs it)")
        trainer = sft_trainer(tmp_path, model, use_liger_kernel=True)
    with pytest.raises(ValueError, match=rf"^use_liger_kernel: Liger-Kernel's forwards now run in this "
                                         rf"fastgrpo-patched model \({names}\), beside fastgrpo.patch_model's, as HF's "
                                         "Trainer puts them with use_liger_kernel=True; set it False"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert liger_modules(model)  # the refusal names what Liger did; it undoes nothing


def test_liger_beside_fastgrpos_forwards_is_refused_without_claiming_it_replaced_them(tmp_path):
    """fused_loss=False leaves the model's forward to HF, and Liger's loss alone (liger_kernel_config) goes there:
    one model would run both libraries' kernels, refused as before, but the line said Liger 'has replaced forwards
    fastgrpo.patch_model bound on this model (LlamaForCausalLM)', a forward patch_model never bound."""
    from transformers import Trainer

    ids, _ = batch(2)
    model = patch_model(tiny_model("llama"), fused_loss=False)
    args = hf_args(tmp_path, use_liger_kernel=True, liger_kernel_config={"rms_norm": False, "swiglu": False})
    trainer = Trainer(model=model, args=args, train_dataset=rows_of(ids))
    with pytest.raises(ValueError, match=r"^use_liger_kernel: Liger-Kernel's forwards now run in this "
                                         r"fastgrpo-patched model \(LlamaForCausalLM\), beside fastgrpo.patch_model's"):
        trainer.train()


def test_liger_over_a_patched_model_under_accelerate_hooks_is_refused_at_the_first_step():
    """Liger binds its forwards over accelerate's hooks, which call the `_old_forward` patch_model bound: the check
    read `_old_forward` only, found fastgrpo's, and Liger's first kernel ran (here failing in Triton's
    interpreter)."""
    ids, mask = batch(2)
    model = liger_instance(patch_model(accelerate_hooked(tiny_model("llama"))))
    with pytest.raises(ValueError, match=r"^use_liger_kernel: Liger-Kernel's forwards now run in this "
                                         r"fastgrpo-patched model \(LlamaForCausalLM, LlamaMLP, LlamaRMSNorm\)"):
        model.train()(input_ids=ids, attention_mask=mask, labels=ids)


def test_liger_inside_peft_modules_to_save_wrappers_is_refused_at_the_first_step():
    """modules_to_save wraps each layer's norms in a ModulesToSaveWrapper; Liger binds its RMSNorm on the original
    and the trained copy inside, not on the wrapper. The check read the layer's children (the wrappers, PEFT's
    forward) and Liger's first kernel ran (here failing in Triton's interpreter)."""
    from peft import LoraConfig, get_peft_model

    ids, mask = batch(2)
    lora = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["input_layernorm", "post_attention_layernorm"])
    model = patch_model(get_peft_model(tiny_model("llama"), lora))
    # Liger's RMSNorm alone: the model's and the MLPs' forwards stay fastgrpo's, the norms are all wrapped
    _apply_liger_kernel_to_instance(model=model.get_base_model(), rms_norm=True, swiglu=False, rope=False,
                                    fused_linear_cross_entropy=False)
    with pytest.raises(ValueError, match=r"^use_liger_kernel: Liger-Kernel's forwards now run in this "
                                         r"fastgrpo-patched model \(LlamaRMSNorm\)"):
        model.train()(input_ids=ids, attention_mask=mask, labels=ids)


def test_a_patched_model_without_liger_trains_and_generates_as_before(tmp_path):
    """The training-forward check finds nothing on a patched model Liger never touched: HF's Trainer trains it
    (test_patch_hf_trainers compares the numbers) and generate runs."""
    from transformers import Trainer

    ids, mask = batch(2)
    model = patch_model(tiny_model("llama"))
    trainer = Trainer(model=model, args=hf_args(tmp_path), train_dataset=rows_of(ids))
    trainer.train()
    assert trainer.state.global_step == 2 and not liger_modules(model)
    assert model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False).shape[1] == 12


def test_the_training_step_check_is_registered_once_and_gone_once_unpatched():
    """unpatch_model takes the check off at once: the unpatched model pickles without fastgrpo (torch.save, as the
    patched model's pickle error tells users to do after unpatching); a patch refused after the Liger check leaves
    none either."""
    import pickle

    from fastgrpo.patching import unpatch_model

    model = patch_model(patch_model(tiny_model("llama")), rms_norm=False)  # patched again with other arguments
    assert len(model._forward_pre_hooks) == 1
    unpatch_model(model)
    assert not model._forward_pre_hooks and "_fastgrpo_liger_watched" not in model.__dict__
    assert b"fastgrpo" not in pickle.dumps(model)
    with pytest.raises(ValueError, match="recompute_layers"):
        patch_model(model, recompute_layers=1)  # refused after refuse_liger_patched ran
    assert not model._forward_pre_hooks and b"fastgrpo" not in pickle.dumps(model)
