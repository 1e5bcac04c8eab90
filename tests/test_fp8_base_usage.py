"""patch_model(fp8_base=True) / --fp8-base as a user meets it (tests/test_fp8_base.py checks the math).

- The e4m3 copy of each base follows that base's weight through what a user does to a patched model: a deepcopy (the
  copy's own weights), .to() another dtype, load_state_dict, PEFT's merge_adapter / unmerge_adapter (which write the
  weight through .data, moving no version counter), several active adapters; unpatch_model frees the copies.
- The commands: a run's checkpoint and export hold no e4m3 copy and final/ is in the run's dtype; --resume with
  --fp8-base flipped is refused naming the field; eval --checkpoint evaluates the run's adapter over the base in its
  own dtype (eval has no fp8_base: it measures what final/ serves); a LoRA run on 2 gloo processes (DDP) trains.
"""
from __future__ import annotations

import copy
import gc
import json
import weakref

import pytest
import torch
from peft import LoraConfig
from safetensors import safe_open

import fastgrpo
from fastgrpo.ops.fp8_base import FP8_WEIGHT_ATTR, _cpu_takes_row_scales
from fastgrpo.ops.fp8_linear import quantize_fp8
from fastgrpo.ops.lora import lora_linear_of_checked_values
from tests.test_fp8_base import lora_layers, record_io, tiny_lora_model


def ids(seed=1):
    return torch.randint(0, 80, (2, 7), generator=torch.Generator().manual_seed(seed))


def copies(model) -> dict:
    """{base layer: its e4m3 bytes} for every base holding a copy."""
    return {m: m.__dict__[FP8_WEIGHT_ATTR][1][0] for m in model.modules() if FP8_WEIGHT_ATTR in m.__dict__}


def assert_copies_follow_weights(model, count=14):
    held = copies(model)
    assert len(held) == count
    for base, q in held.items():
        assert q.device == base.weight.device
        assert torch.equal(q.view(torch.uint8), quantize_fp8(base.weight.detach())[0].view(torch.uint8))


def patched(**kwargs):
    model = tiny_lora_model(**kwargs)
    fastgrpo.patch_model(model, fp8_base=True)
    with torch.no_grad():
        model(ids())
    return model


