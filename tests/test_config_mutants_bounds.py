"""The configs' bounds at their edges: the last value each check accepts and the first it refuses, in one line naming
the field (a mutation audit found these edges unchecked: a `<` turned `<=` passed every other test)."""
import math
from types import SimpleNamespace

import pytest

from fastgrpo.train.config import MAX_SEED, GRPOConfig
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.input_checks import check_lengths_fit
from fastgrpo.train.sft_config import SFTConfig


def test_micro_batch_size_divides_the_minibatch_not_the_batch():
    """16 completions in 2 optimizer steps: a minibatch of 8, which a micro-batch of 16 (a divisor of the batch)
    would overrun."""
    with pytest.raises(ValueError) as info:
        GRPOConfig(batch_size=16, num_generations=4, num_minibatches=2, micro_batch_size=16)
    assert str(info.value) == "micro_batch_size: expected a divisor of the minibatch size (8), got 16"
    assert GRPOConfig(batch_size=16, num_generations=4, num_minibatches=2, micro_batch_size=8).micro_batch_size == 8


@pytest.mark.parametrize("config_class", [GRPOConfig, SFTConfig, EIConfig, EvalConfig])
def test_the_seed_stops_below_2_to_the_32(config_class):
    assert config_class(seed=MAX_SEED - 1).seed == MAX_SEED - 1
    with pytest.raises(ValueError) as info:
        config_class(seed=MAX_SEED)
    assert str(info.value) == f"seed: expected an int in [0, 2**32), got {MAX_SEED}"


@pytest.mark.parametrize("config_class", [GRPOConfig, EIConfig, EvalConfig])
@pytest.mark.parametrize("weight", [math.inf, -math.inf])
def test_an_infinite_reward_weight_is_refused(config_class, weight):
    """inf x a reward of 0 is nan: the group's advantages would be nan."""
    with pytest.raises(ValueError) as info:
        config_class(reward_funcs=["length", "length"], reward_weights=[1.0, weight])
    assert str(info.value) == f"reward_weights: expected finite numbers, got [1.0, {weight}]"


@pytest.mark.parametrize("prompt, completion, fits", [(20, 12, True), (21, 12, False), (20, 13, False)])
def test_prompt_and_completion_may_fill_the_positions_exactly(prompt, completion, fits):
    config = SimpleNamespace(max_prompt_length=prompt, max_completion_length=completion)
    if fits:
        check_lengths_fit(config, 32)
        return
    with pytest.raises(ValueError, match=rf"^max_prompt_length \+ max_completion_length \({prompt} \+ {completion}\) "
                                         r"exceeds the model's max_position_embeddings \(32\)"):
        check_lengths_fit(config, 32)


def test_a_sequence_may_fill_the_positions_exactly():
    check_lengths_fit(SimpleNamespace(max_seq_length=32), 32)
    with pytest.raises(ValueError) as info:
        check_lengths_fit(SimpleNamespace(max_seq_length=33), 32)
    assert str(info.value) == "max_seq_length: 33 exceeds the model's max_position_embeddings (32)"


@pytest.mark.parametrize("share, refused", [(1.0, False), (0.05, False), (0.0, True), (1.01, True), (math.nan, True)])
def test_vllms_share_of_the_gpu_is_in_0_to_1_with_1_itself(share, refused):
    if not refused:
        assert GRPOConfig(vllm_gpu_memory_utilization=share).vllm_gpu_memory_utilization == share
        return
    with pytest.raises(ValueError) as info:
        GRPOConfig(vllm_gpu_memory_utilization=share)
    assert str(info.value) == f"vllm_gpu_memory_utilization: expected a number in (0, 1] or none, got {share}"


def test_an_fsdp_setting_of_a_rank_1_lora_launch_is_refused(monkeypatch):
    """Any LoRA rank trains through DDP under torchrun, the smallest too."""
    from fastgrpo.train.memory_options import check_fsdp_applies

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError) as info:
        check_fsdp_applies(GRPOConfig(lora_rank=1, fsdp_layers_per_group=2))
    assert str(info.value) == ("fsdp_layers_per_group: shapes FSDP2, which shards full fine-tuning under torchrun, and "
                               "a LoRA run (lora_rank=1) trains through DDP")
    check_fsdp_applies(GRPOConfig(lora_rank=0, fsdp_layers_per_group=2))  # full fine-tuning: FSDP2's


@pytest.mark.parametrize("config_class", [SFTConfig, EIConfig])
def test_sft_and_ei_micro_batches_divide_the_batch(config_class):
    with pytest.raises(ValueError) as info:
        config_class(batch_size=32, micro_batch_size=5)
    assert str(info.value) == "micro_batch_size: expected a divisor of batch_size (32), got 5"
    assert config_class(batch_size=32, micro_batch_size=16).micro_batch_size == 16


def test_each_ei_rounds_sft_seed_stays_a_seed():
    """A round's seed is derived from the run's (seed * 1_000_003 + round): taken mod 2**32, the largest seed's
    rounds build their SFT configs too."""
    config = EIConfig(seed=MAX_SEED - 1)
    seeds = {config.sft_config(round_index).seed for round_index in range(3)}
    assert len(seeds) == 3 and all(0 <= seed < MAX_SEED for seed in seeds)


@pytest.mark.parametrize("config_class", [GRPOConfig, SFTConfig, EIConfig, EvalConfig])
def test_an_unknown_prompt_format_is_refused_by_every_command(config_class):
    with pytest.raises(ValueError) as info:
        config_class(prompt_format="chatml")
    assert str(info.value) == "prompt_format: expected one of ['raw', 'chat', 'auto', 'r1_zero'], got 'chatml'"


def test_a_blank_eval_output_dir_is_refused():
    """Path(' ') is a folder named by a space, beside the user's files: no place they meant for results."""
    with pytest.raises(ValueError) as info:
        EvalConfig(output_dir="  ")
    assert str(info.value) == "output_dir: expected a folder path, got '  '"


@pytest.mark.parametrize("config_class", [GRPOConfig, SFTConfig, EIConfig])
def test_a_split_of_the_built_in_tasks_held_out_rows_is_refused_with_the_config(config_class):
    """They have no splits: a split named was ignored, the run evaluating on them anyway."""
    with pytest.raises(ValueError) as info:
        config_class(eval_steps=1, eval_dataset_split="validation")
    assert str(info.value) == ("eval_dataset_split: 'validation' names a split of eval_dataset; the built-in task (no "
                               "eval_dataset) has none")
    assert config_class(eval_steps=1, eval_dataset_split="test").eval_dataset_split == "test"
