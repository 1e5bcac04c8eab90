"""Mutation audit of the export (final_export, export_command, the LoRA merge): each test here failed on a small
realistic bug that the rest of the suite let through; the merged weights are checked against PEFT's own
merge_and_unload, bit for bit (the same fp32 sums on both sides)."""
import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from fastgrpo.train.final_export import export_model


def _llama(tied: bool = False):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied))


def _assert_exports_as_merge_and_unload(model, folder) -> None:
    want_model = copy.deepcopy(model).merge_and_unload()
    want = want_model.state_dict()
    exported = AutoModelForCausalLM.from_pretrained(export_model(model, None, folder, torch.float32))
    got = exported.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (name, (got[name] - tensor).abs().max().item())
    ids = torch.tensor([[3, 7, 11, 5]])
    with torch.no_grad():  # the tying too: a head tied back to the embedding holds other weights than the trained one
        assert torch.equal(exported(ids).logits, want_model(ids).logits)


@pytest.mark.parametrize("saved", [["lm_head", "norm"], ["embed_tokens"]], ids=["head-norms", "embedding"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_trained_copy_of_modules_to_save_is_exported_as_merge_and_unload_keeps_it(tmp_path, tied, saved):
    """modules_to_save=["lm_head"] trains a copy of the head (fastgrpo's loss reads it: test_model_loss); the export
    refused the run at its end ('merged weights lack lm_head.weight'). With the head tied to the embedding, a trained
    copy of either one is apart from the other (as the trained model runs them): tied again, one replaced the other."""
    model = get_peft_model(_llama(tied), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=saved,
                                                    init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name:
                param.add_(torch.randn_like(param))  # trained: unlike the original
    _assert_exports_as_merge_and_unload(model, tmp_path / "final")


def test_every_active_adapter_is_merged(tmp_path):
    """Two adapters active at once (set_adapter on the LoRA model): merge_and_unload merges both."""
    model = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    torch.manual_seed(1)
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    assert model.get_base_model().model.layers[0].self_attn.q_proj.active_adapters == ["default", "second"]
    _assert_exports_as_merge_and_unload(model, tmp_path / "final")


def test_an_adapter_layout_the_merge_cannot_hold_is_refused_and_writes_nothing(tmp_path):
    """A tuner the merge does not run (HRA; LoHa's is merged by PEFT's own merge now): one line naming its layer, and
    no folder (nor a hidden partial one) left."""
    from peft import HRAConfig

    model = get_peft_model(_llama(), HRAConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"^model: model\.layers\.0\.self_attn\.q_proj: the export merges LoRA, .* "
                                         r"adapters, not HRALayer ones; unsupported adapter layout$"):
        export_model(model, None, tmp_path / "final", torch.float32)
    assert list(tmp_path.iterdir()) == []


def test_a_step_trained_again_is_exported_again(tmp_path):
    """final/ of step 2 is kept by a resume that trains nothing; a resume that trained step 2 again (its checkpoint-2
    was damaged or deleted: it went on from checkpoint-1) has other weights than final/'s, which it replaces."""
    from fastgrpo.train import default_task
    from fastgrpo.train.final_export import export_due

    tokenizer = default_task.build_tokenizer()
    export_model(default_task.build_model(tokenizer), tokenizer, tmp_path / "final", step=2)
    assert export_due(tmp_path, 2, trained=False) is False
    assert export_due(tmp_path, 2, trained=True) is True
    assert export_due(tmp_path, 3, trained=False) is True


def test_a_run_without_export_warns_of_a_final_of_another_step_only(tmp_path, caplog):
    """Export off: a final/ of the run's last step is current (no warning); one of another step is an earlier
    export."""
    from fastgrpo.train import default_task
    from fastgrpo.train.final_export import warn_stale_export

    tokenizer = default_task.build_tokenizer()
    export_model(default_task.build_model(tokenizer), tokenizer, tmp_path / "final", step=2)
    with caplog.at_level("WARNING", logger="fastgrpo.train.final_export"):
        warn_stale_export(tmp_path, 2)
        assert caplog.text == ""
        warn_stale_export(tmp_path, 3)
    assert f"export: {tmp_path / 'final'} holds the weights of an earlier point of this run" in caplog.text


# ---- `fastgrpo export` ----
def _saved_run(folder, *steps):
    """A run folder with a checkpoint of the built-in model per step (seeded by it: each holds other weights)."""
    from fastgrpo.train import default_task
    from fastgrpo.train.checkpoint import save_checkpoint
    from fastgrpo.train.config import GRPOConfig

    config = GRPOConfig(**{**default_task.PRESET, "output_dir": str(folder)})
    for step in steps:
        model = default_task.build_model(default_task.build_tokenizer(), seed=step)
        save_checkpoint(folder / f"checkpoint-{step}", model, {"step": step, "config": config.to_dict()})


def test_an_export_of_a_checkpoint_pruned_as_it_loads_records_the_one_it_loaded(tmp_path, monkeypatch, capsys):
    """--checkpoint <run> of a run still training: checkpoint-1 is pruned as it loads (checkpoint-2 saved), and
    checkpoint-2 is loaded instead; the export's step and message are checkpoint-2's, not the one first found."""
    from safetensors.torch import load_file

    from fastgrpo.train import default_task, eval_model
    from fastgrpo.train.cli import main

    run, out = tmp_path / "run", tmp_path / "model"
    _saved_run(run, 1)
    real_load = eval_model.load_inference_model

    def the_run_saves_and_prunes(*args, checkpoint, **kwargs):
        if checkpoint.name == "checkpoint-1":
            _saved_run(run, 2)
            (checkpoint / "trainer_state.pt").unlink()
        return real_load(*args, checkpoint=checkpoint, **kwargs)

    monkeypatch.setattr(eval_model, "load_inference_model", the_run_saves_and_prunes)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--output-dir", str(out)]) == 0
    assert capsys.readouterr().out == f"exported {run / 'checkpoint-2'} (step 2) to {out}\n"
    assert json.loads((out / "export.json").read_text())["step"] == 2
    want = default_task.build_model(default_task.build_tokenizer(), seed=2).state_dict()
    got = load_file(out / "model.safetensors")
    assert got and all(torch.equal(got[name], want[name]) for name in got)  # (lm_head: tied, not saved)


def test_an_export_that_fails_leaves_no_output_folder_it_created(tmp_path, monkeypatch, capsys):
    """The folder `fastgrpo export` created for its model is removed when the export fails (a model it cannot
    merge): an empty folder left behind looks like an export that ran, to a user and to scripts."""
    from fastgrpo.train import final_export
    from fastgrpo.train.cli import main

    run, out = tmp_path / "run", tmp_path / "model"
    _saved_run(run, 1)

    def refused(*args, **kwargs):
        raise ValueError("model: merged weights lack ['lm_head.weight']; unsupported adapter layout")

    monkeypatch.setattr(final_export, "export_model", refused)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err == ("fastgrpo export: error: model: merged weights lack ['lm_head.weight']; "
                                       "unsupported adapter layout\n")
    assert not out.exists()


@pytest.mark.parametrize(("flags", "line"), [
    (["--dtype", "fp16"], "dtype: expected one of ['auto', 'float32', 'bfloat16', 'float16'], got 'fp16'"),
    (["--output-dir", ""], "output_dir: expected a folder path, got ''"),
], ids=["dtype", "output-dir"])
def test_bad_export_flags_are_one_line_before_anything_loads(tmp_path, capsys, flags, line):
    """A misspelt --dtype went on to load the checkpoint (torch has no 'fp16'); an empty --output-dir is the current
    folder to pathlib, which --overwrite-output-dir would replace."""
    from fastgrpo.train.cli import main

    argv = ["export", "--checkpoint", str(tmp_path / "run"), "--output-dir", str(tmp_path / "model"), *flags]
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err == f"fastgrpo export: error: {line}\n"
    assert list(tmp_path.iterdir()) == []