def test_deepcopy_has_copies_of_its_own_weights():
    model = patched()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "base_layer.weight" in name:
                p.mul_(2)
        twin(ids())
    assert_copies_follow_weights(twin)
    assert_copies_follow_weights(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_another_dtype_remakes_the_copies(dtype):
    model = patched().to(dtype)
    with torch.no_grad():
        assert model(ids()).logits.dtype == dtype
    assert_copies_follow_weights(model)


@pytest.mark.parametrize("move", [torch.float32, "meta"])
def test_a_move_that_changes_the_weights_drops_the_copies_at_once(move):
    """Before, the copies stayed until the next forward: a model moved from the GPU to the CPU held its GPU copies
    (on the CPU, "meta" stands in for the other device; test_gpu_a_model_moved_to_the_cpu_frees_its_gpu_copies
    moves a GPU's). A .to() that changes nothing keeps them; the _apply that drops them goes with them."""
    model = patched()
    held = copies(model)
    model.to("cpu")
    assert copies(model) == held
    model.to(move)
    assert not copies(model)
    assert not [m for m in model.modules() if "_apply" in m.__dict__]


def test_load_state_dict_remakes_the_copies():
    model = patched()
    state = {k: v * 3 if "base_layer.weight" in k else v for k, v in model.state_dict().items()}
    assert not [k for k in state if "fp8" in k]
    model.load_state_dict(state)
    with torch.no_grad():
        model(ids())
    assert_copies_follow_weights(model)


def test_merged_adapter_runs_peft_and_the_copy_follows_the_unmerged_weight():
    """Merged, PEFT's forward runs (the base with the merged deltas in bf16: the bits without fp8_base) and no copy
    of the unmerged weight is kept; unmerged again, the copies are of the weight PEFT left (its W + d - d in bf16)."""
    model = patched()
    plain = copy.deepcopy(model)
    fastgrpo.patch_model(plain, fp8_base=False)
    for m in (model, plain):
        m.base_model.merge_adapter()
    with torch.no_grad():
        assert torch.equal(model(ids()).logits, plain(ids()).logits)
    assert not copies(model)
    model.base_model.unmerge_adapter()
    with torch.no_grad():
        model(ids())
    assert_copies_follow_weights(model)


def test_several_active_adapters_add_to_the_fp8_product():
    model = tiny_lora_model()
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    fastgrpo.patch_model(model, fp8_base=True)
    seen, handles = record_io(lora_layers(model))
    with torch.no_grad():
        model(ids())
    for handle in handles:
        handle.remove()
    for layer, (x, out) in seen.items():
        base = layer.base_layer
        adapters = [(layer.lora_A[n].weight, layer.lora_B[n].weight, layer.scaling[n]) for n in layer.active_adapters]
        assert len(adapters) == 2
        assert torch.equal(out, lora_linear_of_checked_values(x, base.weight, base.bias, adapters,
                                                              quantize_fp8(base.weight)))


def test_patching_again_and_unpatch_free_the_copies():
    model = patched()
    held = copies(model)
    fastgrpo.patch_model(model, fp8_base=True)
    assert copies(model) == held, "the same arguments: nothing done"
    fastgrpo.patch_model(model, fp8_base=False)
    assert not copies(model)
    fastgrpo.patch_model(model, fp8_base=True)
    with torch.no_grad():
        model(ids())
    alive = [weakref.ref(q) for q in copies(model).values()]
    del held
    fastgrpo.unpatch_model(model)
    gc.collect()
    assert not copies(model) and not [ref for ref in alive if ref() is not None]


# ---- the commands ------------------------------------------------------------------------------------------------

def tensors_of(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return [t for item in items for t in tensors_of(item)]


def test_a_run_saves_no_copy_resumes_only_as_it_ran_and_evaluates(tmp_path, capsys):
    """A bf16 run with --fp8-base: its checkpoint (adapter and trainer state) and final/ hold no 1-byte float and
    final/ is bf16; --resume with --no-fp8-base is refused naming the field, and runs with --resume-allow-changes;
    eval --checkpoint evaluates it (over the bf16 base: eval takes no fp8_base)."""
    from fastgrpo.train.cli import main

    run = tmp_path / "run"
    argv = ["train", "--patch", "--lora-rank", "8", "--dtype", "bfloat16", "--output-dir", str(run),
            "--no-progress-bar", "--batch-size", "8", "--max-completion-length", "4"]
    assert main([*argv, "--fp8-base", "--max-steps", "1"]) == 0
    saved = torch.load(run / "checkpoint-1" / "trainer_state.pt", weights_only=False)
    for path in (run / "checkpoint-1" / "adapter_model.safetensors", run / "final" / "model.safetensors"):
        with safe_open(path, "pt") as f:
            saved[path.name] = {k: f.get_tensor(k) for k in f.keys()}
    assert saved["model.safetensors"] and not [t for t in tensors_of(saved) if t.is_floating_point() and t.element_size() == 1]
    assert {t.dtype for t in saved["model.safetensors"].values()} == {torch.bfloat16}
    capsys.readouterr()
    assert main([*argv, "--no-fp8-base", "--max-steps", "2", "--resume"]) == 2
    assert "checkpoint-1 was made with other settings: fp8_base: True in the checkpoint, False now" in (
        capsys.readouterr().err)
    assert main([*argv, "--no-fp8-base", "--max-steps", "2", "--resume", "--resume-allow-changes"]) == 0
    assert main(["eval", "--checkpoint", str(run / "checkpoint-1"), "--max-examples", "4", "--output-dir",
                 str(tmp_path / "eval")]) == 0
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())


def _lora_run(rank, tmp, argv):
    from fastgrpo.train.cli import main

    return {"exit": main(argv)}


def test_a_lora_run_on_two_gloo_processes_trains(tmp_path):
    from tests.forked_gloo import read_metrics, run_forked

    argv = ["train", "--patch", "--fp8-base", "--lora-rank", "8", "--output-dir", str(tmp_path / "run"),
            "--no-progress-bar", "--batch-size", "8", "--num-generations", "4", "--micro-batch-size", "4",
            "--max-completion-length", "4", "--max-steps", "2", "--save-steps", "0", "--no-export"]
    assert run_forked(_lora_run, tmp_path, argv, deadline_s=120, group_timeout_s=60) == [{"exit": 0}] * 2
    assert [m["step"] for m in read_metrics(tmp_path / "run") if "loss" in m] == [1, 2]


# ---- adapter dropout: the training forward would be PEFT's, the base in bf16 ----------------------------------

@pytest.mark.parametrize("lora, message", ids=["dropout", "dora"], argvalues=[
    (dict(lora_dropout=0.05), "fp8_base: runs in fastgrpo's LoRA forward, which takes no adapter dropout, and this "
                              "LlamaForCausalLM's LoRA layers have lora_dropout 0.05 (their training forward would be "
                              "PEFT's, the base in bf16); use LoraConfig(lora_dropout=0)"),
    (dict(use_dora=True), "fp8_base: runs in fastgrpo's LoRA forward, which takes plain LoRA adapters, and this "
                          "LlamaForCausalLM's LoRA layers have DoraLinearVariant ones (PEFT's forward runs them, the "
                          "base in bf16); use LoraConfig(use_dora=False)"),
])
def test_adapters_peft_runs_itself_are_refused(lora, message):
    """Adapter dropout (in training) and DoRA run PEFT's forward, whose base multiplies in bf16: fp8_base would do
    nothing there."""
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = get_peft_model(LlamaForCausalLM(config).to(torch.bfloat16),
                           LoraConfig(r=4, target_modules="all-linear", **lora))
    with pytest.raises(ValueError) as caught:
        fastgrpo.patch_model(model, fp8_base=True)
    assert str(caught.value) == message


def test_commands_refuse_adapter_dropout_before_loading(capsys):
    from fastgrpo.train.cli import main

    for command in ("train", "sft", "ei"):
        assert main([command, "--patch", "--fp8-base", "--lora-rank", "8", "--lora-dropout", "0.05",
                     "--model", "/nonexistent/model"]) == 2
        assert ("fp8_base: runs in fastgrpo's LoRA forward, which takes no adapter dropout, and --lora-dropout 0.05 "
                "would leave training to PEFT's forward (the base in bf16); set --lora-dropout 0") in (
            capsys.readouterr().err)


@pytest.mark.parametrize("fields, lora, message", ids=["bf16", "fp16", "dropout", "dora"], argvalues=[
    (dict(bf16=True), {}, "fp8_base: runs in fastgrpo's LoRA forward, which leaves TRL's mixed precision to PEFT's "
                          "(the backbone under autocast, the base in bf16); set bf16=False and load the model in bf16 "
                          "(model_init_kwargs={'dtype': torch.bfloat16})"),
    (dict(fp16=True), {}, "fp8_base: runs in fastgrpo's LoRA forward, which leaves TRL's mixed precision to PEFT's "
                          "(the backbone under autocast, the base in fp16); set fp16=False and load the model in bf16 "
                          "(model_init_kwargs={'dtype': torch.bfloat16})"),
    ({}, dict(lora_dropout=0.05), "fp8_base: runs in fastgrpo's LoRA forward, which takes no adapter dropout, and "
                                  "peft_config has lora_dropout 0.05 (training would run PEFT's forward, the base in "
                                  "bf16); set lora_dropout=0"),
    ({}, dict(use_dora=True), "fp8_base: runs in fastgrpo's LoRA forward, which takes plain LoRA adapters, and "
                              "peft_config has use_dora=True (PEFT's forward runs DoRA, the base in bf16); set "
                              "use_dora=False"),
])
def test_trl_drop_in_refuses_what_would_leave_the_base_in_bf16(tmp_path, fields, lora, message):
    """TRL's bf16=True (its default) or fp16=True runs the backbone under autocast, which fastgrpo's LoRA forward
    leaves to PEFT: the update's GEMMs would skip FP8, as with adapter dropout or DoRA. Refused before TRL loads the
    model."""
    from datasets import Dataset

    from fastgrpo.integrations.trl import FastGRPOTrainer
    from tests.test_trl import build_tokenizer, grpo_config, vowel_reward

    with pytest.raises(ValueError) as caught:
        FastGRPOTrainer(model="/nonexistent/model", reward_funcs=vowel_reward, args=grpo_config(tmp_path, **fields),
                        train_dataset=Dataset.from_dict({"prompt": ["2+2="] * 4}), processing_class=build_tokenizer(),
                        peft_config=LoraConfig(r=4, target_modules=["q_proj"], **lora), fp8_base=True)
    assert str(caught.value) == "FastGRPOTrainer cannot honour: " + message


@pytest.mark.gpu
def test_trl_drop_in_refuses_trls_own_config_after_loading(tmp_path_factory, tmp_path, monkeypatch):
    """No args: TRL makes its GRPOConfig (bf16=True) in its __init__, so the refusal comes after the model loaded,
    before anything trains. A GPU's: on a CPU, TRL's own config refuses bf16 first."""
    for needed in ("datasets", "trl"):  # the GPU machine has neither unless staged
        pytest.importorskip(needed)
    if torch.cuda.device_count() > 1:
        pytest.skip("several GPUs visible: TRL's Trainer refuses nn.DataParallel before this check; run with one")
    from datasets import Dataset

    from fastgrpo.integrations.trl import FastGRPOTrainer
    from tests.test_trl import build_tokenizer, model_dir, vowel_reward

    monkeypatch.chdir(tmp_path)  # TRL's default output_dir is relative
    with pytest.raises(ValueError) as caught:
        FastGRPOTrainer(model=model_dir.__wrapped__(tmp_path_factory), reward_funcs=vowel_reward,
                        train_dataset=Dataset.from_dict({"prompt": ["2+2="] * 4}), processing_class=build_tokenizer(),
                        peft_config=LoraConfig(r=4, target_modules=["q_proj"]), fp8_base=True)
    assert str(caught.value).startswith("FastGRPOTrainer cannot honour: fp8_base: runs in fastgrpo's LoRA forward, "
                                        "which leaves TRL's mixed precision to PEFT's")


@pytest.mark.gpu
def test_gpu_a_model_moved_to_the_cpu_frees_its_gpu_copies():
    model = tiny_lora_model().cuda()
    fastgrpo.patch_model(model, fp8_base=True)
    with torch.no_grad():
        model(ids().cuda())
    alive = [weakref.ref(q) for q in copies(model).values()]
    assert len(alive) == 14 and all(ref().is_cuda for ref in alive)
    model.to("cpu")
    gc.collect()
    assert not copies(model) and not [ref for ref in alive if ref() is not None]
    if not _cpu_takes_row_scales():  # torch 2.11 (the GPU machine's): the CPU forward is refused in one line
        with pytest.raises(ValueError, match="^fp8_base: runs on the CPU only where torch's CPU _scaled_mm takes row"):
            model(ids())
        return
    with torch.no_grad():
        model(ids())
    assert_copies_follow_weights(model)


def test_a_cpu_whose_scaled_mm_takes_no_row_scales_is_refused_in_one_line(monkeypatch):
    """torch 2.11's CPU _scaled_mm takes per-tensor scales only and failed on an internal assert at the first forward;
    fp8_base says so as it patches (and at the forward of a model moved to the CPU since: the GPU test above)."""
    from fastgrpo.ops import fp8_base

    monkeypatch.setattr(fp8_base, "_cpu_takes_row_scales", lambda: False)
    with pytest.raises(ValueError) as caught:
        fastgrpo.patch_model(tiny_lora_model(), fp8_base=True)
    assert str(caught.value) == (f"fp8_base: runs on the CPU only where torch's CPU _scaled_mm takes row-wise scales, "
                                 f"which torch {torch.__version__}'s does not; run the model on an FP8 GPU, or patch "
                                 "it without fp8_base")
