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
