"""--lora-target-modules that PEFT cannot use is one line naming the setting and the model's linear layers. PEFT's own
message named neither ("Target modules {'qproj'} not found in the base model"), and for a module LoRA does not wrap
it printed the module's repr, a whole decoder stack for `layers`."""
import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.loading import load_model_and_tokenizer

LINEAR = "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"


def _config(targets):
    return GRPOConfig(**{**default_task.PRESET, "lora_rank": 4, "lora_target_modules": targets})


@pytest.mark.parametrize("targets, expected", [
    (["qproj"], f"lora_target_modules: no module of the model is named 'qproj'; its linear layers: {LINEAR}"),
    (["layers"], f"lora_target_modules: model.layers is a ModuleList, which LoRA does not wrap; name linear layers "
                 f"(the model's: {LINEAR})"),
])
def test_targets_peft_refuses_name_the_setting_and_the_models_layers(targets, expected):
    with pytest.raises(ValueError) as err:
        load_model_and_tokenizer(_config(targets))
    assert str(err.value) == expected


def test_targets_peft_takes_still_load():
    """A list of which some names match is PEFT's to take: it wraps those."""
    model, _ = load_model_and_tokenizer(_config(["q_proj", "not_in_this_model"]))
    assert model.peft_config["default"].target_modules == {"q_proj", "not_in_this_model"}


def test_the_command_line_gets_one_line(tmp_path, capsys):
    argv = ["train", "--lora-rank", "4", "--lora-target-modules", "qproj", "--max-steps", "1",
            "--output-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("fastgrpo train: error: lora_target_modules: no module of the model is named 'qproj'"), last
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"]])
def test_a_multimodal_checkpoints_vision_tower_gets_no_adapters(tmp_path, targets):
    """A Gemma-3 4B+ folder loads as Gemma3ForConditionalGeneration: its SigLIP tower has q/k/v_proj and fc layers
    that "all-linear" or projection names matched, adapters a text run never trains (no gradient, optimizer state
    all the same). Only the language model's linears get LoRA."""
    from tests.test_patch_user import tiny_gemma3_with_vision

    folder = tmp_path / "gemma3"
    tiny_gemma3_with_vision().save_pretrained(folder)
    default_task.build_tokenizer().save_pretrained(folder)
    config = GRPOConfig(**{**default_task.PRESET, "model": str(folder), "lora_rank": 4, "lora_target_modules": targets,
                           "dtype": "float32"})
    model, _ = load_model_and_tokenizer(config)
    adapted = [name for name, _ in model.named_modules() if name.endswith(".lora_A")]
    assert type(model.get_base_model()).__name__ == "Gemma3ForConditionalGeneration"
    assert adapted and all(".language_model." in name for name in adapted), adapted


def test_loading_lora_warns_nothing_the_user_cannot_act_on():
    """peft 0.21 reads transformers 5.24's deprecated is_gradient_checkpointing inside get_peft_model: every LoRA
    run printed a FutureWarning naming neither library's user-facing setting."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model_and_tokenizer(_config(["q_proj"]))
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
