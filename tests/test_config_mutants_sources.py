"""Settings as the commands resolve them: documented defaults, and a count of reward weights other than the reward
functions' refused either way (a mutation audit found a default change and a fewer-weights count unchecked)."""
import pytest

from fastgrpo.train import commands
from fastgrpo.train.cli import build_parser
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.sft_config import SFTConfig


def _config(command: str, argv: list[str]):
    return commands.config_from_args(command, build_parser().parse_args([command, *argv]))


# Defaults the README and --help state (README: TRL's names and defaults for the loss options, dapo in `fastgrpo
# train`, "the default lr 1e-6", each command's prompt format, ei's checkpoint every round); a changed default changes
# every run that did not set it, silently.
DOCUMENTED = {
    GRPOConfig: dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, learning_rate=1e-6, beta=0.0,
                     num_generations=8, scale_rewards="group", importance_sampling_level="token",
                     use_bias_correction_kl=False, prompt_format="raw", vllm_lora_sync="merge", rollout_engine="builtin",
                     seed=0, max_grad_norm=1.0, temperature=1.0, top_p=1.0, top_k=0),
    SFTConfig: dict(prompt_format="auto", num_epochs=1, max_steps=0, learning_rate=1e-5),
    EIConfig: dict(prompt_format="r1_zero", save_steps=1, correct_threshold=1.0),
    EvalConfig: dict(prompt_format="r1_zero", max_examples=0, num_generations=1, temperature=1.0),
}


@pytest.mark.parametrize("config_class", list(DOCUMENTED), ids=lambda c: c.__name__)
def test_the_documented_defaults(config_class):
    config = config_class()
    assert {name: getattr(config, name) for name in DOCUMENTED[config_class]} == DOCUMENTED[config_class]


def test_a_real_models_run_takes_the_dataclass_defaults_not_the_presets():
    """The built-in model's preset (3 epochs, lr 3e-3) is for it alone: --model gets the documented defaults."""
    sft = _config("sft", ["--model", "/m"])
    assert (sft.num_epochs, sft.learning_rate) == (1, 1e-5)
    train = _config("train", ["--model", "/m"])
    assert (train.loss_type, train.learning_rate, train.epsilon_high) == ("dapo", 1e-6, 0.28)


@pytest.mark.parametrize("command", ["train", "ei", "eval"])
@pytest.mark.parametrize("weights", [["1"], ["1", "2", "3"]])
def test_fewer_or_more_reward_weights_than_functions_are_refused(command, weights):
    with pytest.raises(ValueError) as info:
        _config(command, ["--model", "/m", "--reward-funcs", "length", "length", "--reward-weights", *weights])
    assert str(info.value) == f"reward_weights: expected one weight per name in reward_funcs (2), got {len(weights)}"
